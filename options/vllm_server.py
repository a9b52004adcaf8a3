"""A running `vllm serve` (vLLM's OpenAI-compatible server, started with VLLM_SERVER_DEV_MODE=1)
reached over plain HTTP: token-id prompts in, samples and their log-probs out (`ServerEngine`, one
of vllm_rollout's two engines), and the push of the policy's weights into it: vLLM's weight-transfer
engine on GPUs (NCCL to GPUs of its own, CUDA IPC on the trainer's), a shared directory otherwise.
"""

import base64
import contextlib
import functools
import io
import json
import math
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from options import lora
from plumbing import distributed, stack
from plumbing.config import Failed, fail
from step.prompting import with_images
from step.sampler_rules import weights_dtype
from options.weight_source import declared_shapes, policy_weights


def per_prompt_seed(sampling, i):
    """The i-th prompt's seed (vLLM gives its n samples seed + j), or nothing when unseeded."""
    if sampling.get("seed") is None:
        return {}
    return {"seed": (sampling["seed"] + i * sampling["n"]) % 2**63}


class ServerEngine:
    """A running `vllm serve`, once it answers its health check and serves this run's model (the
    names and shapes of the weights the push sends, before any moves), held by this run alone (a
    lease in the server's weight version, checked after every sample). On a GPU the weights go
    through vLLM's weight-transfer engine with the backend the server was started with (NCCL to
    GPUs of its own, CUDA IPC on the trainer's GPU); on CPU, or with --vllm_weight_sync file,
    through a shared directory. Every request is bounded by --vllm_server_timeout."""

    def __init__(self, cfg, model, device):
        self.cfg, self.weights_gone, self.transfer = cfg, False, None
        self.server = Server(server_url(cfg), cfg.vllm_server_timeout)
        wait_for_server(self.server.url, cfg.vllm_server_timeout)
        if distributed.is_main():
            check_server_model(self.server, model, cfg)
        self.lease = Lease(self.server, cfg.output_dir)
        backend = functools.partial(server_transfer_backend, self.server)
        mode = weight_sync_mode(cfg, device, backend)
        if mode == "file":
            sync_dir = cfg.vllm_sync_dir or os.path.join(cfg.output_dir, "vllm_weights")
            self.send = functools.partial(push_weights_server, self.server, model,
                                          os.path.abspath(sync_dir), push_dtype(cfg))
        else:  # the trainer's side of the transfer group, kept until close
            self.transfer = weight_transfer(mode, cfg, model, self.server)
            self.send = functools.partial(push_transfer, self.transfer, self.server)

    def push(self):
        """Every rank: the weights into the server (paused meanwhile; resumed unless the transfer
        stopped partway: paused), which then holds this push's weight version; not into a server
        another run took."""
        if distributed.is_main():
            self.lease.check()
        version = self.lease.next_version()
        self.send(version, self.lease.check)
        self.lease.version = version  # the server's now

    def sample(self, prompts, prompt_lists, images, sampling):
        if images is not None:
            options = self.cfg.chat_template_kwargs
            samples = server_chat(self.server, prompts, images, sampling, options)
        else:
            samples = server_generate(self.server, prompt_lists, sampling)
        self.lease.check()  # the server still held this run's weights when the samples came back
        return samples

    def close(self):
        """The weight-transfer group, shut down on both sides (rank 0's NCCL communicator, the
        server's), so that the server takes the next trainer's; the lease given back."""
        if self.transfer is not None:
            self.transfer.shutdown()
            if distributed.is_main():
                self.server.quietly("/shutdown_weight_transfer_engine")
            self.transfer = None
        self.lease.release()


def server_url(cfg):
    return (cfg.vllm_server_base_url or
            f"http://{cfg.vllm_server_host}:{cfg.vllm_server_port}").rstrip("/")


class Server:
    """One vLLM server as a run reaches it: every request bounded by one timeout, a request that
    fails is one line naming the server. After one that went unanswered (a stopped or dead
    server), what is only tidying up on the way out (resume, shutdown, the lease) is skipped, so
    that a frozen server costs one timeout, not one per request."""

    def __init__(self, url, timeout):
        self.url, self.timeout, self.unanswered = url.rstrip("/"), timeout, False
        self.model = None  # /v1/models' entry, asked once (served_model)

    def get(self, path):
        return self.request(path)

    def post(self, path, payload=None):
        return self.request(path, {} if payload is None else payload)

    def request(self, path, payload=None):
        try:
            return http(self.url + path, payload, self.timeout)
        except Unanswered:
            self.unanswered = True
            raise

    def quietly(self, path, payload=None):
        """A POST on the way out: tried unless the server stopped answering; a failure leaves the
        line that stopped the run the only one."""
        if not self.unanswered:
            with contextlib.suppress(Failed):
                self.post(path, payload)


