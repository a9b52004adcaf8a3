"""gpu_check.py, the prepared one-GPU check: it fits the device's lease by its own estimate, it runs end to end on the
CPU with a tiny shape writing one report line per run as each ends, a run past its time is stopped, a run that fails its
claim is reported failed, and the wheels it carries bring every requirement the GPU machine lacks (the GPU numbers come
from a device run)."""

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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = ["plan", "model", "embedded", "full", "lora", "packed", "trl"]


def report_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_gpu_check_fits_in_6_minutes_of_one_h200_by_its_own_estimate():
    config = dict(bench.CONFIGS["gpu"])
    steps = config.pop("steps")
    estimate = gpu_check.gpu_estimate(config, steps)
    # every completion runs to max_completion_length: steps x batch x length tokens per variant
    assert estimate["generated_tokens_per_variant"] == steps * config["batch"] * config["max_completion_length"]
    assert estimate["total_s"] <= 6 * 60, estimate
    # and its runs' timeouts stay within the device's 10-minute command limit
    assert gpu_check.TIMEOUT_FACTOR * estimate["variant_s"] < 600


def test_gpu_check_runs_on_cpu_with_a_tiny_shape_reporting_each_run_as_it_ends(tmp_path):
    report, log = tmp_path / "gpu.jsonl", tmp_path / "output.txt"
    with open(log, "w") as output:
        suite = subprocess.Popen([sys.executable, "gpu_check.py", "--tiny", "--steps", "4", "--deadline", "800",
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
    assert results["packed"]["paths"]["packed attention"] == "causal SDPA per sequence"  # a CPU's
    assert results["plan"]["versions"].startswith("torch ") and "peak_mib" in results["plan"]["methods"]
    assert "estimate on one H200" in out and "| lora |" in out


def test_a_gpu_check_past_its_deadline_reports_every_run_not_run():
    out = subprocess.run([sys.executable, "gpu_check.py", "--tiny", "--deadline", "0"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [line["run"] for line in lines] == RUNS
    assert all(line["error"].startswith("not run") for line in lines[2:])


def test_a_run_past_its_timeout_is_killed_with_its_children():
    start = time.perf_counter()
    # a grandchild holding the output open would keep a plain subprocess.run(timeout=...) waiting
    code, output = gpu_check.run_child([sys.executable, "-c", "import subprocess, time; print('started', flush=True); "
                                    "subprocess.Popen(['sleep', '60']); time.sleep(60)"], timeout=2)
    assert code is None and "started" in output
    assert time.perf_counter() - start < 30


def test_the_gpu_wheels_bring_every_requirement_the_gpu_machine_lacks():
    carried = {canonicalize_name(name) for name in gpu_check.GPU_WHEELS}
    for name, version in gpu_check.GPU_WHEELS.items():
        assert metadata.version(name) == version, f"the tests run {name} {metadata.version(name)}, the GPU {version}"
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                assert canonicalize_name(requirement.name) in carried | gpu_check.GPU_IMAGE, (name, line)
    assert gpu_check.unmet(gpu_check.GPU_IMPORTS) == []  # this machine has them all


def test_the_package_check_names_what_is_missing_or_too_old(monkeypatch):
    installed = metadata.version

    def version(name):
        if name == "dill":
            raise metadata.PackageNotFoundError(name)
        return "19.0.0" if name == "pyarrow" else installed(name)

    monkeypatch.setattr(metadata, "version", version)
    problems = gpu_check.unmet(["datasets", "no-such-package"])
    assert problems[0].startswith("dill not installed (for datasets)")
    assert problems[1:] == ["no-such-package: not installed", "pyarrow 19.0.0 (for datasets): needs >=24.0.0"]


def test_a_run_that_fails_its_claim_is_reported_failed(monkeypatch):
    """The gpu suite's verdict is each run's claims, not its exit code: an embedded run that does not learn, a
    packed run that took the per-sequence loop on a GPU, a LoRA run not lighter than full fine-tuning fail."""
    def held(name, row, results, tiny=False):
        return [c["held"] for c in gpu_check.claims(name, row, results, tiny)]

    assert held("embedded", {"first_tenth_reward": 0.1, "last_tenth_reward": 0.99}, {}) == [True]
    assert held("embedded", {"first_tenth_reward": 0.1, "last_tenth_reward": 0.5}, {}) == [False]
    assert held("embedded", {"last_tenth_reward": 0.0}, {}, tiny=True) == []  # 40 steps claim nothing
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    paths = {"precision": "bf16", "KV cache": "KVBuffer"}
    full = {"finite": True, "paths": paths, "peak_mib": 1000.0}
    assert held("full", full, {}) == [True, True, True]
    assert held("packed", {**full, "paths": {**paths, "packed attention": "causal SDPA per sequence"},
                           "peak_mib": 800.0}, {"full": full}) == [True, True, True, False, True]
    assert held("lora", {**full, "peak_mib": 900.0}, {"full": full}) == [True, True, True, False]
    assert held("full", {**full, "finite": False}, {}) == [False, True, True]
    args = types.SimpleNamespace(report=None, deadline=60, tiny=False)
    monkeypatch.setattr(gpu_check, "run_child", lambda cmd, timeout: (0, ""))
    row = gpu_check.gpu_run(args, "lora", [], lambda: {**full, "peak_mib": 900.0}, 1.0, time.monotonic() + 60,
                        {"full": full})
    assert row["passed"] is False and "error" not in row
