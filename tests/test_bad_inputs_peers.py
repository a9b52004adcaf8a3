"""Bad input by class (issue 29), classes 5 and 6: peers and messages, a busy laptop. One row per case, each with the
line it must print or the behaviour it must keep: a lost torchrun peer ends the survivors with one line naming it and
the last intact checkpoint; a conversation's roles are ones the chat template renders, and it keeps every message's
content; the CPU thread count backs off from cores other processes keep busy, and OMP_NUM_THREADS overrides it."""

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

import train
from plumbing import checkpoint, distributed
from step import data
from chat_templates import LLAMA3_1, NO_TOOLS, QWEN2_5

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--tee", "3"]
TINY = ["--logging_steps", "1", "--per_device_train_batch_size", "8", "--num_generations", "4",
        "--max_completion_length", "6"]


# ------------------------------------------------------------------------------------------------ lost peers

KILLER = '''
import os
import signal

import rewards


def die(completions, target, step, **kwargs):
    """At step {step}, ranks {ranks} do `how` while scoring (SIGKILL: nothing of it is left to clean up)."""
    if os.environ.get("RANK") in {ranks} and step == {step}:
        {how}
    return rewards.task_reward(completions, target)
'''
KILL = "os.kill(os.getpid(), signal.SIGKILL)"
RAISE = "raise ValueError('rank 1 cannot go on')"

PEER_CASES = {  # name: (step rank 1 dies at, how, flags, what rank 0's line must say)
    "SIGKILL after step 2, checkpoints saved (issue)": (2, KILL, ["--max_steps", "6", "--save_steps", "1"],
                                                        "rank 1's process has ended"),
    # ours: its own error at step 0, before any checkpoint
    "own error at step 0, nothing saved": (0, RAISE, ["--max_steps", "4", "--save_strategy", "no"],
                                          "no checkpoint was saved"),
}