class Lease:
    """This run's hold on the server, kept in the server's weight version (vLLM's
    /update_weight_version and /weight_info): {"rloo": output_dir, "host", "pid", "push": n}. Two
    runs on one server sample from each other's weights (each push replaces the other's), so a
    server belongs to one run at a time: at start-up a server another live run holds is one line
    naming it, each push sets this run's next version, and each push (before it, and before its
    version is set) and each sample (after it) check that the version is still this run's (of two
    runs that start at once, the one overtaken stops). A resume (the same output_dir) takes its own
    lease back, as does a run on the holder's host whose process is gone; close gives it back. A
    push marks the version UNFINISHED until the server holds all of it: a server left so (its push
    stopped partway) is refused at start-up."""

    def __init__(self, server, output_dir):
        self.server, self.pushes, run = server, 0, None
        if distributed.is_main():
            run = {"rloo": os.path.abspath(output_dir), "host": socket.gethostname(),
                   "pid": os.getpid()}
            version = server.get("/weight_info")["weight_version"]
            holder = lease_holder(version)
            if holder and holder["rloo"] != run["rloo"] and alive(holder):
                fail(f"the vLLM server at {server.url} serves another run ({describe(holder)}): "
                     "a server serves one run at a time, or each would sample from the other's "
                     "weights. Start a server for this run (launch.sh does), or wait for that "
                     "one to end; if it was killed, restart the server")
            if str(version).startswith(UNFINISHED):
                fail(f"the vLLM server at {server.url} is left mid-update: a weight push into it "
                     f"({describe(holder) if holder else version}) stopped partway, and vLLM "
                     "cannot put back the layers it had begun to replace, so it would sample from "
                     "broken weights. Restart the server (launch.sh starts one)")
        self.run = distributed.gather_objects(run)[0]
        self.version = json.dumps({**self.run, "push": 0})
        if distributed.is_main():
            server.post("/update_weight_version", {"new_version": self.version})

    def next_version(self):
        """The next push's version, the lease's once the server holds that push."""
        self.pushes += 1
        return json.dumps({**self.run, "push": self.pushes})

    def check(self, held=None):
        """The server still holds this run's last push (before a push, after a sample), or held."""
        version = self.server.get("/weight_info")["weight_version"]
        if version != (held or self.version):
            other = lease_holder(version)
            fail(f"the vLLM server at {self.server.url} was taken over by another run "
                 f"({describe(other) if other else 'weight version ' + repr(version)}) while "
                 "this run used it, so its samples may be of that run's weights: a server "
                 "serves one run at a time. Give each run a server of its own")

    def release(self):
        if distributed.is_main() and not self.server.unanswered:
            with contextlib.suppress(Failed):
                if self.server.get("/weight_info")["weight_version"] == self.version:
                    released = json.dumps({**self.run, "released": True})
                    self.server.post("/update_weight_version", {"new_version": released})


# the weight version while a push runs, before the push's own: a server left with it was stopped
# mid-update
UNFINISHED = "unfinished: "


def lease_holder(version):
    """The run a weight version names (a push's unfinished one too), or None: set by no rloo run,
    or given back."""
    if isinstance(version, str):
        version = version.removeprefix(UNFINISHED)
    try:
        holder = json.loads(version)
    except (TypeError, ValueError):
        return None
    if not isinstance(holder, dict) or "rloo" not in holder or holder.get("released"):
        return None
    return holder


def alive(holder):
    """Whether the holding run may still run: on another host nothing here can tell; on this
    one, whether its process is."""
    if holder.get("host") != socket.gethostname():
        return True
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def describe(holder):
    return (f"output_dir {holder['rloo']}, pid {holder.get('pid')} on {holder.get('host')}, "
            f"{holder.get('push')} pushes")


