"""train.main as a library call (plumbing/process.py): runs one after another in one process, each as from a fresh process,
the process left as found, errors a caller can catch, and the README's sweep as written."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

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

    # a fresh interpreter's Ctrl-C, whatever the parent left: a shell's background job (`pytest &`)
    # starts with SIGINT ignored, which Python keeps, and nothing would raise below
    signal.signal(signal.SIGINT, signal.default_int_handler)
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
        signal.raise_signal(signal.SIGINT)  # to this thread: its handler runs before it returns
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


@pytest.mark.slow
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


@pytest.mark.slow
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


CALLER = """
    import json, os, sys, threading, time
    import torch
    import train

    out, reward_file = sys.argv[1], sys.argv[2]
    flags = ["--max_steps", "2", "--logging_steps", "1", "--per_device_train_batch_size", "16", "--num_generations",
             "4", "--save_strategy", "no", "--reward_funcs", reward_file + ":probe"]
    MATMUL = (torch.backends.mkldnn.matmul, torch.backends.cuda.matmul)

    def modes():
        return {"grad": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled(),
                "dtype": str(torch.get_default_dtype()), "deterministic": torch.are_deterministic_algorithms_enabled(),
                "anomaly": torch.is_anomaly_enabled(), "matmul": [b.fp32_precision for b in MATMUL],
                "autocast": torch.is_autocast_enabled("cpu")}

    def state():
        return {"excepthook": str(sys.excepthook), "threads": sorted(t.name for t in threading.enumerate())}

    results, after = {}, {}
    with torch.no_grad():  # a notebook's evaluation cell, then a run
        results["no_grad"] = train.main(flags + ["--output_dir", os.path.join(out, "no_grad")]).metrics
        after["no_grad"] = modes()
    torch.manual_seed(123)
    drawn = torch.rand(2)
    torch.manual_seed(123)
    torch.rand(1)  # the caller's sweep draws one number, trains, draws the next
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.autograd.set_detect_anomaly(True)
    # a lower precision through torch's new API, which its legacy getter then refuses to read
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    before, caller = state(), modes()

    def worker():
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            results["thread"] = train.main(flags + ["--output_dir", os.path.join(out, "thread")]).metrics
            after["thread"] = modes()

    thread = threading.Thread(target=worker, name="sweep-worker")
    thread.start()
    while thread.is_alive() and len(open(os.environ["PROBE_FILE"]).readlines()) < 3:  # the thread's run scores
        time.sleep(0.01)
    try:
        train.main(flags + ["--output_dir", os.path.join(out, "second")])  # a second run meanwhile
    except train.Failed as e:
        concurrent = str(e)
    thread.join()
    rng_goes_on = torch.rand(1, dtype=torch.float32).item() == drawn[1].item()
    after["process"] = modes()
    try:
        with torch.device("meta"):
            train.main(flags + ["--output_dir", os.path.join(out, "meta")])
    except train.Failed as e:
        refused = str(e)
    print(json.dumps({"results": results, "after": after, "caller": caller, "state": [before, state()],
                      "rng_goes_on": rng_goes_on, "refused": refused, "concurrent": concurrent}))
"""

PROBE = '''
import json, os
import torch


def probe(completions, target, **kwargs):
    """The modes the run works under, seen from user code inside it."""
    with open(os.environ["PROBE_FILE"], "a") as f:
        f.write(json.dumps({"grad": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled(),
                            "dtype": str(torch.get_default_dtype()),
                            "deterministic": torch.are_deterministic_algorithms_enabled(),
                            "anomaly": torch.is_anomaly_enabled(),
                            "matmul": [b.fp32_precision for b in (torch.backends.mkldnn.matmul,
                                                                   torch.backends.cuda.matmul)],
                            "autocast": torch.is_autocast_enabled("cpu")}) + "\\n")
    return [sum(a == b for a, b in zip(c, t)) / len(t) for c, t in zip(completions, target)]
'''


def test_a_caller_s_torch_modes_and_thread_are_set_aside_for_the_run_and_given_back(tmp_path):
    """train.main under a caller's torch.no_grad(); then from a worker thread under inference_mode, autocast, a float64
    default dtype, deterministic algorithms, anomaly detection and a lower fp32 matmul precision set through torch's
    new API (its legacy getter then raises, which stopped train.main): each run works under a fresh process's modes
    (seen from a reward function inside it; IEEE fp32 on the CPU's matmul backend, while CUDA's, not the run's on a
    CPU, keeps the caller's) and trains as the other does; the thread's run
    says once that it has no signal handlers; afterwards the caller's modes, its random stream, sys.excepthook and
    threads (no tqdm monitor) are as before; a second run while the thread's goes on, and a caller's default device,
    are refused in one line."""
    (tmp_path / "probe.py").write_text(PROBE)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(CALLER), str(tmp_path), str(tmp_path / "probe.py")],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PROBE_FILE": str(tmp_path / "probe.jsonl")})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    fresh = {"grad": True, "inference": False, "dtype": "torch.float32", "deterministic": False, "anomaly": False,
             "matmul": ["none", "none"], "autocast": False}
    seen = [json.loads(line) for line in (tmp_path / "probe.jsonl").read_text().splitlines()]
    assert len(seen) == 4 and all({**modes, "matmul": None} == {**fresh, "matmul": None} for modes in seen), seen
    cuda = "ieee" if torch.cuda.is_available() else None  # the run's backend where CUDA is, else the caller's
    assert [modes["matmul"] for modes in seen] == [["ieee", cuda or "none"]] * 2 + [["ieee", cuda or "tf32"]] * 2
    for key in ("reward", "kl", "grad_norm", "entropy", "completions/mean_length"):
        assert out["results"]["thread"][key] == pytest.approx(out["results"]["no_grad"][key], rel=1e-5), key
    assert out["after"]["no_grad"] == {**fresh, "grad": False}
    assert out["after"]["thread"] == {**out["caller"], "grad": False, "inference": True, "autocast": True}
    assert out["after"]["process"] == out["caller"] == {**fresh, "dtype": "torch.float64", "deterministic": True,
                                                        "anomaly": True, "matmul": ["bf16", "tf32"]}
    before, now = out["state"]
    assert now == before and "tqdm_monitor" not in now["threads"], (before, now)
    assert out["rng_goes_on"]
    assert done.stderr.count("not the main one: no SIGTERM or Ctrl-C handler") == 1
    assert out["refused"].startswith("error: train.main runs under a default device of meta")
    assert out["concurrent"].startswith("error: train.main is already running in this process")
