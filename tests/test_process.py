"""train.main as a library call (process.py): runs one after another in one process, each as from a fresh process,
the process left as found, errors a caller can catch, and the README's sweep as written."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUNS = """
    import json, logging, os, signal, sys, threading, warnings
    import torch
    import train

    def state():
        return {"handlers": [str(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGINT)],
                "excepthook": str(sys.excepthook), "threads": torch.get_num_threads(),
                "warnings": str(warnings.filters), "env": sorted(os.environ.items()),
                "levels": {n: l.level for n, l in logging.root.manager.loggerDict.items()
                           if isinstance(l, logging.Logger)},
                "python_threads": sorted(t.name for t in threading.enumerate()),
                "group": torch.distributed.is_initialized(),
                "user_modules": sorted(m for m in sys.modules if m.startswith("rloo_user"))}

    out, reward_file = sys.argv[1], sys.argv[2]
    flags = ["--max_steps", "12", "--logging_steps", "12", "--reward_funcs", reward_file + ":copied"]
    before, results, native = state(), [], []
    for name, extra in (("a", []), ("b", ["--learning_rate", "3e-3", "--padding_free"]), ("a", [])):
        result = train.main(flags + extra + ["--output_dir", os.path.join(out, name + str(len(results)))])
        results.append(result.metrics)
        native.append(len(os.listdir("/proc/self/task")))
        now = state()
        now["levels"] = {n: level for n, level in now["levels"].items() if n in before["levels"]}  # not new ones
        assert now == before, {k: (v, now[k]) for k, v in before.items() if now[k] != v}
    try:
        train.main(["--num_generations", "1", "--output_dir", os.path.join(out, "bad")])
    except train.Failed as e:
        failed = str(e)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    print(json.dumps({"results": results, "native": native, "failed": failed, "interrupted": interrupted}))
"""

REWARD = '''
CALLS = []  # module state: one module per run, read afresh by the next run


def copied(completions, target, **kwargs):
    CALLS.append(len(completions))
    return [sum(a == b for a, b in zip(c, t)) / len(t) for c, t in zip(completions, target)]
'''


@pytest.mark.stack
def test_runs_in_one_process_equal_fresh_ones_and_leave_the_process_as_found(tmp_path):
    """Three train.main calls in one process (the embedded task, then other flags, then the first again): after
    each, the signal handlers (SIGINT raises KeyboardInterrupt again), sys.excepthook (torch.distributed wraps it),
    torch's threads, environment, warnings filters, logger levels, Python threads (tqdm's monitor, the generation
    thread), process group and user modules are as before; native threads (library pools) do not grow from run to
    run. The repeated run's metrics equal the first's and a fresh process's; a bad flag raises config.Failed with
    its line, and the command line prints that one line."""
    (tmp_path / "reward.py").write_text(REWARD)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(RUNS), str(tmp_path), str(tmp_path / "reward.py")],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    first, other, again = out["results"]
    fresh = subprocess.run([sys.executable, "train.py", "--max_steps", "12", "--logging_steps", "12",
                            "--reward_funcs", f"{tmp_path / 'reward.py'}:copied", "--output_dir",
                            str(tmp_path / "fresh")], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    alone = json.loads((tmp_path / "fresh" / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("reward", "kl", "loss", "grad_norm", "completions/mean_length"):
        assert again[key] == first[key] == alone[key] or abs(again[key] - first[key]) < 1e-4, key
        assert abs(alone[key] - first[key]) < 1e-4 + 1e-3 * abs(first[key]), (key, alone[key], first[key])
    assert other["reward"] != first["reward"]
    assert out["native"][2] <= out["native"][1], out["native"]
    assert out["failed"] == "error: --num_generations 1: must be >= 2" and out["interrupted"]
    cli = subprocess.run([sys.executable, "train.py", "--num_generations", "1"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert cli.returncode == 1 and cli.stderr == "error: --num_generations 1: must be >= 2\n"


def test_the_readmes_sweep_runs_as_written(tmp_path):
    """README 'Sweeps': its block, run as it stands in a fresh directory, trains three learning rates in one
    process and prints each one's reward."""
    with open(os.path.join(ROOT, "README.md")) as f:
        block = re.search(r"### Sweeps.*?```python\n(.*?)```", f.read(), re.S)[1]
    done = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, cwd=tmp_path, timeout=900,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [line.split() for line in done.stdout.splitlines() if re.match(r"^[\d.e-]+ [\d.]+$", line)]
    assert [lr for lr, _ in printed] == ["0.0003", "0.001", "0.003"], done.stdout[-2000:]
    assert sorted(os.listdir(tmp_path / "runs")) == ["lr0.0003", "lr0.001", "lr0.003"]
