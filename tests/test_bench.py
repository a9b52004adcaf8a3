"""bench.py's shapes the named configs lack: multi-turn decoding with the KV cache kept or not, and the training passes
on long-tailed lengths, padded and packed side by side (the one-GPU check is tests/test_gpu_check.py)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_multi_turn_benchmark_runs():
    out = subprocess.run([sys.executable, "bench.py", "--multi_turn", "--config", "overhead", "--steps", "4"],
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if "s per batch of 16" in line]
    assert [line.split()[0] for line in lines] == ["kept", "afresh"]


@pytest.mark.parametrize("multi_turn", [[], ["--multi_turn"]])
def test_the_long_tail_benchmark_reports_padded_and_packed_side_by_side(multi_turn):
    """One run, one table: each variant's training tokens/s, phase times and peak memory (its own
    process), after the batch's padding share."""
    out = subprocess.run([sys.executable, "bench.py", "--long_tail", "--steps", "4", *multi_turn],
                         capture_output=True, text=True, cwd=ROOT, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"64 completions.*padding \d+% of the padded forward's", out.stdout)
    rows = [line.split(" | ") for line in out.stdout.splitlines() if line.startswith("| pad")]
    assert [row[0] for row in rows] == ["| padded", "| padding_free", "| padding_free, 4096 tokens"]
    assert "tokens_per_second/training" in out.stdout and "peak_mib" in out.stdout
    assert all(float(value.strip(" |")) > 0 for row in rows for value in row[1:])
