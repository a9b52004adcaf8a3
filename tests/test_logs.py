"""plumbing/logs.py: the Logger's sinks (metrics.jsonl, wandb, tensorboard) failing for real: a missing package or a wandb
that cannot start is one line at start-up; a sink that fails mid-run (its directory deleted, the file-size limit, a
full device, wandb's service killed) is dropped with one warning line while training, checkpoints and the other
sinks go on (docs/troubleshooting.md 'Logs')."""

import functools
import glob
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import time

import pytest

from conftest import drained, start_drained

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--logging_steps", "1", "--per_device_train_batch_size", "16", "--num_generations", "4"]
SINKS = importlib.util.find_spec("wandb") and importlib.util.find_spec("tensorboard")


def start(args, out, env=None, preexec_fn=None, pipes=False):
    """train.py, its output read as it runs (start_drained); pipes: left to the test to read."""
    launch = functools.partial(subprocess.Popen, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) \
        if pipes else start_drained
    return launch([sys.executable, os.path.join(ROOT, "train.py"), *FLAGS, *args, "--output_dir", str(out)],
                  cwd=ROOT, preexec_fn=preexec_fn,
                  env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **(env or {})})


def lines_logged(out):
    try:
        with open(out / "metrics.jsonl") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def wait_for_lines(proc, out, n):
    while lines_logged(out) < n:
        assert proc.poll() is None, drained(proc)[1][-3000:]
        time.sleep(0.02)


def children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


def delete_output_dir(proc, out):
    wait_for_lines(proc, out, 5)
    while os.path.exists(out):  # a clean-up job, again while wandb's service adds a file under it
        shutil.rmtree(out, ignore_errors=True)


def kill_wandb_service(proc, out):
    wait_for_lines(proc, out, 5)
    (service,) = children(proc.pid)  # wandb-core, the process wandb.log talks to
    os.kill(service, 9)