def run_with_peer(tmp_path, ranks, step, how, flags):
    """train.py under torchrun, 2 processes, `ranks` doing `how` at `step` -> (the run, rank 0's own lines)."""
    (tmp_path / "killer.py").write_text(KILLER.format(ranks=ranks, step=step, how=how))
    logs = tmp_path / "logs"  # each rank's own stdout and stderr (torchrun --tee), not the interleaved console
    done = subprocess.run(TORCHRUN + ["--log_dir", str(logs), os.path.join(ROOT, "train.py"), *TINY, *flags,
                                      "--reward_funcs", f"{tmp_path / 'killer.py'}:die", "--output_dir",
                                      str(tmp_path / "run")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    rank0 = [line for path in sorted(glob.glob(f"{logs}/*/attempt_0/0/std*.log"))
             for line in open(path).read().replace("\r", "\n").splitlines()]
    assert rank0, done.stderr[-2000:]
    return done, rank0


@pytest.mark.slow
def test_sigterm_to_every_rank_with_no_peer_lost_still_checkpoints(tmp_path):
    """Ours: SLURM's SIGTERM reaches every rank of a healthy run: a checkpoint at the end of the step, as before, and
    no peer named lost."""
    done, rank0 = run_with_peer(tmp_path, ["0", "1"], 1, "os.kill(os.getpid(), signal.SIGTERM)",
                                ["--max_steps", "50", "--save_steps", "0"])
    assert done.returncode == 0, "\n".join(rank0[-30:])
    assert any("rloo: stopped by a signal: saved checkpoint-2" in line for line in rank0), "\n".join(rank0[-30:])
    assert not any("lost peer" in line for line in rank0)
    assert checkpoint.damage(str(tmp_path / "run" / "checkpoint-2")) is None


@pytest.mark.slow
@pytest.mark.parametrize("case", list(PEER_CASES))
def test_a_lost_torchrun_peer_is_one_line_naming_it_and_the_last_intact_checkpoint(tmp_path, case):
    """Rank 0's own stream (torchrun --tee) holds one line naming rank 1 and the checkpoint to resume from, no
    traceback; the checkpoint it names is whole and loads."""
    step, how, flags, says = PEER_CASES[case]
    done, rank0 = run_with_peer(tmp_path, ["1"], step, how, flags)
    assert done.returncode != 0
    lost = [line for line in rank0 if "lost peer" in line]
    assert len(lost) == 1, "\n".join(rank0[-30:])
    assert lost[0].startswith("error: lost peer: rank 1") and says in lost[0], lost[0]
    assert not any("Traceback" in line for line in rank0), "\n".join(rank0[-30:])
    out = tmp_path / "run"
    whole = [path for path in checkpoint.checkpoint_dirs(out) if checkpoint.damage(path) is None]
    if "--save_steps" in flags:
        assert whole and f"the last intact checkpoint is {whole[-1]}" in lost[0], lost[0]
        checkpoint.export_checkpoint(whole[-1], str(tmp_path / "exported"))  # the sharded checkpoint loads
        assert (tmp_path / "exported" / "config.json").exists()
    else:
        assert not whole


def dead_pid():
    """A process that has ended but is not reaped yet (a zombie, as torchrun's worker is for a moment)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while distributed.process_ended(child.pid) is False:
        os.sched_yield()
    return child


def test_process_ended_sees_gone_and_zombie_peers_not_live_ones():
    child = dead_pid()  # a zombie
    assert distributed.process_ended(child.pid)
    child.wait()  # reaped: gone
    assert distributed.process_ended(child.pid)
    assert not distributed.process_ended(os.getpid())


def test_lost_peers_names_the_ranks_gone_on_this_host_only(monkeypatch):
    child = dead_pid()
    host = socket.gethostname()
    monkeypatch.setattr(distributed, "PEERS", [(host, os.getpid()), (host, child.pid), ("elsewhere", child.pid)])
    assert distributed.lost_peers(wait=0) == [1]  # another host's peer cannot be looked at
    monkeypatch.setattr(distributed, "PEERS", [(host, os.getpid())])
    assert distributed.lost_peers(wait=0.1) == []
    child.wait()



GLOO_EXIT = """
    import os, sys, threading
    from plumbing import distributed
    distributed.setup_distributed()
    workers = list(distributed.gloo_workers())  # torch's default: two
    assert len(workers) >= 2, (workers, distributed.threads())
    assert str(threading.get_native_id()) not in workers
    distributed.shutdown()
    for t in workers:  # parked (or ended, where nothing else held the group), as the exit needs
        if os.path.exists(f"/proc/self/task/{t}/stat"):
            with open(f"/proc/self/task/{t}/stat") as f:
                assert f.read().rsplit(")", 1)[1].split()[0] == "S", t
    print("workers", len(workers))
"""


@pytest.mark.stack
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="threads are read from Linux's /proc")
def test_the_exit_waits_on_gloo_s_workers_named_or_not():
    """distributed.shutdown waits until gloo's worker threads are parked before the interpreter
    finalizes (else a worker dropping a collective's tensors aborts the process). Torch 2.9 leaves
    them unnamed: a wait for the name pt_gloo_runloop alone waited on none, and a two-rank test
    aborted at exit in CI's oldest stage (torch 2.9). setup_distributed notes the threads gloo
    started."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(GLOO_EXIT)], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0 and "workers" in done.stdout, done.stderr[-2000:]

COLLECTIVE_ERRORS = [  # (error, a lost peer's collective?)
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"), True),
    (torch.distributed.DistBackendError("Watchdog caught collective operation timeout"), True),
    (torch.distributed.DistNetworkError("Connection refused"), True),
    (ValueError("a bug of ours"), False),  # ours: keeps its traceback
    (RuntimeError("CUDA out of memory"), False),
]


@pytest.mark.parametrize("error, collective", COLLECTIVE_ERRORS)
def test_collective_failed_tells_a_lost_peer_from_a_bug(error, collective):
    assert distributed.collective_failed(error) is collective


SURVIVOR = '''
import os, signal, socket, sys, time
sys.path.insert(0, {root!r})
from plumbing import checkpoint, distributed
distributed.PEERS[:] = [(socket.gethostname(), os.getpid()), (socket.gethostname(), {dead})]
checkpoint.watch_signals("cpu", {out!r})
try:
    {then}
except Exception as error:  # as train.main does on an error's way out
    checkpoint.stop_if_a_peer_is_lost({out!r}, error)
    raise
'''
SURVIVOR_CASES = {  # name: (what the survivor does next, the line, exit code)
    # torchrun's SIGTERM after rank 1 died: no wait for a step's end (whose collectives would hang)
    "SIGTERM with a dead peer exits at once": ("os.kill(os.getpid(), signal.SIGTERM); time.sleep(60)",
                                               "rank 1's process has ended", 1),
    "the collective's error reaches the top": ("raise RuntimeError('gloo/transport/tcp/pair.cc: Connection reset')",
                                               "rank 1's process has ended", 1),
    "no checkpoint yet": ("raise RuntimeError('boom')", "no checkpoint was saved", 1),
}


@pytest.mark.parametrize("case", list(SURVIVOR_CASES))
def test_a_survivor_of_a_lost_peer_prints_one_line_and_no_traceback(tmp_path, case):
    then, says, code = SURVIVOR_CASES[case]
    out = tmp_path / "run"
    if "no checkpoint" not in case:
        (out / "checkpoint-1").mkdir(parents=True)
        (out / "checkpoint-1" / "trainer_state.json").write_text("{}")
        checkpoint.write_manifest(str(out / "checkpoint-1"))
        (out / "checkpoint-2.tmp").mkdir()  # a save the kill cut short: not intact
    child = dead_pid()
    script = SURVIVOR.format(root=ROOT, dead=child.pid, out=str(out), then=then)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=60)
    child.wait()
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code and len(lines) == 1 and says in lines[0], done.stderr
    if "no checkpoint" not in case:
        assert f"the last intact checkpoint is {out / 'checkpoint-1'}" in lines[0]


def test_an_error_with_every_peer_alive_keeps_its_traceback(tmp_path):
    """Our own bug in a multi-process run is not blamed on a peer."""
    script = SURVIVOR.format(root=ROOT, dead=os.getpid(), out=str(tmp_path), then="raise ValueError('ours')")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" in done.stderr and "ValueError: ours" in done.stderr
    assert "lost peer" not in done.stderr


# ------------------------------------------------------------------------------------------------ roles

LEAVES_SYSTEM_OUT = ("{% for m in messages %}{% if m['role'] in ['user', 'assistant'] %}<|{{ m['role'] }}|>"
                     "{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
TRIMS = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}{% endfor %}"
USER = {"role": "user", "content": "1="}
ROLE_CASES = {  # name: (template, prompts, what the line must say; None: accepted)
    "robot on SmolLM2's ChatML (issue)": (NO_TOOLS, [[USER], [{"role": "robot", "content": "1="}]],
                                          "dataset row 1: a message has the role 'robot'"),
    "robot on Qwen2.5, which drops it": (QWEN2_5, [[{"role": "robot", "content": "1="}]],
                                         "roles: system, user, assistant, tool"),
    # ours
    "developer, a role Qwen2.5 does not name": (QWEN2_5, [[{"role": "developer", "content": "be brief"}, USER]],
                                                "the role 'developer'"),
    "a role's case matters": (NO_TOOLS, [[{"role": "User", "content": "1="}]], "the role 'User'"),
    "ipython, which Llama 3.1 names": (LLAMA3_1, [[USER, {"role": "ipython", "content": "42"}]], None),
    "tool result on Qwen2.5": (QWEN2_5, [[USER, {"role": "assistant", "content": "x"},
                                          {"role": "tool", "content": "42"}]], None),
    "a template that drops system": (LEAVES_SYSTEM_OUT, [[{"role": "system", "content": "answer in hex"}, USER]],
                                     "leaves out message 0 (system: 'answer in hex')"),
    "content the template trims": (TRIMS, [[{"role": "user", "content": "  1=\n"}]], None),
    "probed once per role sequence, any row": (LEAVES_SYSTEM_OUT, [[USER]] * 3 + [[{"role": "system", "content": "octal"},
                                                                                 USER]], "dataset row 3"),
    "string prompts need no roles": (NO_TOOLS, ["12=", "3="], None),
}


@pytest.mark.parametrize("case", list(ROLE_CASES))
def test_a_role_the_template_does_not_render_is_one_line_naming_row_and_role(case):
    template, prompts, says = ROLE_CASES[case]
    _, tokenizer, _ = data.embedded_task(0)
    tokenizer.chat_template = template
    cfg = train.parse_config([])
    try:
        data.check_roles(prompts, tokenizer, cfg, "dataset")
        error = None
    except SystemExit as e:
        error = str(e)
    if says is None:
        assert error is None, error
    else:
        assert error is not None and says in error and "\n" not in error, error


@pytest.mark.parametrize("split, flags", [("dataset", ()), ("stream", ("--streaming",)),
                                          ("eval split 'train'", ("--eval_split", "train"))])
def test_check_data_refuses_an_unknown_role_in_every_split(tmp_path, split, flags):
    """Ours: the check runs at the boundary, data.check_data, for the training set, a stream's first row and eval
    sets."""
    rows = [{"prompt": [{"role": "robot", "content": "1="}], "target": "1"}] * 4
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model, tokenizer, _ = data.embedded_task(0)
    tokenizer.chat_template = NO_TOOLS
    cfg = train.parse_config(["--dataset", str(tmp_path / "data.jsonl"), "--per_device_train_batch_size", "2",
                              "--num_generations", "2", "--max_completion_length", "4", *flags])
    dataset, eval_sets, _ = data.load_datasets(cfg)
    with pytest.raises(SystemExit, match=f"{split} row 0: a message has the role 'robot'"):
        if split.startswith("eval"):
            tokenizer.chat_template = NO_TOOLS
            data.check_data(eval_sets["train"], tokenizer, None, model, cfg, data.eval_where(cfg, "train"))
        data.check_data(dataset, tokenizer, None, model, cfg)


# ------------------------------------------------------------------------------------------------ threads

THREAD_CASES = [  # (cores, cores other processes keep busy, OMP_NUM_THREADS, threads, the reason says)
    (2, 0.0, None, 2, "2 of 2 cores idle"),  # quiet laptop: every core
    (2, 1.0, None, 1, "1 of 2 cores idle"),  # the issue's: one busy neighbour
    # ours
    (2, 0.3, None, 2, "2 of 2 cores idle"),  # a light neighbour: not worth a core
    (2, 2.0, None, 1, "0 of 2 cores idle"),  # every core busy: still one thread
    (16, 5.0, None, 11, "11 of 16 cores idle"),
    (1, 0.0, None, 1, "1 of 1 cores idle"),
    (2, 1.0, "2", 2, "OMP_NUM_THREADS=2"),  # the environment overrides the rule
    (2, 0.0, "1", 1, "OMP_NUM_THREADS=1"),
]


@pytest.mark.parametrize("cores, busy, env, threads, says", THREAD_CASES)
def test_cpu_threads_back_off_from_busy_cores_and_omp_num_threads_overrides(cores, busy, env, threads, says):
    chosen, reason = distributed.choose_cpu_threads(cores, busy, env)
    assert chosen == threads and says in reason


def test_busy_cores_counts_only_the_cores_this_process_may_run_on(monkeypatch):
    """Review: the load of cores outside this process's affinity (another job's) is not ours to back off from. Four
    cores, this process on cores 0 and 1; over the interval core 0 is half busy, core 1 idle, cores 2 and 3 fully
    busy: one half core busy among ours."""
    import io
    samples = iter(["cpu  0 0 0 0 0\ncpu0 0 0 0 0 0\ncpu1 0 0 0 0 0\ncpu2 0 0 0 0 0\ncpu3 0 0 0 0 0\nintr 5\n",
                    "cpu  0 0 0 0 0\ncpu0 50 0 0 50 0\ncpu1 0 0 0 100 0\ncpu2 100 0 0 0 0\ncpu3 100 0 0 0 0\n"])
    monkeypatch.setattr(distributed, "open", lambda path: io.StringIO(next(samples)), raising=False)
    monkeypatch.setattr(distributed.os, "sched_getaffinity", lambda pid: {0, 1})
    assert distributed.busy_cores(0.0) == pytest.approx(0.5)


def test_busy_cores_leaves_out_this_process_s_own_start_up(monkeypatch):
    """Ours: the sample since import spans start-up's own imports (a core busy with them), which are
    not a neighbour's load. Two cores, 200 ticks, 100 idle, 0.5 s of this process's CPU (50 ticks at
    100 Hz): half a core was another process's. A window under 0.25 s or over 60 s old is not
    used: a fresh sample sleeps for its own."""
    monkeypatch.setattr(distributed.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(distributed.os, "sysconf", lambda name: 100)
    now = distributed.time.monotonic()
    monkeypatch.setattr(distributed, "cpu_sample", lambda: (now, 2.0, (1200, 500)))
    assert distributed.busy_cores(since=(now - 3, 1.5, (1000, 400))) == pytest.approx(0.5)
    slept, fresh = [], iter([(now, 2.0, (1200, 500)), (now, 2.0, (1400, 700))] * 2)
    monkeypatch.setattr(distributed, "cpu_sample", lambda: next(fresh))
    monkeypatch.setattr(distributed.time, "sleep", slept.append)
    for age in (0.1, 61):  # all 200 ticks between the fresh samples idle
        assert distributed.busy_cores(since=(now - age, 0.0, (0, 0))) == 0.0
    assert slept == [0.25, 0.25]


def test_the_start_up_line_says_the_thread_count_and_why(tmp_path):
    """Ours: OMP_NUM_THREADS in the environment of a real run is used and said in the start-up line."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--max_steps", "1", *TINY,
                           "--output_dir", str(tmp_path / "run")], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    start = next(line for line in done.stdout.splitlines() if line.startswith("rloo: 1 process(es)"))
    assert "1 thread(s): OMP_NUM_THREADS=1" in start, start


@pytest.fixture(autouse=True)
def keep_signal_handlers():
    """watch_signals in this process would leave its handlers and excepthook behind."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    hook = sys.excepthook
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)
    sys.excepthook = hook
