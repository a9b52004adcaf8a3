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

import distributed
import lora
import stack
from config import fail
from prompting import with_images
from sampler_rules import weights_dtype


def per_prompt_seed(sampling, i):
    """The i-th prompt's seed (vLLM gives its n samples seed + j), or nothing when unseeded."""
    if sampling.get("seed") is None:
        return {}
    return {"seed": (sampling["seed"] + i * sampling["n"]) % 2**63}


class ServerEngine:
    """A running `vllm serve`, once it answers its health check. On a GPU the weights go through
    vLLM's weight-transfer engine with the backend the server was started with (NCCL to GPUs of its
    own, CUDA IPC on the trainer's GPU); on CPU, or with --vllm_weight_sync file, through a shared
    directory."""

    def __init__(self, cfg, model, device):
        self.cfg, self.weights_gone, self.transfer = cfg, False, None
        self.base_url = (cfg.vllm_server_base_url or
                         f"http://{cfg.vllm_server_host}:{cfg.vllm_server_port}").rstrip("/")
        wait_for_server(self.base_url, cfg.vllm_server_timeout)
        backend = functools.partial(server_transfer_backend, self.base_url, cfg.vllm_server_timeout)
        mode = weight_sync_mode(cfg, device, backend)
        if mode == "file":
            sync_dir = cfg.vllm_sync_dir or os.path.join(cfg.output_dir, "vllm_weights")
            self.push = functools.partial(push_weights_server, self.base_url, model,
                                          os.path.abspath(sync_dir), push_dtype(cfg))
        else:  # the trainer's side of the transfer group, kept until close
            self.transfer = weight_transfer(mode, cfg, model, self.base_url)
            self.push = functools.partial(push_transfer, self.transfer, self.base_url)

    def sample(self, prompts, prompt_lists, images, sampling):
        timeout, url = self.cfg.vllm_server_timeout, self.base_url
        if images is not None:
            options = self.cfg.chat_template_kwargs
            return server_chat(url, prompts, images, sampling, timeout, options)
        return server_generate(url, prompt_lists, sampling, timeout)

    def close(self):
        """The weight-transfer group, shut down on both sides (rank 0's NCCL communicator, the
        server's), so that the server takes the next trainer's."""
        if self.transfer is None:
            return
        self.transfer.shutdown()
        if distributed.is_main():
            http(self.base_url + "/shutdown_weight_transfer_engine", {})
        self.transfer = None


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


def server_transfer_backend(base_url, timeout=60.0):
    """The backend of the server's weight-transfer engine (--weight-transfer-config; None without
    one), from its dev-mode /server_info. ipc takes pickled CUDA IPC handles over HTTP, which vLLM
    refuses without VLLM_ALLOW_INSECURE_SERIALIZATION=1: one line here, not at the first push."""
    info = http(base_url + "/server_info?config_format=json", timeout=timeout)
    backend = (info["vllm_config"].get("weight_transfer_config") or {}).get("backend")
    if backend == "ipc" and not info["vllm_env"].get("VLLM_ALLOW_INSECURE_SERIALIZATION"):
        fail(f"the vLLM server at {base_url} takes the weights over CUDA IPC but refuses the "
             "handles: start it with VLLM_ALLOW_INSECURE_SERIALIZATION=1 (launch.sh does)")
    return backend


def push_dtype(cfg):
    """The dtype weights travel in: the sampler's compute dtype (bf16 under --bf16), never more than
    the weights'."""
    return torch.bfloat16 if cfg.bf16 else getattr(torch, weights_dtype(cfg))


def http(url, payload=None, timeout=60.0, retries=2):
    """JSON POST (or GET without payload). Connection errors retry a bounded number of times, then
    a clear error. With VLLM_API_KEY set (launch.sh sets it) the key goes along, as `vllm serve`
    then requires on /v1 routes."""
    headers = {"Content-Type": "application/json"}
    if os.environ.get("VLLM_API_KEY"):
        headers["Authorization"] = "Bearer " + os.environ["VLLM_API_KEY"]
    body = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=body, headers=headers)
    for attempt in range(retries + 1):
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                body = response.read()
                return json.loads(body) if body else None
        except urllib.error.HTTPError as e:
            fail(f"vLLM server {url} answered {e.code}: {e.read().decode()[:500]}")
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            if attempt == retries:
                fail(f"vLLM server {url} unreachable after {retries + 1} tries: {e}")
            time.sleep(1.0 * (attempt + 1))


