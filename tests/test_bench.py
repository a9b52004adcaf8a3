"""bench.py's prepared one-GPU check (--config gpu) runs end to end on the CPU with a tiny shape: every variant
reports its phases, and the embedded default's run reports its rewards (the GPU numbers come from a device run)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_suite_runs_on_cpu_with_a_tiny_shape(tmp_path):
    report = tmp_path / "gpu.json"
    out = subprocess.run([sys.executable, "bench.py", "--config", "gpu", "--tiny", "--steps", "4", "--report",
                          str(report)], capture_output=True, text=True, cwd=ROOT, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(report.read_text())
    assert results["embedded"]["steps"] == 40 and 0 <= results["embedded"]["last_tenth_reward"] <= 1
    for variant in ("full", "lora", "checkpointing", "trl"):
        assert "error" not in results[variant], (variant, results[variant])
        assert results[variant]["step_time"] > 0 and results[variant]["tokens_per_second/generation"] > 0
    assert "| lora |" in out.stdout


def test_the_multi_turn_benchmark_runs():
    out = subprocess.run([sys.executable, "bench.py", "--multi_turn", "--config", "overhead", "--steps", "4"],
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if "s per batch of 16" in line]
    assert [line.split()[0] for line in lines] == ["kept", "afresh"]
