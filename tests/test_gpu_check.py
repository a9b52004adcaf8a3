"""gpu_check.py, the prepared one-GPU check: it fits the device's lease by its own estimate, it runs end to end on the
CPU with a tiny shape writing one report line per run as each ends, a run past its time is stopped, a run that fails its
claim is reported failed, and the wheels it carries bring every requirement the GPU machine lacks (the GPU numbers come
from a device run)."""

import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import bench
import gpu_check
import gpu_wheels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = ["plan", "model", "embedded", "full", "lora", "packed", "trl", "compile", "resume", "vllm_colocate",
        "vllm_server", "nccl", "recipe"]


def report_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_gpu_check_fits_in_7_minutes_of_one_h200_by_its_own_estimate():
    """On the lent machine (one GPU, no vLLM): 7 minutes, so that it, a rerun of what failed (--only) and the
    machine's start fit the 15-minute lease; every run's timeout stays within the 10-minute command limit."""
    config = dict(bench.CONFIGS["gpu"])
    steps = config.pop("steps")
    estimate = gpu_check.gpu_estimate(config, steps, gpus=1, vllm=False)
    # every completion runs to max_completion_length: steps x batch x length tokens per variant
    assert estimate["generated_tokens_per_variant"] == steps * config["batch"] * config["max_completion_length"]
    assert estimate["total_s"] <= 7 * 60, estimate
    assert {"compile", "resume"} <= set(estimate["runs"]) and not {"vllm_colocate", "nccl"} & set(estimate["runs"])
    assert all(gpu_check.TIMEOUT_FACTOR * s < 600 for s in estimate["each_s"].values()), estimate
    # SmolLM2's 94 MiB travel in a second call (the docstring), which runs the recipe after the embedded run
    assert "recipe" not in estimate["runs"]
    assert sum(estimate["each_s"][run] for run in ("embedded", "recipe")) <= 5 * 60, estimate