def wait_for_server(base_url, timeout):
    """Health check at start-up: the server must answer /health within `timeout` seconds."""
    deadline = time.time() + timeout
    while True:
        try:
            http(base_url + "/health", timeout=5, retries=0)
            return
        except SystemExit as e:
            if time.time() > deadline:
                fail(f"no vLLM server at {base_url} after {timeout:.0f} s ({e}). Start one with "
                     "VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --logprobs-mode processed_logprobs "
                     "(see ./launch.sh --help)")
            time.sleep(1.0)


def server_generate(base_url, prompt_lists, sampling, timeout):
    """POST /v1/completions with token-id prompts and n = G; choices come back flat, index =
    prompt * G + sample. Seeded: one request per prompt (a request has one seed), sent together so
    the server batches them."""
    def complete(prompts, seed):
        payload = dict(model=server_model_name(base_url), prompt=prompts, return_token_ids=True,
                       return_tokens_as_token_ids=True, **{**sampling, **seed})
        choices = http(base_url + "/v1/completions", payload, timeout=timeout)["choices"]
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


def server_chat(base_url, conversations, images, sampling, timeout, chat_template_kwargs):
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
        payloads.append(dict(model=server_model_name(base_url), return_tokens_as_token_ids=True,
                             messages=with_images(conversation, row, image_url),
                             chat_template_kwargs=chat_template_kwargs or {}, **options))
    with ThreadPoolExecutor(len(payloads)) as pool:
        url = base_url + "/v1/chat/completions"
        answers = list(pool.map(lambda p: http(url, p, timeout=timeout), payloads))
    samples = []
    for answer in answers:
        for c in sorted(answer["choices"], key=lambda c: c["index"]):
            tokens = c["logprobs"]["content"]
            ids = [int(t["token"].removeprefix("token_id:")) for t in tokens]
            samples.append((ids, [t["logprob"] for t in tokens] if logprobs else None))
    return samples


@functools.lru_cache(maxsize=None)
def server_model_name(base_url):
    return http(base_url + "/v1/models")["data"][0]["id"]


def push_weights_server(base_url, model, sync_dir, dtype):
    """Without a weight-transfer engine (a CPU trainer, or --vllm_weight_sync file): rank 0 writes
    the full weights in `dtype` as safetensors to a directory the server can read (a shared
    filesystem), the server reloads them in place, and its prefix and image-feature caches are
    reset."""
    from safetensors.torch import save_file

    weights = {}
    for name, tensor in lora.hf_full_weights(model):  # every rank gathers; rank 0 keeps host copies
        if distributed.is_main():
            # a copy: tied tensors share storage, which safetensors refuses; both names go in
            kept = dtype if tensor.is_floating_point() else tensor.dtype
            weights[name] = tensor.to("cpu", kept, copy=True).contiguous()
    with paused(base_url):
        if distributed.is_main():
            os.makedirs(sync_dir, exist_ok=True)
            save_file(weights, os.path.join(sync_dir, "model.safetensors"))
            http(base_url + "/collective_rpc", {"method": "reload_weights",
                                                "kwargs": {"weights_path": sync_dir}}, timeout=600)


def reset_server_caches(base_url):
    http(base_url + "/reset_prefix_cache", {})
    http(base_url + "/reset_encoder_cache", {})  # image features computed with the old vision tower


def weight_transfer(backend, cfg, model, base_url):
    """The trainer's side of vLLM's weight-transfer engine (vllm/distributed/weight_transfer/), on
    every rank: each push gathers every weight on the GPU in the sampler's dtype (the other ranks
    take part in the FSDP2 all-gathers) and rank 0 sends it. "nccl": rank 0 joins the server's
    workers in an NCCL group once, then broadcasts in 1 GiB packed buckets. "ipc" (the server on
    rank 0's GPU): rank 0 packs the weights into one reused buffer whose CUDA IPC handle the server
    opens, a bucket at a time. -> the engine (send_weights(), shutdown())"""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    check_server_version(base_url)
    source = policy_weights(model, push_dtype(cfg))
    client = HTTPVLLMWeightSyncClient(base_url, timeout=cfg.vllm_server_timeout)
    stack.took("weight transfer", f"{backend}, {source.api}")
    try:
        if backend == "ipc":
            return ipc_transfer(source, client)
        return nccl_transfer(source, client, base_url)
    except (AttributeError, TypeError) as e:  # our side of vLLM's API, not the GPUs: a bug to show
        raise RuntimeError(f"vLLM {stack.version('vllm')}'s weight-transfer API: {e}") from e
    except Exception as e:  # noqa: BLE001 (requests', CUDA's and NCCL's errors)
        needs = {"nccl": "GPUs other than trainer rank 0's (NCCL refuses one GPU twice in a "
                         "group; on rank 0's own GPU serve with the ipc backend)",
                 "ipc": "trainer rank 0's GPU (on GPUs of its own serve with the nccl backend)"}
        reason = (str(e).strip() or type(e).__name__).splitlines()[0][:200]
        fail(f"{backend} weight sync with the vLLM server at {base_url} failed ({reason}): it "
             f"needs the server on {needs[backend]}, as launch.sh starts it; or pass "
             "--vllm_weight_sync file with a --vllm_sync_dir both sides see")


