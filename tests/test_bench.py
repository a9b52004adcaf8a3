"""bench.py's shapes the named configs lack: multi-turn decoding with the KV cache kept or not, and the training passes
on long-tailed lengths, padded and packed side by side (the one-GPU check is tests/test_gpu_check.py); its model
FLOPs and MFU per phase; bench_compare.py's pairs against another commit, and a run that measures nothing."""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import in_process
from step import metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_the_multi_turn_benchmark_runs():
    out = subprocess.run([sys.executable, "benchmarks/bench.py", "--multi_turn", "--config", "overhead", "--steps", "4"],
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if "s per batch of 16" in line]
    assert [line.split()[0] for line in lines] == ["kept", "afresh"]


@pytest.mark.slow
@pytest.mark.parametrize("multi_turn", [[], ["--multi_turn"]])
def test_the_long_tail_benchmark_reports_padded_and_packed_side_by_side(multi_turn):
    """One run, one table: each variant's training tokens/s, phase times and peak memory (its own
    process), after the batch's padding share."""
    out = subprocess.run([sys.executable, "benchmarks/bench.py", "--long_tail", "--steps", "4", *multi_turn],
                         capture_output=True, text=True, cwd=ROOT, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"64 completions.*padding \d+% of the padded forward's", out.stdout)
    rows = [line.split(" | ") for line in out.stdout.splitlines() if line.startswith("| pad")]
    assert [row[0] for row in rows] == ["| padded", "| padding_free", "| padding_free, 4096 tokens"]
    assert "tokens_per_second/training" in out.stdout and "peak_mib" in out.stdout
    assert all(float(value.strip(" |")) > 0 for row in rows for value in row[1:])


@pytest.mark.slow
def test_compare_times_this_tree_against_a_commit_pair_by_pair():
    """bench.py --compare HEAD on the embedded default (3 steps): B is checked out into a temporary worktree, gone
    after; one row per pair and a median row, each with its A/B ratio."""
    before = subprocess.run(["git", "worktree", "list"], capture_output=True, text=True, cwd=ROOT).stdout
    out = subprocess.run([sys.executable, "benchmarks/bench.py", "--compare", "HEAD", "--pairs", "2", "--embedded_steps", "3",
                          "--real_steps", "0"], capture_output=True, text=True, cwd=ROOT, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split(" | ") for line in out.stdout.splitlines() if line.startswith("| embedded default")]
    assert [row[1] for row in rows] == ["1", "2", "median"]
    for row in rows[:2]:
        a, b, ratio = (float(x) for x in row[2:5])
        assert abs(ratio - a / b) < 2e-3
    assert subprocess.run(["git", "worktree", "list"], capture_output=True, text=True, cwd=ROOT).stdout == before


def test_a_run_that_measures_nothing_trains_the_same(tmp_path, monkeypatch):
    """metrics.MEASURE off (bench.py --unmeasured, the cost of measuring): timed() reads no clock and no
    memory, the run trains to the same numbers, and its time/* and memory/<phase> are empty."""
    runs = {}
    for measure in (True, False):
        monkeypatch.setattr(metrics, "MEASURE", [measure])
        out = in_process(["--max_steps", "3", "--logging_steps", "1", "--output_dir", str(tmp_path / str(measure))])
        assert out.returncode == 0, out.stderr[-3000:]
        runs[measure] = [json.loads(line) for line in
                         (tmp_path / str(measure) / "metrics.jsonl").read_text().splitlines()]
    for on, off in zip(runs[True], runs[False]):
        assert on["loss"] == off["loss"] and on["reward"] == off["reward"]
        assert on["time/training"] > 0 and on["memory/training"] > 0
        assert off["time/training"] is None and "memory/training" not in off


def test_the_benchmark_reports_each_phases_model_flops_and_mfu():
    """bench.py measures the machine's matmul peak (fp32 and bf16) in the same run and gives each model phase its
    FLOPs (phase_flops' formula), FLOP/s and share of that peak, and the step's time outside model compute."""
    import bench
    weights, attention, hidden, vocab = sizes = (1000, 64, 16, 10)
    flops = bench.phase_flops(sizes, prompt_tokens=40, completion_tokens=60, rows=10)
    forward = 2 * weights * 100 + 4 * attention * 10 * 10 ** 2 / 2 + 2 * vocab * hidden * 60
    assert flops == {"time/generation": forward, "time/reference": forward, "time/forward_backward": 3 * forward}
    out = subprocess.run([sys.executable, "benchmarks/bench.py", "--config", "overhead", "--steps", "4"], capture_output=True,
                         text=True, cwd=ROOT, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    peaks = re.search(r"matmul peak.*fp32 ([\d.]+) GFLOP/s \((\d+)\^2\), bf16 ([\d.]+) GFLOP/s \((\d+)\^2\)", out.stdout)
    assert peaks and all(float(x) > 0 for x in peaks.groups()), out.stdout
    # 2048^2, or smaller where one matmul would take seconds (bf16 emulated on a CPU without AVX512-BF16: 53 s)
    assert {peaks[2], peaks[4]} <= {"256", "512", "1024", "2048"}, peaks.groups()
    rows = {m[1]: [float(x) for x in m.groups()[1:]] for m in re.finditer(
        r"^  (time/\w+) +([\d.]+) +([\d.]+) +([\d.]+)% +([\d.]+)$", out.stdout, re.M)}
    assert set(rows) == {"time/generation", "time/reference", "time/forward_backward"}, out.stdout
    assert all(gflop > 0 and 0 < mfu < 100 for gflop, _, mfu, _ in rows.values())
    assert re.search(r"step outside model compute +[\d.]+", out.stdout)
