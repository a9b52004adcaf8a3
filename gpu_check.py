"""The one-GPU check, prepared for the first GPU a task is lent: the embedded default must learn on
the device, then bench.py's gpu config (a Qwen2.5-0.5B shape, bf16, G=8, 32 prompts, 128 tokens)
runs as full fine-tuning, LoRA, checkpointing + packed rows, and TRL. Each run passes only when its
claims hold (it learns, the path it says it took, a memory bound), not by its exit code.

    python gpu_check.py --report gpu.jsonl      # on one GPU
    python gpu_check.py --tiny --steps 4        # a tiny model and batch: the check itself, on a CPU

It fits the device's 15-minute lease: its estimate (gpu_estimate, a token count at assumed H200
rates, not measured), printed first, is under 6 minutes (a test checks); the model is built once
for every run; each run is a process with a timeout; --report gets one JSON line per run as it
ends, the first (the plan) with the versions, the device and how each figure is measured. The GPU
machine (Python 3.12, no network) lacks datasets and TRL; here, then there:

    python gpu_check.py --wheels .whl  # GPU_WHEELS; the image has their other requirements
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 gpu_check.py --report $OUT/gpu.jsonl

which checks the installed versions first and names any missing or too old (datasets needs
pyarrow>=24; should the image's be older: --wheels .whl pyarrow==26.0.1, a 55 MB wheel).
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from importlib import metadata

import torch
from packaging.requirements import Requirement

import bench
import stack
from config import EMBEDDED_PRESET

BENCH_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench.py")

# the runs after the embedded default: name -> bench.py flags (each in a fresh process,
# so that peak memory is its own)
GPU_VARIANTS = {"full": [], "lora": ["--use_peft"],
                # the users' default checkpointing, with packed rows: a layer recomputed in backward
                # goes through the varlen attention again (FlashAttention's kernel on the GPU)
                "packed": ["--gradient_checkpointing", "true", "--padding_free"],
                "trl": ["--trainer", "trl"]}
# What the estimate assumes on one H200; none of it is measured on a GPU yet. Decoding is eager (no
# --compile_decode): a decode step of the 24-layer model costs ~32 ms of Python and kernel launches
# whatever the batch, so 8,000 tokens/s at the gpu config's 256 sequences. The training passes
# (forward+backward and the reference forward, ~10 N = 5 GFLOP a token) at ~125 TFLOP/s, a sixth of
# the bf16 peak: 25,000 tokens/s. A process spends ~25 s on imports, CUDA start-up, loading the
# model and saving the final one; a step of the embedded default (133k parameters) ~0.1 s of
# launches; building and saving the 0.5B model (2 GB) ~20 s.
H200 = dict(generated_tokens_per_s=8000, trained_tokens_per_s=25000, process_s=25,
            embedded_step_s=0.1, build_s=20)
PROMPT_TOKENS = 5  # the copy task's prompt, "4172=": one token per character
TIMEOUT_FACTOR = 3  # a run's timeout on a GPU, times its estimate (elsewhere: --deadline only)


def gpu_estimate(c, steps, tiny=False, rates=H200):
    """Seconds the gpu suite takes on one H200 by its own token count, at the assumed rates. A
    random model almost never samples EOS (1 of 151,936 tokens), so every completion runs to
    max_completion_length: a variant generates steps x batch x max_completion_length tokens and
    trains on steps x batch x (prompt + completion)."""
    generated = steps * c["batch"] * c["max_completion_length"]
    trained = steps * c["batch"] * (PROMPT_TOKENS + c["max_completion_length"])
    variant_s = (generated / rates["generated_tokens_per_s"]
                 + trained / rates["trained_tokens_per_s"] + rates["process_s"])
    embedded_steps = 40 if tiny else EMBEDDED_PRESET["max_steps"]
    embedded_s = embedded_steps * rates["embedded_step_s"] + rates["process_s"]
    total_s = rates["build_s"] + embedded_s + len(GPU_VARIANTS) * variant_s
    return dict(generated_tokens_per_variant=generated, trained_tokens_per_variant=trained,
                variant_s=variant_s, embedded_s=embedded_s, total_s=total_s, assumed=rates)


# The GPU machine's Python 3.12 has torch, transformers, peft and GPU_IMAGE, not datasets or TRL:
# they travel as wheels (python gpu_check.py --wheels .whl), each of whose requirements is carried
# too or already there (a test checks). The suite first checks the versions installed (unmet).
GPU_WHEELS = {"datasets": "5.2.0", "dill": "0.4.1", "multiprocess": "0.70.19", "trl": "1.16.0"}
GPU_IMAGE = {"accelerate", "filelock", "fsspec", "huggingface-hub", "jinja2", "numpy", "packaging",
             "pandas", "peft", "psutil", "pyarrow", "pyyaml", "tqdm", "transformers", "xxhash"}
GPU_IMPORTS = ["datasets", "trl", "peft"]  # what the suite needs beyond torch and transformers


def download_wheels(dest, pins):
    """GPU_WHEELS and pins (NAME==VERSION) for CPython 3.12 on x86-64 Linux, without their
    requirements (the image's)."""
    pins = [f"{name}=={version}" for name, version in GPU_WHEELS.items()] + pins
    platforms = ["--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64"]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", dest,
                    *pins], check=True, timeout=600)