def test_gpu_check_runs_on_cpu_with_a_tiny_shape_reporting_each_run_as_it_ends(tmp_path):
    report, log = tmp_path / "gpu.jsonl", tmp_path / "output.txt"
    with open(log, "w") as output:
        suite = subprocess.Popen([sys.executable, "benchmarks/gpu_check.py", "--tiny", "--steps", "4", "--deadline", "800",
                                  "--report", str(report)], stdout=output,
                                 stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            # the embedded run's line is on disk while the variants still run: a check cut short keeps it
            limit = time.monotonic() + 900
            while suite.poll() is None and time.monotonic() < limit and "embedded" not in [
                    line["run"] for line in report_lines(report)]:
                time.sleep(0.2)
            assert suite.poll() is None, "the embedded run's line appeared only at the end"
            suite.wait(timeout=900)
        finally:
            suite.kill()
    out = log.read_text()
    assert suite.returncode == 0, out[-3000:]
    lines = report_lines(report)
    assert [line["run"] for line in lines] == RUNS
    results = {line["run"]: line for line in lines}
    assert results["plan"]["missing"] == [] and results["plan"]["estimate"]["total_s"] > 0
    assert results["embedded"]["steps"] == 40 and 0 <= results["embedded"]["last_tenth_reward"] <= 1
    for variant in ("full", "lora", "packed", "trl"):
        assert "error" not in results[variant], (variant, results[variant])
        assert results[variant]["step_time"] > 0 and results[variant]["tokens_per_second/generation"] > 0
        assert results[variant]["passed"] and results[variant]["claims"], results[variant]
        # what the device computed (the tiny config asks for bf16), not the flag
        assert results[variant]["computed_dtypes"]["bfloat16"] > 0, results[variant]["computed_dtypes"]
    assert {"loss", "grad_norm"} <= set(results["trl"])  # TRL's own, not a 0.0 standing in for them
    assert results["packed"]["paths"]["packed attention"] == "causal SDPA per sequence"  # a CPU's
    assert results["compile"]["passed"] and results["compile"]["paths"]["KV cache"] == "StaticCache"
    assert results["resume"]["passed"] and results["resume"]["first_step"] == 31  # from the embedded run's step 30
    vllm = importlib.util.find_spec("vllm") is not None  # colocated on a CPU where it is installed
    assert results["vllm_colocate"].get("passed") if vllm else "needs vLLM" in results["vllm_colocate"]["not_run"]
    assert results["nccl"]["not_run"] == "needs 2 GPUs, this machine has 0"
    # SmolLM2 trained by the arithmetic recipe, evaluated greedily before and after (16 problems)
    assert results["recipe"]["passed"] and results["recipe"]["held_out_steps"] == [0, 2], results["recipe"]
    assert all(0 <= accuracy <= 1 for accuracy in results["recipe"]["held_out"])
    assert results["plan"]["versions"].startswith("torch ") and "peak_mib" in results["plan"]["methods"]
    assert "estimate on one H200" in out and "| lora |" in out
    assert "PASS full: bf16 compute" in out and "NOT RUN nccl: needs 2 GPUs" in out  # a verdict line per claim


def test_a_gpu_check_past_its_deadline_reports_every_run_not_run():
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--tiny", "--deadline", "0"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [line["run"] for line in lines] == RUNS
    assert all((line.get("error") or line["not_run"]).startswith(("not run", "needs")) for line in lines[2:])


def test_a_run_past_its_timeout_is_killed_with_its_children():
    start = time.perf_counter()
    # a grandchild holding the output open would keep a plain subprocess.run(timeout=...) waiting
    code, output = gpu_check.run_child([sys.executable, "-c", "import subprocess, time; print('started', flush=True); "
                                    "subprocess.Popen(['sleep', '60']); time.sleep(60)"], timeout=2)
    assert code is None and "started" in output
    assert time.perf_counter() - start < 30


def test_the_gpu_wheels_bring_every_requirement_the_gpu_machine_lacks():
    carried = {canonicalize_name(name) for name in gpu_wheels.GPU_WHEELS}
    for name, version in gpu_wheels.GPU_WHEELS.items():
        assert metadata.version(name) == version, f"the tests run {name} {metadata.version(name)}, the GPU {version}"
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                assert canonicalize_name(requirement.name) in carried | gpu_wheels.GPU_IMAGE, (name, line)
    assert gpu_wheels.unmet(gpu_wheels.GPU_IMPORTS) == []  # this machine has them all


def test_the_package_check_names_what_is_missing_or_too_old(monkeypatch):
    installed = metadata.version

    def version(name):
        if name == "dill":
            raise metadata.PackageNotFoundError(name)
        return "19.0.0" if name == "pyarrow" else installed(name)

    monkeypatch.setattr(metadata, "version", version)
    problems = gpu_wheels.unmet(["datasets", "no-such-package"])
    assert problems[0].startswith("dill not installed (for datasets)")
    assert problems[1:] == ["no-such-package: not installed", "pyarrow 19.0.0 (for datasets): needs >=24.0.0"]


# A row for each run on which every claim holds (on a GPU), and for each claim a change that makes it, and it alone,
# fail: the gpu suite's verdict is its claims, and a claim that cannot fail claims nothing.
GOOD = {
    "embedded": {"finite": True, "first_tenth_reward": 0.1, "last_tenth_reward": 0.99, "time/generation": 1.0,
                 "tokens_per_step": 1000.0, "steps": 500, "curve": {"491": {"loss": 0.001, "reward": 0.99}}},
    "full": {"finite": True, "computed_dtypes": {"bfloat16": 99, "float32": 1}, "paths": {}, "peak_mib": 1000.0,
             "tokens_per_second/generation": 8000.0},
    "lora": {"finite": True, "computed_dtypes": {"bfloat16": 10}, "peak_mib": 700.0},
    "packed": {"finite": True, "computed_dtypes": {"bfloat16": 10}, "peak_mib": 900.0,
               "paths": {"packed attention": "FlashAttention varlen"}},
    "trl": {"finite": True, "computed_dtypes": {"bfloat16": 10}},
    "compile": {"finite": True, "paths": {"decode step": "torch.compile mode reduce-overhead"},
                "time/generation": 0.5},
    "resume": {"finite": True, "first_step": 491, "curve": {"491": {"loss": 0.001, "reward": 0.99}}},
    "vllm_colocate": {"finite": True, "max_logp_difference": 1e-6, "min_weight_sync": 0.01},
    "vllm_server": {"finite": True, "max_logp_difference": 1e-6, "min_weight_sync": 0.01,
                    "paths": {"weight transfer": "ipc, vLLM >= 0.33 WeightSource.iter_full"}},
    "nccl": {"finite": True, "tokens_per_step": 2000.0},
    "recipe": {"finite": True, "steps": 80, "held_out": [0.2, 0.35], "held_out_steps": [0, 80]},
}
FAILING = [  # run, words of the claim, the change that fails it
    ("embedded", "finite", {"finite": False}),
    ("embedded", "learns", {"last_tenth_reward": 0.5}),
    ("full", "finite", {"finite": None}),  # a figure missing (TRL's rows had no loss nor gradient norm)
    ("full", "bf16 compute", {"computed_dtypes": {"float32": 100}}),  # asked for bf16, computed in fp32
    ("full", "decodes at", {"tokens_per_second/generation": 100.0}),
    ("lora", "finite", {"finite": False}),
    ("lora", "bf16 compute", {"computed_dtypes": {"bfloat16": 8, "float32": 2}}),
    ("lora", "peak memory", {"peak_mib": 900.0}),
    ("packed", "finite", {"finite": False}),
    ("packed", "bf16 compute", {"computed_dtypes": {}}),
    ("packed", "FlashAttention", {"paths": {"packed attention": "causal SDPA per sequence"}}),
    ("packed", "peak memory", {"peak_mib": 1200.0}),
    ("trl", "finite", {"finite": False}),
    ("trl", "bf16 compute", {"computed_dtypes": {"float16": 10}}),
    ("compile", "finite", {"finite": False}),
    ("compile", "is compiled", {"paths": {"decode step": "eager"}}),
    ("compile", "no slower", {"time/generation": 2.0}),
    ("resume", "finite", {"finite": False}),
    ("resume", "resumed at step 491", {"first_step": 1}),
    ("resume", "equal the uninterrupted", {"curve": {"491": {"loss": 0.001, "reward": 0.98}}}),
    ("vllm_colocate", "finite", {"finite": False}),
    ("vllm_colocate", "log-probs", {"max_logp_difference": 0.01}),
    ("vllm_colocate", "pushed before every step", {"min_weight_sync": 0.0}),
    ("vllm_server", "finite", {"finite": False}),
    ("vllm_server", "log-probs", {"max_logp_difference": float("inf")}),
    ("vllm_server", "pushed before every step", {"min_weight_sync": 0.0}),
    ("vllm_server", "CUDA IPC", {"paths": {"weight transfer": "nccl, vLLM >= 0.33 WeightSource.iter_full"}}),
    ("nccl", "finite", {"finite": False}),
    ("nccl", "two ranks", {"tokens_per_step": 1000.0}),
    ("recipe", "finite", {"finite": False}),
    ("recipe", "before training and after", {"held_out": [0.2], "held_out_steps": [0]}),  # no end
    ("recipe", "a real model learns", {"held_out": [0.2, 0.25]}),
]


def test_every_claim_can_fail_and_fails_alone(monkeypatch):
    """On GOOD every claim of every run holds; each change of FAILING fails the claim it names and no other; and
    every claim a run makes is in FAILING. (bf16 compute was read from the flag, the KV cache claim restated it, and
    TRL's missing loss and gradient norm counted as 0.0: none of them could fail.)"""
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    results = dict(GOOD)

    def verdicts(name, row):
        return {c["claim"]: c["held"] for c in gpu_check.claims(name, row, results, tiny=False)}

    covered = set()
    for name, row in GOOD.items():
        assert all(verdicts(name, row).values()), (name, verdicts(name, row))
    for name, words, change in FAILING:
        failed = [claim for claim, held in verdicts(name, {**GOOD[name], **change}).items() if not held]
        assert len(failed) == 1 and words in failed[0], (name, words, failed)
        covered.add((name, failed[0]))
    made = {(name, claim) for name in GOOD for claim in verdicts(name, GOOD[name])}
    assert made == covered, made - covered


def test_a_run_that_fails_its_claim_is_reported_failed(monkeypatch):
    """The verdict is the claims, not the exit code: a LoRA run not lighter than full fine-tuning fails, and its
    verdict lines say which claim."""
    full = GOOD["full"]
    args = types.SimpleNamespace(report=None, deadline=60, tiny=False)
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "run_child", lambda cmd, timeout, env=None: (0, ""))
    row = gpu_check.gpu_run(args, "lora", [], lambda output: {**GOOD["lora"], "peak_mib": 900.0}, 1.0,
                            time.monotonic() + 60, {"full": full})
    assert row["passed"] is False and "error" not in row
    assert [c["held"] for c in row["claims"]] == [True, True, False]