def check_server_version(base_url):
    """The weight-transfer engine's two halves speak one release's protocol: from vLLM 0.33 the
    trainer sends the declaration once (a 0.32 server then loads nothing and NCCL hangs), and 0.34's
    trainer sends fields older servers refuse. One line at start-up where the releases differ."""
    server = http(base_url + "/version", timeout=60)["version"]
    here = stack.version("vllm")
    if server.split("+")[0] != (here or "").split("+")[0]:
        fail(f"the vLLM server at {base_url} runs vLLM {server}, this trainer has {here}: the "
             "weight-transfer protocol changed in 0.33 and 0.34, so both sides need one release "
             f"(pip install vllm=={server} here), or pass --vllm_weight_sync file")


def nccl_transfer(source, client, base_url):
    from vllm.distributed.weight_transfer.nccl_engine import (NCCLTrainerInitInfo,
                                                              NCCLTrainerWeightTransferEngine)

    # every rank gets rank 0's group address: vLLM 0.34 checks world_size on every rank
    address = port = world = None
    if distributed.is_main():
        local = urllib.parse.urlparse(base_url).hostname in ("127.0.0.1", "localhost")
        address = "127.0.0.1" if local else socket.getfqdn()
        port, world = free_port(), 1 + http(base_url + "/get_world_size")["world_size"]
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


def push_transfer(transfer, base_url):
    """One push through the weight-transfer engine, on every rank."""
    with paused(base_url):
        transfer.send_weights()


@contextlib.contextmanager
def paused(base_url):
    """Every rank's push: the server paused while its layers are rebuilt (and its KV cache freed:
    vLLM 0.34 lends it to the reload), its caches reset after. The barrier first: from vLLM 0.33 a
    paused server refuses new requests (HTTP 503; 0.32 queued them), so no rank may still be
    sampling (a multi-turn trajectory's next turn, an async batch) when rank 0 pauses. The barrier
    after: no rank samples before the server holds the new weights."""
    distributed.barrier()
    if distributed.is_main():
        http(base_url + "/pause?mode=wait", {})
    yield
    if distributed.is_main():
        reset_server_caches(base_url)
        http(base_url + "/resume", {})
    distributed.barrier()


def policy_weights(model, dtype):
    """The policy's weights as the source vLLM's weight-transfer engines read: the names, dtype and
    full shapes the server loads (LoRA merged, no tied alias), declared without gathering, then
    gathered one at a time on every rank. vLLM >= 0.33: a WeightSource subclass (metadata a
    cached_property, the weights from iter_full); 0.32: the shape its engines call (metadata(),
    iteration)."""
    from vllm.distributed.weight_transfer import ParamMeta, WeightSource

    def declare():
        params = model.named_parameters()
        shapes = ((name, torch.empty(p.shape, device="meta")) for name, p in params)
        weights = lora.hf_weights(shapes, model)
        return [ParamMeta(name, dtype, tuple(t.shape)) for name, t in weights]

    def gather():
        for name, tensor in lora.hf_full_weights(model, "parameters"):
            yield name, tensor.to(dtype)

    if hasattr(WeightSource, "iter_full"):
        class Source(WeightSource):
            api = "vLLM >= 0.33 WeightSource.iter_full"
            metadata = functools.cached_property(lambda self: declare())

            def declared(self):
                return self.metadata

            def iter_full(self):
                return gather()
        return Source()

    class Source0_32:
        api = "vLLM 0.32 metadata() and iteration"
        metadata = declared = staticmethod(declare)

        def __iter__(self):
            return gather()
    return Source0_32()


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