def unmet(names):
    """What the installed packages lack for `names` and their own requirements: 'trl: not
    installed', 'pyarrow 19.0.0 (for datasets): needs >=24.0.0'. [] when nothing."""
    problems = [f"{name}: not installed" for name in names if stack.version(name) is None]
    for name in [name for name in names if stack.version(name) is not None]:
        for req in map(Requirement, metadata.requires(name) or []):
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue  # an extra's, or another platform's
            have = stack.version(req.name)
            if have is None or not req.specifier.contains(have, prereleases=True):
                problems.append(f"{req.name} {have or 'not installed'} (for {name}): needs "
                                f"{req.specifier or 'it'}")
    return sorted(set(problems))


def suite(args, c, steps, extra):
    """The prepared one-GPU check: the packages first (seconds, not minutes, when one is missing),
    then the model, built once for every run, then `python train.py` (the embedded default must
    learn on the device) and each variant of the gpu config: each a process with a timeout,
    reported as it ends. Prints one table at the end. -> whether every run passed (it ran, and its
    claims held)."""
    estimate = gpu_estimate(c, steps, args.tiny)
    print(f"estimate on one H200 at assumed rates (H200 in gpu_check.py; not measured): "
          f"{estimate['generated_tokens_per_variant']:,} tokens generated per variant, "
          f"{estimate['total_s']:.0f} s = {estimate['total_s'] / 60:.1f} min in all", flush=True)
    if args.report:
        open(args.report, "w").close()  # one line per run, appended as each ends
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    missing = unmet(GPU_IMPORTS)
    report_line(args.report, "plan", device=device, versions=stack.versions(), config=c,
                steps=steps, estimate=estimate, missing=missing, methods=METHODS)
    if missing:
        print("carry wheels for what is missing (gpu_check.py's docstring)", flush=True)
        return False
    work = tempfile.mkdtemp(prefix="rloo-gpu-check-")
    model, embedded = os.path.join(work, "model"), os.path.join(work, "embedded")
    tiny, deadline = ["--tiny"] if args.tiny else [], time.monotonic() + args.deadline
    train_py = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")
    try:
        start = time.perf_counter()
        bench.build_model(model, c["model"])  # once, for every run
        report_line(args.report, "model", seconds=round(time.perf_counter() - start, 1))
        # the embedded default on this device (tiny: 40 steps, too few to learn; it shows it runs)
        cmd = [sys.executable, train_py, "--output_dir", embedded, "--logging_steps", "1",
               *(["--max_steps", "40"] if args.tiny else [])]
        results = {}
        results["embedded"] = gpu_run(args, "embedded", cmd, lambda: reward_curve(embedded),
                                      estimate["embedded_s"], deadline, results)
        for name, flags in GPU_VARIANTS.items():
            report = os.path.join(work, f"{name}.json")
            cmd = [sys.executable, BENCH_PY, "--config", "gpu", "--model_dir", model, "--steps",
                   str(steps), "--report", report, *tiny, *flags, *extra]
            results[name] = gpu_run(args, name, cmd, lambda: read_json(report),
                                    estimate["variant_s"], deadline, results)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(results)
    return all(row["passed"] for row in results.values())  # a run that fails a claim failed


# How each figure of the gpu suite is measured, stated in its report (the plan line)
METHODS = {
    "step_time": "median over the steps after 3 warm-up ones of the wall time between two "
                 "optimizer-step ends (rloo: metrics.jsonl's step_time; TRL: a TrainerCallback)",
    "time/<phase>": "median per phase; rloo: between two CUDA events on the stream, read once a "
                    "step; TRL: the host's clock around its methods, each ending at "
                    "torch.cuda.synchronize()",
    "peak_mib": "the process's high-water mark after the run, each run in a process of its own, "
                "nothing reset: torch.cuda.max_memory_allocated on a GPU, VmHWM on a CPU "
                "(metrics.run_peak), for both trainers",
    "tokens_per_second/generation": "completion tokens per step over the median time/generation",
    "first_tenth_reward, last_tenth_reward": "mean reward over the first and the last tenth of the "
                                             "steps",
}


