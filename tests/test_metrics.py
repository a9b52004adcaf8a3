"""step/metrics.py's figures mean what they say: a run's peak memory that no phase resets (for the run's own
memory/run_peak and for anyone reading the process's peak after it), and phase times that end where the
phase's work does (CUDA events on a GPU, read once a step)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRODUCT = [f for f in os.listdir(ROOT) if f.endswith(".py")]


def python(script, *args):
    """Run script in a fresh process (its own peak memory) -> the JSON it prints last."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


PHASES = """
    import json, sys
    import torch
    from step import metrics

    def clear_refs():  # what timed() did at each phase start before: reset the process's peak (proc(5))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    old = sys.argv[1] == "old"
    base = metrics.in_use()
    timings = {}
    for phase, mib in (("time/forward_backward", 400), ("time/optimizer", 0)):
        if old:
            clear_refs()
        with metrics.timed(timings, phase):  # no reading inside: the high-water mark it raised is its peak
            big = torch.ones(mib * 2**20 // 4)
            del big
    print(json.dumps({"base": base, "run_peak": metrics.run_peak(), "phase": timings["memory/forward_backward"]}))
"""


def test_a_phase_after_the_largest_one_no_longer_hides_the_runs_peak():
    """400 MiB in forward_backward, then a small optimizer phase: the process's peak mark (VmHWM, which getrusage's
    ru_maxrss reports and bench.py and any caller read; memory/run_peak) keeps the 400 MiB. The former reset at
    each phase start (put back here as the script's own clear_refs) left it at the last phase's: under 100 MiB above
    the start. (ru_maxrss itself is not read here: a child inherits its parent's at exec, pytest's GBs.) The phase
    that raised the mark reports it as its peak, with no reading taken while the 400 MiB were alive."""
    new, old = python(PHASES, "new"), python(PHASES, "old")
    assert new["run_peak"] >= new["base"] + 380 and new["phase"] >= new["base"] + 380, new
    assert old["run_peak"] < old["base"] + 100, old  # the old way understated the run's peak


def test_no_product_code_resets_a_process_wide_peak():
    """The peak is the process's, and a caller's: no file of the product writes clear_refs or resets the CUDA
    allocator's peak."""
    for name in PRODUCT:
        with open(os.path.join(ROOT, name)) as f:
            text = f.read()
        assert "clear_refs" not in text and "reset_peak_memory_stats" not in text, name


def test_after_train_main_the_process_peak_is_at_least_the_largest_before_or_during_it(tmp_path):
    """A caller that allocated 300 MiB before train.main still reads at least that as the process's peak after it,
    (VmHWM), and the run's memory/run_peak is at least every phase's peak it logged, and the caller's 300 MiB (a
    peak since the process started)."""
    out = python("""
        import json, sys, time
        import torch
        import train
        from step import metrics
        start = metrics.in_use()
        big = torch.ones(300 * 2**20 // 4)
        time.sleep(0.05)
        del big
        before = metrics.run_peak()
        train.main(["--max_steps", "4", "--logging_steps", "1", "--output_dir", sys.argv[1]])
        print(json.dumps({"start": start, "before": before, "after": metrics.run_peak()}))
    """, str(tmp_path / "run"))
    assert out["after"] >= out["before"] >= out["start"] + 290, out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        phases = [v for k, v in row.items() if k.startswith("memory/") and k != "memory/run_peak"]
        assert phases and row["memory/run_peak"] >= max(phases) and row["memory/run_peak"] >= out["before"], row


@pytest.mark.parametrize("accumulation", [1, 4])
def test_phase_times_end_at_events_read_once_a_step(tmp_path, accumulation):
    """Each timed phase's two ends are marks (CUDA events on a GPU, stood in for here by events that count their
    synchronizations): two synchronizations per step, whatever the number of micro-batches (one when the batch's
    metrics are read, one for the optimizer step's), every declared phase timed, and training encloses its
    forward+backward and optimizer phases."""
    out = python("""
        import json, sys, time
        import train
        from step import metrics

        class Event:  # torch.cuda.Event's interface: recorded at a phase end, read after a synchronization
            synced = 0
            def __init__(self):
                self.at = time.perf_counter()
            def synchronize(self):
                Event.synced += 1
            def elapsed_time(self, end):
                return 1000 * (end.at - self.at)

        metrics.mark = Event
        steps = 3
        train.main(["--max_steps", str(steps), "--logging_steps", "1", "--output_dir", sys.argv[1],
                    "--per_device_train_batch_size", str(128 // int(sys.argv[2])),
                    "--gradient_accumulation_steps", sys.argv[2]])
        print(json.dumps({"syncs": Event.synced, "steps": steps}))
    """, str(tmp_path / "run"), str(accumulation))
    assert out["syncs"] == 2 * out["steps"], out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    declared = {"time/generation", "time/rewards", "time/reference", "time/forward_backward", "time/optimizer",
                "time/training"}
    for row in rows:
        assert declared <= set(row) and all(row[k] > 0 for k in declared), row
        assert row["time/training"] >= row["time/forward_backward"] + row["time/optimizer"]


def test_no_thread_is_started_per_step(tmp_path):
    """Measuring costs no thread: after the first step's start-up (tqdm's monitor, the slow-reward watcher) the
    embedded default starts no Python thread, however many steps it runs: a memory sampler started and joined per
    phase (751 in 150 steps, a tenth of the run) or a watcher per reward call would show here. The run's threads
    are gone after it (process.borrowed)."""
    out = python("""
        import json, sys, threading
        import train
        starts, start = [], threading.Thread.start

        def counting(thread):
            starts.append(thread.name)
            return start(thread)

        threading.Thread.start = counting
        per_step, step_metrics = [], train.step_metrics

        def counted(*args, **kwargs):  # once per optimizer step
            per_step.append(len(starts))
            return step_metrics(*args, **kwargs)

        train.step_metrics = counted
        train.main(["--max_steps", "8", "--logging_steps", "1", "--output_dir", sys.argv[1]])
        print(json.dumps({"per_step": per_step, "names": starts,
                          "alive": sorted(t.name for t in threading.enumerate())}))
    """, str(tmp_path / "run"))
    assert len(out["per_step"]) == 8 and len(set(out["per_step"][1:])) == 1, out
    assert out["alive"] == ["MainThread"], out