def check_server_model(server, model, cfg):
    """Before any weight moves: the names and shapes of the weights the push sends against those
    of the model the server serves, built on the meta device from its config (read where `vllm
    serve` loaded it from, /v1/models' root: a directory this machine sees, or a hub name).
    vLLM's loader stops partway through a push of another model (or takes a weight of another
    shape without a word), leaving the server unable to sample. A server whose model is not
    readable here is said once; its first push then finds out."""
    root = served_model(server).get("root") or served_model(server)["id"]
    try:
        config = AutoConfig.from_pretrained(root, trust_remote_code=cfg.trust_remote_code)
        theirs = meta_shapes(config, cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        stack.took("vLLM server's model", "not checked", f"{root!r} is not readable here: {e}")
        return
    ours = dict(declared_shapes(model))
    differ = sorted(name for name in ours.keys() | theirs.keys()
                    if ours.get(name) != theirs.get(name))
    if differ:
        name, ours_is = differ[0], cfg.model or "the embedded model"
        fail(f"the vLLM server at {server.url} serves {root}, not the model this run trains "
             f"({ours_is}): {len(differ)} of the weights differ in name or shape, e.g. {name} "
             f"{list(theirs.get(name) or ['absent'])} there, {list(ours.get(name) or ['absent'])}"
             " here. Serve this run's model (vllm serve MODEL), or train the one served")
    stack.took("vLLM server's model", root, "its weights' names and shapes are this run's")


def meta_shapes(config, trust_remote_code):
    """{name: shape} of the parameters of the model a config describes, built on the meta device
    (no memory): its architecture's class, else AutoModelForCausalLM's."""
    architecture = getattr(transformers, (config.architectures or [""])[0], None)
    with torch.device("meta"):
        model = (architecture._from_config(config) if architecture else
                 AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def weight_sync_mode(cfg, device, server_backend):
    """How the weights reach the server: "file" (a shared directory) for a CPU trainer or with
    --vllm_weight_sync file; otherwise the backend of the server's weight-transfer engine: "nccl"
    (a server on GPUs of its own) or "ipc" (a server on the trainer's GPU, as launch.sh starts it
    on one GPU: NCCL refuses a group that holds one GPU twice). server_backend: () -> the server's
    backend or None, asked only on a GPU."""
    if cfg.vllm_weight_sync == "file" or (cfg.vllm_weight_sync == "auto" and device.type != "cuda"):
        return "file"
    backend = server_backend()
    if backend == "nccl" or (backend == "ipc" and cfg.vllm_weight_sync == "auto"):
        return backend
    if backend == "ipc":
        fail("--vllm_weight_sync nccl, but the vLLM server takes the weights over CUDA IPC (it "
             "shares the trainer's GPU, and NCCL refuses one GPU twice in a group): drop "
             "--vllm_weight_sync, or serve on other GPUs with --weight-transfer-config "
             "'{\"backend\": \"nccl\"}'")
    has = f"weight-transfer backend {backend!r}" if backend else "no weight-transfer engine"
    fail(f"the vLLM server has {has}: start it with --weight-transfer-config "
         "'{\"backend\": \"nccl\"}' on GPUs of its own or '{\"backend\": \"ipc\"}' on the "
         "trainer's (launch.sh does), or pass --vllm_weight_sync file with a --vllm_sync_dir both "
         "sides see")


def server_transfer_backend(server):
    """The backend of the server's weight-transfer engine (--weight-transfer-config; None without
    one), from its dev-mode /server_info. ipc takes pickled CUDA IPC handles over HTTP, which vLLM
    refuses without VLLM_ALLOW_INSECURE_SERIALIZATION=1: one line here, not at the first push."""
    info = server.get("/server_info?config_format=json")
    backend = (info["vllm_config"].get("weight_transfer_config") or {}).get("backend")
    if backend == "ipc" and not info["vllm_env"].get("VLLM_ALLOW_INSECURE_SERIALIZATION"):
        fail(f"the vLLM server at {server.url} takes the weights over CUDA IPC but refuses the "
             "handles: start it with VLLM_ALLOW_INSECURE_SERIALIZATION=1 (launch.sh does)")
    return backend


def push_dtype(cfg):
    """The dtype weights travel in: the sampler's compute dtype (bf16 under --bf16), never more than
    the weights'."""
    return torch.bfloat16 if cfg.bf16 else getattr(torch, weights_dtype(cfg))


class Unanswered(Failed):
    """A request the server did not answer in time, or a server not there: one line naming it."""


def http(url, payload, timeout, retries=2):
    """JSON POST (or GET without payload), all of it (connecting, retries, the answer) within
    `timeout` seconds. A refused connection is retried while time is left; a server that accepts
    and does not answer (stopped, overloaded) is not: one line naming it. With VLLM_API_KEY set
    (launch.sh sets it) the key goes along, as `vllm serve` then requires on /v1 routes."""
    headers = {"Content-Type": "application/json"}
    if os.environ.get("VLLM_API_KEY"):
        headers["Authorization"] = "Bearer " + os.environ["VLLM_API_KEY"]
    body = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=body, headers=headers)
    deadline = time.monotonic() + timeout
    for attempt in range(retries + 1):
        try:
            left = max(deadline - time.monotonic(), 0.1)
            with urllib.request.urlopen(request, timeout=left) as response:
                body = response.read()
                return json.loads(body) if body else None
        except urllib.error.HTTPError as e:
            fail(f"vLLM server {url} answered {e.code}: {e.read().decode()[:500]}")
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            if isinstance(getattr(e, "reason", e), TimeoutError):
                raise unanswered(f"vLLM server {url} did not answer within {timeout:g} s "
                                 "(--vllm_server_timeout): is it stopped, or busy with more than "
                                 "it can serve in that time?") from None
            if attempt == retries or time.monotonic() + attempt + 1 > deadline:
                raise unanswered(f"vLLM server {url} unreachable after {attempt + 1} tries: "
                                 f"{e}") from None
            time.sleep(1.0 * (attempt + 1))


def unanswered(message):
    """fail's line (progress bars cleared) as an Unanswered."""
    try:
        fail(message)
    except Failed as e:
        return Unanswered(*e.args)


def wait_for_server(base_url, timeout):
    """Health check at start-up: the server must answer /health within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            http(base_url + "/health", None, min(5.0, timeout), retries=0)
            return
        except Failed as e:
            if time.monotonic() > deadline:
                fail(f"no vLLM server at {base_url} after {timeout:.0f} s ({e}). Start one with "
                     "VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --logprobs-mode processed_logprobs "
                     "(see ./launch.sh --help)")
            time.sleep(1.0)


def server_generate(server, prompt_lists, sampling):
    """POST /v1/completions with token-id prompts and n = G; choices come back flat, index =
    prompt * G + sample. Seeded: one request per prompt (a request has one seed), sent together so
    the server batches them."""
    def complete(prompts, seed):
        payload = dict(model=served_model(server)["id"], prompt=prompts, return_token_ids=True,
                       return_tokens_as_token_ids=True, **{**sampling, **seed})
        choices = server.post("/v1/completions", payload)["choices"]
        return sorted(choices, key=lambda c: c["index"])

    if sampling.get("seed") is None:
        choices = complete(prompt_lists, {})
    else:
        with ThreadPoolExecutor(len(prompt_lists)) as pool:
            answers = pool.map(lambda i: complete(prompt_lists[i:i + 1],
                                                  per_prompt_seed(sampling, i)),
                               range(len(prompt_lists)))
            choices = [c for answer in answers for c in answer]
    return [(c["token_ids"], c["logprobs"] and c["logprobs"]["token_logprobs"]) for c in choices]


def server_chat(server, conversations, images, sampling, chat_template_kwargs):
    """Vision-language prompts: one POST /v1/chat/completions per prompt (n = G, images as base64
    PNG data URLs), sent together so the server batches them; the server applies the model's chat
    template as prompt_texts does."""
    def image_url(image):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        data = base64.b64encode(buffer.getvalue()).decode()
        return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}}

    logprobs = sampling["logprobs"] is not None  # the token ids come back through the log-probs
    payloads = []
    for i, (conversation, row) in enumerate(zip(conversations, images)):
        options = {**sampling, **per_prompt_seed(sampling, i), "logprobs": True, "top_logprobs": 0}
        payloads.append(dict(model=served_model(server)["id"], return_tokens_as_token_ids=True,
                             messages=with_images(conversation, row, image_url),
                             chat_template_kwargs=chat_template_kwargs or {}, **options))
    with ThreadPoolExecutor(len(payloads)) as pool:
        answers = list(pool.map(lambda p: server.post("/v1/chat/completions", p), payloads))
    samples = []
    for answer in answers:
        for c in sorted(answer["choices"], key=lambda c: c["index"]):
            tokens = c["logprobs"]["content"]
            ids = [int(t["token"].removeprefix("token_id:")) for t in tokens]
            samples.append((ids, [t["logprob"] for t in tokens] if logprobs else None))
    return samples


def served_model(server):
    """The model the server serves, as /v1/models names it: id (the name requests give) and root
    (where `vllm serve` loaded it from; a file push does not change it). Asked once."""
    if server.model is None:
        server.model = server.get("/v1/models")["data"][0]
    return server.model


def push_weights_server(server, model, sync_dir, dtype, version, check=None):
    """Without a weight-transfer engine (a CPU trainer, or --vllm_weight_sync file): rank 0 writes
    the full weights in `dtype` as safetensors to a directory the server can read (a shared
    filesystem), then the server, paused, reloads them in place (vLLM's loader may replace part of
    its layers before it fails: `paused`), and its prefix and image-feature caches are reset."""
    from safetensors.torch import save_file

    weights = {}
    for name, tensor in lora.hf_full_weights(model):  # every rank gathers; rank 0 keeps host copies
        if distributed.is_main():
            # a copy: tied tensors share storage, which safetensors refuses; both names go in
            kept = dtype if tensor.is_floating_point() else tensor.dtype
            weights[name] = tensor.to("cpu", kept, copy=True).contiguous()
    if distributed.is_main():
        os.makedirs(sync_dir, exist_ok=True)
        save_file(weights, os.path.join(sync_dir, "model.safetensors"))
    with paused(server, version, check):
        if distributed.is_main():
            server.post("/collective_rpc", {"method": "reload_weights",
                                            "kwargs": {"weights_path": sync_dir}})


def weight_transfer(backend, cfg, model, server):
    """The trainer's side of vLLM's weight-transfer engine (vllm/distributed/weight_transfer/), on
    every rank: each push gathers every weight on the GPU in the sampler's dtype (the other ranks
    take part in the FSDP2 all-gathers) and rank 0 sends it. "nccl": rank 0 joins the server's
    workers in an NCCL group once, then broadcasts in 1 GiB packed buckets. "ipc" (the server on
    rank 0's GPU): rank 0 packs the weights into one reused buffer whose CUDA IPC handle the server
    opens, a bucket at a time. -> the engine (send_weights(), shutdown())"""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    check_server_version(server)
    source = policy_weights(model, push_dtype(cfg))
    client = HTTPVLLMWeightSyncClient(server.url, timeout=server.timeout)
    stack.took("weight transfer", f"{backend}, {source.api}")
    try:
        if backend == "ipc":
            return ipc_transfer(source, client)
        return nccl_transfer(source, client, server)
    except (AttributeError, TypeError) as e:  # our side of vLLM's API, not the GPUs: a bug to show
        raise RuntimeError(f"vLLM {stack.version('vllm')}'s weight-transfer API: {e}") from e
    except Exception as e:  # noqa: BLE001 (requests', CUDA's and NCCL's errors)
        needs = {"nccl": "GPUs other than trainer rank 0's (NCCL refuses one GPU twice in a "
                         "group; on rank 0's own GPU serve with the ipc backend)",
                 "ipc": "trainer rank 0's GPU (on GPUs of its own serve with the nccl backend)"}
        fail(f"{backend} weight sync with the vLLM server at {server.url} failed ({reason(e)}): "
             f"it needs the server on {needs[backend]}, as launch.sh starts it; or pass "
             "--vllm_weight_sync file with a --vllm_sync_dir both sides see")


def check_server_version(server):
    """The weight-transfer engine's two halves speak one release's protocol: from vLLM 0.33 the
    trainer sends the declaration once (a 0.32 server then loads nothing and NCCL hangs), and 0.34's
    trainer sends fields older servers refuse. One line at start-up where the releases differ."""
    there, here = server.get("/version")["version"], stack.version("vllm")
    if there.split("+")[0] != (here or "").split("+")[0]:
        fail(f"the vLLM server at {server.url} runs vLLM {there}, this trainer has {here}: the "
             "weight-transfer protocol changed in 0.33 and 0.34, so both sides need one release "
             f"(pip install vllm=={there} here), or pass --vllm_weight_sync file")


def nccl_transfer(source, client, server):
    from vllm.distributed.weight_transfer.nccl_engine import (NCCLTrainerInitInfo,
                                                              NCCLTrainerWeightTransferEngine)

    # every rank gets rank 0's group address: vLLM 0.34 checks world_size on every rank
    address = port = world = None
    if distributed.is_main():
        local = urllib.parse.urlparse(server.url).hostname in ("127.0.0.1", "localhost")
        address = "127.0.0.1" if local else socket.getfqdn()
        port, world = free_port(), 1 + server.get("/get_world_size")["world_size"]
    address, port, world = distributed.gather_objects((address, port, world))[0]
    info = NCCLTrainerInitInfo(master_address=address, master_port=port, world_size=world,
                               rank=distributed.rank())
    return NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)


def ipc_transfer(source, client):
    from vllm.distributed.weight_transfer.ipc_engine import (IPCTrainerInitInfo,
                                                             IPCTrainerWeightTransferEngine)

    info = IPCTrainerInitInfo(rank=distributed.rank(), packed=True,
                              packed_buffer_size_bytes=ipc_buffer_bytes(source.declared()))
    return IPCTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)


def ipc_buffer_bytes(metadata, bucket=2**30):
    """The IPC buffer's size: vLLM's 1 GiB bucket, or the largest weight where that is larger (a
    152k-token embedding of width 3584 in bf16 is 1.09 GB; a weight that does not fit fails)."""
    largest = max(math.prod(meta.shape) * meta.dtype.itemsize for meta in metadata)
    return max(bucket, largest)


def push_transfer(transfer, server, version, check=None):
    """One push through the weight-transfer engine, on every rank."""
    with paused(server, version, check):
        transfer.send_weights()


@contextlib.contextmanager
def paused(server, version, check=None):
    """Every rank's push: the server paused while its layers are rebuilt (and its KV cache freed:
    vLLM 0.34 lends it to the reload), its weight version UNFINISHED + version meanwhile, then its
    caches reset and this push's weight version set (the lease's). The barrier first: from vLLM
    0.33 a paused server refuses new requests (HTTP 503; 0.32 queued them), so no rank may still be
    sampling (a multi-turn trajectory's next turn, an async batch) when rank 0 pauses. The barrier
    after: no rank samples before the server holds the new weights. Resumed however the push ends
    (an error, Ctrl-C), as a paused server would refuse or hold every client, but for one that
    stopped partway through the weights: vLLM's transfer and reload begin by moving layers off the
    device and cannot go back, so that server stays paused, marked, and the run stops with one line
    saying to restart it. `check(held)` (the lease's) runs before the version changes, each time: a
    run that took the server during the push keeps it."""
    distributed.barrier()
    if distributed.is_main():
        server.post("/pause?mode=wait")
    with resumed_if_it_fails(server):
        if distributed.is_main():
            if check is not None:
                check()
            server.post("/update_weight_version", {"new_version": UNFINISHED + version})
    try:
        yield
    except (Exception, Failed) as e:
        if distributed.is_main() and not distributed.collective_failed(e):  # a lost peer: its line
            fail(f"the weight push into the vLLM server at {server.url} stopped partway "
                 f"({reason(e)}): vLLM cannot put back the layers it had begun to replace, so the "
                 "server is left paused, and refused by the next run, until it is restarted. "
                 "Restart it (launch.sh starts one), then resume from the last checkpoint")
        raise
    with resumed_if_it_fails(server):
        if distributed.is_main():
            server.post("/reset_prefix_cache")
            server.post("/reset_encoder_cache")  # image features of the old vision tower
            if check is not None:
                check(UNFINISHED + version)
            server.post("/update_weight_version", {"new_version": version})
    if distributed.is_main():
        server.post("/resume")
    distributed.barrier()


@contextlib.contextmanager
def resumed_if_it_fails(server):
    """A paused server resumed (rank 0) if the block fails: nothing of its weights moved."""
    try:
        yield
    except BaseException:
        if distributed.is_main():
            server.quietly("/resume")
        raise


def reason(error):
    """An error's first line, as a line of ours quotes it."""
    text = (str(error).strip() or type(error).__name__).splitlines()[0]
    return text.removeprefix("error: ")[:300]


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