def limit_file_size():
    """Files this process writes stop at 540 kB (the final model.safetensors has 533 kB; metrics.jsonl reaches the
    limit after about 340 lines): writes past it fail with EFBIG (Python ignores SIGXFSZ)."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (540_000, 540_000))


def full_device(out):
    """metrics.jsonl on /dev/full: every write of it fails with ENOSPC, as on a full disk."""
    os.makedirs(out)
    os.symlink("/dev/full", out / "metrics.jsonl")


@pytest.mark.slow
@pytest.mark.skipif(not SINKS, reason="wandb and tensorboard are not installed")
@pytest.mark.parametrize("case", ["output_dir deleted", "wandb service killed", "file-size limit", "full device"])
def test_a_sink_that_fails_mid_run_is_dropped_with_one_warning_and_the_run_goes_on(tmp_path, case):
    """Each failure for real: the output directory removed mid-run (metrics.jsonl, wandb's offline files and
    tensorboard's would be written into nothing), wandb's service process SIGKILLed (ConnectionResetError), RLIMIT_FSIZE
    reached by metrics.jsonl (Errno 27), metrics.jsonl on a full device (Errno 28). Each failed sink gets one warning
    line naming it and the error; the run ends with rc 0, no traceback, its checkpoints and final model written, the
    other sinks whole, and the last line says where metrics.jsonl stopped."""
    out = tmp_path / "run"
    args = {"output_dir deleted": ["--max_steps", "100", "--save_steps", "20", "--report_to", "wandb", "tensorboard"],
            "wandb service killed": ["--max_steps", "100", "--save_steps", "50", "--report_to", "wandb"],
            "file-size limit": ["--max_steps", "380", "--save_strategy", "no", "--per_device_train_batch_size", "8"],
            "full device": ["--max_steps", "20", "--save_steps", "10", "--report_to", "tensorboard"]}[case]
    if case == "full device":
        full_device(out)
    proc = start(args, out, preexec_fn=limit_file_size if case == "file-size limit" else None)
    if case == "output_dir deleted":
        delete_output_dir(proc, out)
    if case == "wandb service killed":
        kill_wandb_service(proc, out)
    stdout, stderr = drained(proc, 600)
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-3000:]
    warnings = [line.split("rloo: WARNING: ")[1] for line in stderr.splitlines() if "rloo: WARNING: " in line]
    expected = {"output_dir deleted": {f"{out}/metrics.jsonl": "was deleted", "wandb": "was deleted",
                                       "tensorboard": "was deleted"},
                "wandb service killed": {"wandb": "ConnectionResetError"},
                "file-size limit": {f"{out}/metrics.jsonl": "[Errno 27] File too large"},
                "full device": {f"{out}/metrics.jsonl": "[Errno 28] No space left on device"}}[case]
    assert len(warnings) == len(expected), warnings
    for sink, error in expected.items():
        (line,) = [w for w in warnings if w.startswith(f"{sink} failed at step ")]
        assert error in line and line.endswith("dropped; training, checkpoints and the other logs go on"), line
    assert os.path.exists(out / "model.safetensors")
    steps = int(args[1])
    if case != "file-size limit":
        assert os.path.isdir(out / f"checkpoint-{steps}")
    if case == "wandb service killed":  # metrics.jsonl, not the failed sink, is whole
        assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == list(range(1, steps + 1))
        assert f"metrics in {out}/metrics.jsonl, final model" in stdout
    if case == "full device":  # tensorboard, the other sink, has every step
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        (events,) = glob.glob(str(out / "runs" / "events.out.tfevents.*"))
        accumulator = EventAccumulator(events)
        accumulator.Reload()
        assert [event.step for event in accumulator.Scalars("loss")] == list(range(1, steps + 1))
    if case in ("file-size limit", "full device", "output_dir deleted"):
        assert f"metrics in {out}/metrics.jsonl (up to step " in stdout


def overlay_without(tmp_path, *packages):
    """A site directory holding every package of this environment but `packages`: a Python started with -S on it
    has them truly not installed."""
    import site
    (site_packages,) = [p for p in site.getsitepackages() if os.path.isdir(os.path.join(p, "torch"))]
    overlay = tmp_path / "site"
    overlay.mkdir()
    for name in os.listdir(site_packages):
        if not name.startswith(packages):
            os.symlink(os.path.join(site_packages, name), overlay / name)
    return overlay


@pytest.mark.slow
def test_a_sink_that_cannot_start_is_one_line_at_start_up(tmp_path):
    """--report_to wandb or tensorboard where the package is not installed: one line naming it before any model
    loads; wandb not logged in (online, no API key): one line saying to log in or go offline."""
    overlay = overlay_without(tmp_path, "wandb", "tensorboard")
    for sink in ("wandb", "tensorboard"):
        code = (f"import runpy, site, sys; site.addsitedir({str(overlay)!r}); "
                f"sys.argv = ['train.py', '--report_to', {sink!r}, '--output_dir', {str(tmp_path / sink)!r}]; "
                "runpy.run_path('train.py', run_name='__main__')")
        done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=ROOT,
                              timeout=300)
        assert done.returncode == 1 and done.stderr == f"error: --report_to {sink} needs {sink}: pip install {sink}\n"
    if importlib.util.find_spec("wandb") is None:
        pytest.skip("wandb is not installed: its start-up failure is not tried")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    done = subprocess.run([sys.executable, "train.py", "--max_steps", "1", "--report_to", "wandb", "--output_dir",
                           str(tmp_path / "online")], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**env, "HOME": str(tmp_path), "WANDB_MODE": "online", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (
        "error: --report_to wandb: wandb cannot start (UsageError: No API key configured. Use `wandb login` to log "
        "in.); log in (wandb login) or set WANDB_MODE=offline")


FULL_DISK = """
import os, subprocess, sys, time
mount, train = sys.argv[1], sys.argv[2:]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", mount], check=True)
out = os.path.join(mount, "run")
proc = subprocess.Popen(train + ["--output_dir", out])  # prints where this prints: read as it runs
while not os.path.exists(os.path.join(out, "metrics.jsonl")) or open(os.path.join(out, "metrics.jsonl")).read().count("\\n") < 5:
    assert proc.poll() is None
    time.sleep(0.02)
try:
    with open(os.path.join(mount, "filler"), "wb") as f:  # the disk fills up under the run
        while True:
            f.write(b"x" * 2**20)
except OSError:
    pass
sys.exit(proc.wait())
"""


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_a_full_disk_drops_the_sinks_with_a_line_each_then_the_checkpoint_is_one_line(tmp_path):
    """The output directory on a tmpfs of 8 MB (mounted in a user namespace) that fills up mid-run: metrics.jsonl
    and tensorboard (whose writer thread fails first, in its own thread) each get one warning line and no traceback;
    the checkpoint that follows cannot be written, which is the run's last line (no earlier checkpoint exists)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    train = [sys.executable, os.path.join(ROOT, "train.py"), *FLAGS, "--max_steps", "200", "--save_steps", "100",
             "--report_to", "tensorboard"]
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("no user namespaces here (unshare -rm): cannot mount a small disk")
    done = subprocess.run(["unshare", "-rm", sys.executable, "-c", FULL_DISK, str(mount), *train], capture_output=True,
                          text=True, cwd=ROOT, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Exception in thread" not in done.stderr, done.stderr[-3000:]
    warnings = [line.split("rloo: WARNING: ")[1] for line in done.stderr.splitlines() if "rloo: WARNING: " in line]
    assert sorted(w.split(" failed at step ")[0] for w in warnings) == [f"{mount}/run/metrics.jsonl", "tensorboard"]
    assert all("(OSError: [Errno 28] No space left on device): dropped" in w for w in warnings), warnings
    assert done.stderr.splitlines()[-1] == (
        f"error: cannot write {mount}/run/checkpoint-100 (OSError: [Errno 28] No space left on device): the partial "
        "copy is removed and no earlier checkpoint exists. To go on, free disk space, then run again")


def test_stdout_whose_reader_is_gone_stops_printing_not_the_run(tmp_path):
    """`python train.py | head -3`: once the reader has gone, a print would raise BrokenPipeError (Python ignores
    SIGPIPE); the run says so once on stderr and goes on to its last step, checkpoint and final model, with no
    traceback, not even at the interpreter's exit."""
    out = tmp_path / "run"
    proc = start(["--max_steps", "30", "--save_steps", "0"], out, pipes=True)
    for _ in range(3):
        proc.stdout.readline()
    proc.stdout.close()  # head has read its lines
    stderr = proc.stderr.read()
    assert proc.wait(timeout=600) == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-3000:]
    assert stderr.count("rloo: WARNING: stdout's reader is gone (broken pipe): nothing more is printed there") == 1
    assert lines_logged(out) == 30 and os.path.exists(out / "model.safetensors")
    assert os.path.isdir(out / "checkpoint-30")


def test_a_process_a_test_waits_on_never_blocks_on_its_output(tmp_path):
    """Ours (the tests' own helper): a run that prints more than a pipe holds (64 KiB) while a test waits for its
    steps goes on, and all it printed is read. Unread pipes stalled a vLLM takeover test for its 300 s timeout."""
    done = tmp_path / "done"
    proc = start_drained([sys.executable, "-c", "import sys; [print('x' * 99, file=f) for _ in range(2000) "
                          f"for f in (sys.stdout, sys.stderr)]; open({str(done)!r}, 'w').close(); sys.stdin.read()"],
                         stdin=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not done.exists():  # the test waits as the run tests wait for steps, the process still running
        assert proc.poll() is None and time.monotonic() < deadline, "the process blocked on its output"
        time.sleep(0.05)
    proc.stdin.close()
    stdout, stderr = drained(proc, 60)
    assert proc.returncode == 0 and stdout == stderr == ("x" * 99 + "\n") * 2000