def claims(name, row, results, tiny):
    """What a run of the gpu suite claims, each with whether it held: [{claim, held, measured}]. A
    claim on learning needs the full embedded run (not --tiny's 40 steps); the memory claims, a GPU
    (a CPU's resident set is mostly the interpreter and the libraries)."""
    gpu, paths, found = torch.cuda.is_available(), row.get("paths", {}), []

    def claim(text, held, measured):
        found.append({"claim": text, "held": bool(held), "measured": measured})

    if name == "embedded" and not tiny:
        first, last = row.get("first_tenth_reward", 0.0), row.get("last_tenth_reward", 0.0)
        claim("learns: last tenth's reward >= 0.8 and >= 3x the first tenth's", last >= 0.8 and
              last >= 3 * first, f"{first:.3f} -> {last:.3f}")
    if name in GPU_VARIANTS:
        claim("finite loss, reward and gradient norm at every step", row.get("finite"),
              row.get("finite"))
    if name in ("full", "lora", "packed"):
        claim("bf16 compute", paths.get("precision") == "bf16", paths.get("precision"))
        claim("the decode loop's KV cache grows in place", paths.get("KV cache") == "KVBuffer",
              paths.get("KV cache"))
    if name == "packed":
        kernel = "FlashAttention varlen" if gpu else "causal SDPA per sequence"
        claim(f"packed rows attend through {kernel}", paths.get("packed attention") == kernel,
              paths.get("packed attention"))
    full = results.get("full", {}).get("peak_mib")
    if gpu and name in ("lora", "packed") and full:
        share = {"lora": 0.75, "packed": 1.0}[name]  # LoRA: no base gradients nor Adam states
        claim(f"peak memory under {share} x full fine-tuning's",
              row.get("peak_mib", full) < share * full, f"{row.get('peak_mib')} vs {full} MiB")
    return found


def gpu_run(args, name, cmd, read, estimate_s, deadline, results):
    """One run of the suite: cmd in its own process, its timeout TIMEOUT_FACTOR x its estimate on a
    GPU, within the deadline; read() -> its numbers. -> the line reported for it as it ends, with
    its wall time, its estimate, its claims and whether it passed: it ran and every claim held."""
    left = deadline - time.monotonic()
    if left <= 0:
        return report_line(args.report, name, error=f"not run: past --deadline {args.deadline} s",
                           passed=False)
    timeout = min(left, TIMEOUT_FACTOR * estimate_s) if torch.cuda.is_available() else left
    start = time.perf_counter()
    code, output = run_child(cmd, timeout)
    row = dict(seconds=round(time.perf_counter() - start, 1), estimate_s=round(estimate_s))
    if code != 0:
        why = f"timed out after {timeout:.0f} s" if code is None else f"exit code {code}"
        return report_line(args.report, name, error=why, output=output.strip().splitlines()[-3:],
                           passed=False, **row)
    row.update(read())
    row["claims"] = claims(name, row, results, args.tiny)
    row["passed"] = all(c["held"] for c in row["claims"])
    return report_line(args.report, name, **row)


def run_child(cmd, timeout):
    """cmd in its own process group, the whole group killed after `timeout` seconds (or when this
    process stops first) -> (its exit code, None if it timed out; its stdout and stderr)."""
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             process_group=0)
    output = None
    try:
        output = child.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        pass
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
    if output is None:
        return None, child.communicate()[0]
    return child.returncode, output


def report_line(path, run, **fields):
    """One line of the gpu suite's report, printed and appended to `path` (closed, so flushed) as
    soon as its run ends: a check cut short keeps what it measured."""
    line = json.dumps({"run": run, **fields})
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
    return {"run": run, **fields}


def read_json(path):
    with open(path) as f:
        return json.load(f)


def reward_curve(out):
    """A train.py run's mean reward over the first and last tenth of its steps (metrics.jsonl)."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        curve = [json.loads(line)["reward"] for line in f]
    tenth = max(1, len(curve) // 10)
    return {"first_tenth_reward": sum(curve[:tenth]) / tenth,
            "last_tenth_reward": sum(curve[-tenth:]) / tenth, "steps": len(curve)}


def print_table(results):
    keys = ["passed", "step_time", "time/generation", "time/reference", "time/forward_backward",
            "time/optimizer", "tokens_per_second/generation", "peak_mib"]
    print("| variant | " + " | ".join(keys) + " |\n" + "|---" * (len(keys) + 1) + "|")
    for name in GPU_VARIANTS:
        print(f"| {name} | " + " | ".join(f"{results[name][k]:.4g}" if isinstance(
            results[name].get(k), float) else str(results[name].get(k, "-")) for k in keys) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", help="one JSON line per run, each written as the run ends")
    parser.add_argument("--steps", type=int, help="steps per variant; default: the gpu config's")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny model and batch in place of the gpu config's (CPU)")
    parser.add_argument("--deadline", type=int, default=540, help="seconds, after which no run "
                        "starts and the one running stops (under the device's 10 min a command)")
    parser.add_argument("--wheels", metavar="DIR", help="only download the GPU machine's wheels "
                        "(GPU_WHEELS, then any NAME==VERSION given) into DIR")
    args, extra = parser.parse_known_args()  # any other flag goes to every variant's train.py
    if args.wheels:
        return download_wheels(args.wheels, extra)
    c = bench.bench_config(argparse.Namespace(config="gpu", tiny=args.tiny,
                                              max_completion_length=None))
    default_steps = c.pop("steps", 20)
    steps = args.steps or default_steps
    sys.exit(0 if suite(args, c, steps, extra) else 1)


if __name__ == "__main__":
    main()
