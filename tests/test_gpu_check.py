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

import pytest

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import bench
import gpu_check
import gpu_wheels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = ["plan", "embedded", "model", "full", "packed", "compile", "vllm_colocate", "vllm_server", "resume", "lora",
        "nccl", "trl", "recipe", "recipe_vllm"]
LENT = dict(gpus=1, vllm=False, smollm2=True)  # the lent H100: no vLLM to carry, SmolLM2 carried


def report_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def gpu_config():
    config = dict(bench.CONFIGS["gpu"])
    return config, config.pop("steps")


def test_the_lent_machines_plan_fits_its_15_minutes_on_one_h100():
    """The first 15 minutes a GPU is lent (one H100; its start, the calls, the idle wait between them all count):
    two calls, each within its 10 minutes and 64 MiB, the first the GPU paths, the second SmolLM2's recipe. By its
    own estimates the whole was 551 s once the recipe was in, 766 s with vLLM, past its 540 s deadline: a run past
    it was FAIL. Every run's budget fits a call."""
    config, steps = gpu_config()
    estimate = gpu_check.gpu_estimate(config, steps, **LENT)
    plan, lease = estimate["plan"], gpu_check.LEASE
    # every completion runs to max_completion_length: steps x batch x length tokens per variant
    assert estimate["generated_tokens_per_variant"] == steps * config["batch"] * config["max_completion_length"]
    assert plan["device_s"] <= lease["device_s"] and plan["left_s"] >= 60, plan  # a minute to spare
    for call in plan["calls"].values():
        assert call["command_s"] - lease["install_s"] <= lease["deadline_s"], plan
        assert call["carry_mib"] <= 64, plan
    assert lease["install_s"] + lease["deadline_s"] < lease["call_s"]
    assert {"embedded", "full", "packed", "compile", "resume", "lora"} <= set(plan["calls"][1]["runs"])
    assert plan["calls"][2]["runs"] == ["recipe"] and not {"vllm_colocate", "nccl"} & set(estimate["runs"])
    assert all(gpu_check.BUDGET_FACTOR * s < lease["deadline_s"] for s in estimate["each_s"].values()), estimate


def simulated(monkeypatch, call, machine, deadline=540, takes=None):
    """run_all's bookkeeping on the lent machine's terms, on the CPU: a clock of its own, each run taking its
    estimate (or takes[run] seconds) and returning GOOD's numbers. -> {run: its report line}"""
    config, steps = gpu_config()
    each = gpu_check.estimates(config, steps)
    clock = [0.0]

    def child(cmd, timeout, env=None):
        spent = (takes or {}).get(cmd[0], each[cmd[0]])
        clock[0] += min(spent, timeout)
        return (0, "") if spent <= timeout else (None, "")

    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(gpu_check, "run_child", child)
    monkeypatch.setattr(gpu_check.bench, "build_model", lambda *a: clock.__setitem__(0, clock[0] + each["model"]))
    monkeypatch.setattr(gpu_check, "variant_command", lambda args, name, *rest: ([name], None, lambda out: GOOD[name]))
    args = types.SimpleNamespace(report=None, deadline=deadline, tiny=False, call=call, only=None)
    results = gpu_check.run_all(args, config, steps, [], "/nonexistent", each, machine)
    assert clock[0] <= deadline, clock
    return results


def test_the_plans_bookkeeping_runs_what_fits_and_reports_the_rest_not_run(monkeypatch):
    """The plan, run: on the lent machine each call runs its planned runs, all of them within --deadline (the
    others NOT RUN for what they need). With vLLM there too, the runs the deadline leaves no time for are NOT RUN,
    not FAIL (a run past the deadline failed); a run stopped by the deadline is NOT RUN; one over its own budget
    (BUDGET_FACTOR x its estimate), FAIL."""
    config, steps = gpu_config()
    plan = gpu_check.gpu_estimate(config, steps, **LENT)["plan"]
    for call in (1, 2):
        results = simulated(monkeypatch, call, tuple(LENT.values()))
        ran = [name for name, row in results.items() if "not_run" not in row and name != "model"]
        assert ran == plan["calls"][call]["runs"] and all(results[name]["passed"] for name in ran), results
        assert all(row["not_run"].startswith("needs") for row in results.values() if "not_run" in row), results
    results = simulated(monkeypatch, 1, (1, True, True))
    assert all("error" not in row for row in results.values()), results
    assert results["vllm_server"]["passed"] and results["trl"]["not_run"].startswith("not reached: "), results
    results = simulated(monkeypatch, 1, (1, False, True), deadline=180, takes={"full": 120})
    assert results["full"]["not_run"] == "stopped at --deadline 180 s", results
    results = simulated(monkeypatch, 1, (1, False, True), takes={"full": 1000})
    assert results["full"]["error"] == "over its budget of 132 s" and results["packed"]["passed"], results


@pytest.mark.slow
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
    assert results["plan"]["missing"] == [] and results["plan"]["estimate"]["plan"]["device_s"] > 0
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
    for name in ("vllm_colocate", "recipe_vllm"):
        assert results[name].get("passed") if vllm else "needs vLLM" in results[name]["not_run"], results[name]
    assert results["nccl"]["not_run"] == "needs 2 GPUs, this machine has 0"
    # SmolLM2 trained by the arithmetic recipe, evaluated greedily before and after (16 problems)
    assert results["recipe"]["passed"] and results["recipe"]["held_out_steps"] == [0, 2], results["recipe"]
    assert all(0 <= accuracy <= 1 for accuracy in results["recipe"]["held_out"])
    assert results["plan"]["versions"].startswith("torch ") and "peak_mib" in results["plan"]["methods"]
    assert "the plan, at assumed H100 rates" in out and "| lora |" in out
    assert "PASS full: bf16 compute" in out and "NOT RUN nccl: needs 2 GPUs" in out  # a verdict line per claim


def test_a_gpu_check_past_its_deadline_reports_every_run_not_run():
    """Not reached is not failed: every run NOT RUN with why (the deadline, or what it needs), and the check passes."""
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--tiny", "--deadline", "0"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [line["run"] for line in lines] == [run for run in RUNS if run != "model"]  # nothing needed it built
    assert all(line["not_run"].startswith(("not reached", "needs")) for line in lines[1:]), lines
    assert "FAIL" not in out.stdout and out.stdout.count("NOT RUN ") == len(lines) - 1


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
    "recipe_vllm": {"finite": True, "steps": 80, "held_out": [0.2, 0.35], "held_out_steps": [0, 80],
                    "min_weight_sync": 0.01},
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
    ("recipe_vllm", "finite", {"finite": False}),
    ("recipe_vllm", "pushed before every step", {"min_weight_sync": 0.0}),
    ("recipe_vllm", "before training and after", {"held_out_steps": [0, 40]}),
    ("recipe_vllm", "a real model learns", {"held_out": [0.3, 0.3]}),
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
