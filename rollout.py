"""Prompts -> completions with the Hugging Face model, and the training forward whose log-probs must agree with the
sampler's: our own decode loop (CPU and GPU, plain or FSDP2-sharded; vision-language models use HF `generate`),
EOS masks, prompt tokenisation and images, forward_logps and batch_logps.

Besides the tokens, generation records the sampler's own per-token log-probs of the temperature-scaled
distribution, log softmax(logits / temperature)[o_t]. In fp32 they are the "old" log-probs of the KL penalty
(paper §3: r = R - beta * KL), so the trainer needs no separate scoring pass before the update (README 'Where we
differ from TRL, on purpose'). vLLM generation and its weight push are in vllm_rollout.py; rewards in rewards.py.
"""
import io
import weakref
from contextlib import contextmanager, nullcontext

import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList, StaticCache
from transformers.cache_utils import DynamicLayer
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rloo import token_logps_and_entropy


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


def eos_token_ids(tokenizer, model, cfg=None):
    """Every id that ends a completion: the tokenizer's EOS, the model's generation_config EOS (may be a list) and
    generation_kwargs' stop_token_ids."""
    ids = {tokenizer.eos_token_id, *((cfg and cfg.generation_kwargs) or {}).get("stop_token_ids", [])}
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




def sampling_processors(cfg, prompt_ids, eos_ids):
    """HF's own penalty and filters, in HF generate's order (vLLM's: penalties, then temperature, then filters);
    applied to the logits after log pi_T is recorded.

    Neither sampling path lets a model's shipped generation_config (e.g. top_k=20, repetition_penalty=1.05) add
    processors of its own, so it cannot silently change the sampling.
    """
    extra, processors, prompt_length = cfg.generation_kwargs or {}, [], prompt_ids.shape[1]
    if extra.get("min_tokens"):
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_length, extra["min_tokens"], eos_ids,
                                                            prompt_ids.device))
    if extra.get("presence_penalty") or extra.get("frequency_penalty"):
        processors.append(completion_penalties(prompt_length, extra.get("presence_penalty", 0.0),
                                               extra.get("frequency_penalty", 0.0)))
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


def completion_penalties(prompt_length, presence, frequency):
    """OpenAI's (and vLLM's) penalties: z_v -= frequency * c_v + presence * [c_v > 0], c_v = count of v in the
    completion so far (the prompt is not counted)."""
    def penalize(ids, scores):
        counts = torch.zeros_like(scores).scatter_add_(1, ids[:, prompt_length:], torch.ones_like(scores[:, :1])
                                                       .expand(-1, ids.shape[1] - prompt_length))
        return scores - frequency * counts - presence * (counts > 0).float()
    return penalize


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
def generate(model, tokenizer, prompts, cfg, device, processor=None, images=None, seed=None):
    """Sample cfg.num_generations completions for each prompt (a string or a conversation), group members adjacent.
    Vision-language: `images` holds each prompt's images and `processor` prepares them with the texts.
    The model runs in its own precision (bf16 parameters under FSDP2's mixed precision with --bf16).
    seed: the samples of text models are a function of it and of each row (None: drawn from torch's RNG), so decoding
    in chunks of --generation_chunk_size rows gives the samples of one call.

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
    eos_ids = eos_token_ids(tokenizer, model, cfg)
    pad_id = tokenizer.pad_token_id

    was_training = model.training
    model.eval()
    try:
        with unsharded(model):
            if images is None:
                keys = row_keys(seed, len(prompt_ids), device)
                chunks = [decode(model, prompt_ids[rows], prompt_mask[rows], cfg, eos_ids, pad_id, keys[rows])
                          for rows in micro_batches(len(prompt_ids), cfg.generation_chunk_size or len(prompt_ids))]
                completion_ids = pad_right([ids for ids, _ in chunks], pad_id)  # [B, T]
                sampler_logps = pad_right([logps for _, logps in chunks], 0.0)  # [B, T]
            else:
                inputs = dict(input_ids=prompt_ids, attention_mask=prompt_mask, **pixel_inputs)
                completion_ids, sampler_logps = generate_hf(model, inputs, cfg, eos_ids, pad_id,
                                                            image_token_ids(processor))
    finally:
        model.train(was_training)
    batch = finish_batch(prompt_ids, prompt_mask, completion_ids, sampler_logps, eos_ids, pad_id)
    return batch if images is None else with_pixel_inputs(batch, processor, rows_inputs, device)


def pad_right(pieces, value):
    """[b_i, T_i] pieces -> one [sum b_i, max T_i] tensor, padded on the right with value."""
    width = max(p.shape[1] for p in pieces)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=value) for p in pieces])


# splitmix64 (Steele et al. 2014) in int64 arithmetic, which wraps as uint64 does; the shifts are masked to act as
# logical ones. Counter-based: the noise of (row, step, token) needs no generator state.
GOLDEN, MIX1, MIX2 = -7046029254386353131, -4658895280553007687, -7723592293110705685


def splitmix(x):
    x = (x ^ ((x >> 30) & (2**34 - 1))) * MIX1
    x = (x ^ ((x >> 27) & (2**37 - 1))) * MIX2
    return x ^ ((x >> 31) & (2**33 - 1))


def row_keys(seed, num_rows, device):
    """One int64 key per completion row, from the call's seed (None: a draw from torch's checkpointed RNG).  [B]"""
    if seed is None:
        seed = int(torch.randint(2**62, ()).item())
    rows = torch.arange(1, num_rows + 1, device=device)
    return splitmix(splitmix(torch.tensor(seed % 2**62, device=device)) + rows * GOLDEN)


def exponential_noise(keys, t, vocab_size):
    """Exp(1) draws [B, V]: -log U with U a pure function of (row key, step t, token) on a 24-bit grid in (0, 1)."""
    tokens = torch.arange(vocab_size, device=keys.device)
    bits = splitmix(keys[:, None] + (t * vocab_size + tokens + 1) * GOLDEN)
    uniform = ((bits >> 40) & (2**24 - 1)).float().add_(0.5).mul_(2.0**-24)
    return uniform.log_().neg_()


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


# A host sync (has every row ended?) every this many tokens: on a GPU each one drains the queue of launched kernels.
END_CHECK_EVERY = 8


def decode(model, prompt_ids, prompt_mask, cfg, eos_ids, pad_id, keys, static=None):
    """Text models: HF generate's sampling without its per-token bookkeeping (a third of a small model's decode step
    on CPU). One forward per token on the model's KV cache; HF's own processors, in order; log pi_T of each token
    recorded from the raw logits; rows that ended get padding; stops once every row has ended (checked every
    END_CHECK_EVERY tokens). Ids and mask live in buffers sized for the whole generation. On a GPU the cache is
    static (shapes fixed for the call, so --compile_decode can capture the step in a CUDA graph).
    keys [B]: each row's noise key (row_keys); static: None = on a GPU or when compiling.
    Returns completion_ids [B, T] and their log pi_T [B, T]."""
    B, L = prompt_ids.shape
    T = cfg.max_completion_length
    if static is None:
        static = prompt_ids.device.type == "cuda" or cfg.compile_decode
    width = round_up(L + T, 256) if static else L + T  # few distinct shapes: few compilations
    processors = sampling_processors(cfg, prompt_ids, eos_ids)
    eos = torch.tensor(eos_ids, device=prompt_ids.device)
    ids = torch.cat([prompt_ids, prompt_ids.new_full((B, width - L), pad_id)], 1)  # [B, width]
    mask = torch.cat([prompt_mask, prompt_mask.new_zeros((B, width - L))], 1)  # [B, width]
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: each prompt starts at position 0
    cache = kv_cache(model, width, static)
    out = model(input_ids=prompt_ids, attention_mask=mask if static else prompt_mask, position_ids=positions,
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    step = decode_step(model, cfg)
    positions = positions[:, -1:] + 1  # [B, 1]
    logps = torch.zeros(B, T, device=prompt_ids.device)  # [B, T]
    ended = torch.zeros(B, dtype=torch.bool, device=prompt_ids.device)
    for t in range(T):
        logits = out.logits[:, -1].float()  # [B, V]
        scores = logits
        for process in processors:
            scores = process(ids[:, :L + t], scores)
        # torch.multinomial's own method, argmax p / E with E ~ Exp(1) (3x faster on CPU), E from the row's key
        probs = torch.softmax(scores, -1)
        token = (probs / exponential_noise(keys, t, probs.shape[-1])).argmax(-1)  # [B]
        token = token.masked_fill(ended, pad_id)
        logps[:, t] = torch.log_softmax(logits / cfg.temperature, -1).gather(-1, token[:, None])[:, 0]
        ids[:, L + t] = token
        ended |= torch.isin(token, eos)
        if t + 1 == T or (t + 1) % END_CHECK_EVERY == 0 and ended.all():
            break
        mask[:, L + t] = 1
        out = step(input_ids=ids[:, L + t:L + t + 1], attention_mask=mask if static else mask[:, :L + t + 1],
                   position_ids=positions, past_key_values=cache, use_cache=True)
        positions = positions + 1
    return ids[:, L:L + t + 1], logps[:, :t + 1]


def round_up(n, multiple):
    return -(-n // multiple) * multiple


def kv_cache(model, capacity, static):
    """The cache the model would build, its full-attention layers preallocated for `capacity` tokens: HF's
    StaticCache (fixed shapes) or KVBuffer (views that grow, so attention spans only the tokens so far)."""
    if static:
        return StaticCache(config=model.config, max_cache_len=capacity)
    cache = DynamicCache(config=model.config)
    cache.layers = [KVBuffer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


COMPILED_STEPS = weakref.WeakKeyDictionary()


def decode_step(model, cfg):
    """The per-token forward: the model itself, or with --compile_decode its torch.compile (CUDA graphs on a GPU,
    mode reduce-overhead), compiled once per model and reused while shapes repeat."""
    if not cfg.compile_decode:
        return model
    if model not in COMPILED_STEPS:
        mode = "reduce-overhead" if next(model.parameters()).device.type == "cuda" else None
        COMPILED_STEPS[model] = torch.compile(model, mode=mode, dynamic=False)
    return COMPILED_STEPS[model]


def generate_hf(model, inputs, cfg, eos_ids, pad_id, suppress):
    """Vision-language models: HF generate, which knows each family's position bookkeeping (Qwen2-VL's 3-D rotary
    offsets), on the processor's inputs (input_ids, attention_mask, pixel inputs). Image placeholders are suppressed
    before log pi_T is recorded: the policy is the model without them, in training too. The model's shipped
    generation config is swapped for a bare one for the call."""
    record = RecordLogps(cfg.temperature)
    shipped_config = model.generation_config
    model.generation_config = GenerationConfig(do_sample=True, max_new_tokens=cfg.max_completion_length, top_k=0,
                                               eos_token_id=eos_ids, pad_token_id=pad_id)
    try:
        processors = [SuppressTokensLogitsProcessor(suppress), record] + sampling_processors(
            cfg, inputs["input_ids"], eos_ids)
        sequences = model.generate(**inputs, logits_processor=LogitsProcessorList(processors))
    finally:
        model.generation_config = shipped_config
    completion_ids = sequences[:, inputs["input_ids"].shape[1]:]  # [B, T]
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
    width = max(lengths)  # the decode loop may run a few tokens past the last row's EOS (END_CHECK_EVERY)
    completion_ids, completion_mask = completion_ids[:, :width], completion_mask[:, :width]
    sampler_logps = None if sampler_logps is None else sampler_logps[:, :width]
    batch = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                 completion_mask=completion_mask, truncated=truncated,
                 completion_lists=[ids[:n] for ids, n in zip(completion_ids.tolist(), lengths)])
    if sampler_logps is not None:  # absent where the generator cannot report log pi_T (see sampler_logps_exact)
        batch["sampler_logps"] = sampler_logps * completion_mask
    return batch


def hf_generator(cfg, model, tokenizer, processor, device):
    """The generator without vLLM: generate(prompts, images, seed) -> batch. It samples in the precision the
    trainer scores in and from the policy's live weights, so there is nothing to push."""
    def generate_from_policy(prompts, images=None, seed=None):
        return generate(model, tokenizer, prompts, cfg, device, processor, images, seed)

    return generate_from_policy


def sampler_logps_exact(cfg, vision=False):
    """Whether the generator reports log pi_T = log_softmax(z / T), the trainer's log-probs, for its tokens.

    Our decode loop always does. vLLM's modes do not: `processed_logprobs` are taken after the repetition penalty
    and top-k/top-p/min-p (renormalised over the kept tokens: a KL biased by -log(kept mass) per token), and
    `raw_logprobs` are at temperature 1. So vLLM's numbers are used only where they are that quantity: with no
    penalty and no filter (processed), or at T = 1 from a colocated text engine (raw; a server runs its own mode).
    """
    if not cfg.use_vllm:
        return True
    extra = cfg.generation_kwargs or {}
    plain = (cfg.repetition_penalty == 1.0 and not cfg.top_k and cfg.top_p >= 1.0 and cfg.min_p is None
             and not any(extra.get(k) for k in ("min_tokens", "presence_penalty", "frequency_penalty")))
    return plain or (cfg.vllm_mode == "colocate" and cfg.temperature == 1.0 and not vision)


# ---------------------------------------------------------------------------------------------------------------
# The training forward: log pi_T of the sampled tokens, as the loss and the KL see them
# ---------------------------------------------------------------------------------------------------------------

def micro_batches(batch_size, micro_size):
    return [slice(i, i + micro_size) for i in range(0, batch_size, micro_size)]


def forward_logps(model, batch, rows, temperature, chunked=None):
    """Per-token log pi_T and entropy of the completion tokens of batch[rows], padding trimmed to these rows.

    Position ids follow the left padding (as in generate), and the head runs on completion positions only, in
    chunks through LogpsHead (the [b, T, V] logits never exist; chunked=False: the model's own head, for models that
    post-process their logits). Vision-language batches also pass the rows' pixel inputs; models with multimodal
    rotary positions (Qwen2-VL's get_rope_index) derive the positions from the ids, the images and the mask.
    """
    prompt_mask, completion_mask = batch["prompt_mask"][rows], batch["completion_mask"][rows]
    prompt_len, completion_len = int(prompt_mask.sum(-1).max()), int(completion_mask.sum(-1).max())
    prompt_ids = batch["prompt_ids"][rows, -prompt_len:]
    completion_ids = batch["completion_ids"][rows, :completion_len]
    input_ids = torch.cat([prompt_ids, completion_ids], 1)  # [b, L+T]
    attention_mask = torch.cat([prompt_mask[:, -prompt_len:], completion_mask[:, :completion_len]], 1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    pixel_inputs = {}
    if "pixel_inputs" in batch:  # the processor left-pads these rows to the same prompt_len
        pixel_inputs = batch["pixel_inputs"](rows)
        del pixel_inputs["input_ids"], pixel_inputs["attention_mask"]
        for key in ("token_type_ids", "mm_token_type_ids"):  # per-token fields: completion tokens are text (0)
            if key in pixel_inputs:
                pixel_inputs[key] = torch.cat([pixel_inputs[key], torch.zeros_like(completion_ids)], 1)
        if hasattr(getattr(model, "model", None), "get_rope_index"):
            position_ids = None
    head = LogpsHead(completion_ids, temperature, batch.get("suppressed_ids"))
    chunked = plain_head(model) if chunked is None else chunked
    with swapped_head(model, head) if chunked else nullcontext():
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    logits_to_keep=completion_len + 1, use_cache=False, **pixel_inputs).logits  # [b, T + 1, ...]
    per_token = out if chunked else head.score(out[:, :-1], completion_ids)  # [b, T, 2]
    return per_token[..., 0], per_token[..., 1], completion_len


# fp32 elements of one chunk's logits in LogpsHead (64 MB)
HEAD_CHUNK_ELEMENTS = 2**24


class LogpsHead(torch.nn.Module):
    """Stands in for the LM head in a training forward: hidden states [b, T + 1, H] -> [b, T, 2], the log pi_T and
    entropy of each completion token, where the model expects logits. Chunks of positions go through the real head
    one at a time and are recomputed in backward (torch.utils.checkpoint), so at most one chunk of logits is alive:
    b * T * V * 8 bytes less (40 GB at b=8, T=4096, V=152k). Image placeholders (suppressed) are never sampled, so
    they are not in the policy's distribution either (finite, for the entropy)."""

    def __init__(self, targets, temperature, suppressed=None):
        super().__init__()
        self.targets, self.temperature, self.suppressed, self.lm_head = targets, temperature, suppressed, None

    def forward(self, hidden):
        hidden = hidden[:, :-1]  # position t predicts targets[:, t]
        width = max(1, HEAD_CHUNK_ELEMENTS // (hidden.shape[0] * self.lm_head.weight.shape[0]))
        pieces = []
        for start in range(0, hidden.shape[1], width):
            args = (hidden[:, start:start + width], self.targets[:, start:start + width])
            pieces.append(checkpoint(self.chunk, *args, use_reentrant=False) if torch.is_grad_enabled()
                          else self.chunk(*args))
        return torch.cat(pieces, 1)

    def chunk(self, hidden, targets):
        return self.score(self.lm_head(hidden), targets)

    def score(self, logits, targets):
        """logits [b, t, V] -> [b, t, 2] (log pi_T, entropy) of the targets."""
        if self.suppressed is not None:
            logits = logits.index_fill(-1, self.suppressed, -1e30)
        return torch.stack(token_logps_and_entropy(logits, targets, self.temperature), -1)


def base_of(model):
    """The transformers model under peft's wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@contextmanager
def swapped_head(model, head):
    """The model with `head` in place of its LM head (the real one as head.lm_head) for one forward. FSDP2 keeps
    managing the real head's parameters: they are unsharded during the root's forward and backward."""
    base = base_of(model)
    head.lm_head = base.get_output_embeddings()
    base.set_output_embeddings(head)
    try:
        yield
    finally:
        base.set_output_embeddings(head.lm_head)


# config fields with which a model transforms its head's output (softcapping, scales): LogpsHead would skip them
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                    "logits_scaling")


def plain_head(model):
    """Whether the model's logits are its LM head's output as they are, so LogpsHead can stand in for the head."""
    config = base_of(model).config.get_text_config()
    return all(getattr(config, name, None) in (None, 1, 1.0) for name in LOGIT_TRANSFORMS)


@torch.no_grad()
def batch_logps(model, batch, cfg):
    """log pi_T of every completion token from a no-grad forward, in training's micro-batches (so that two models
    with equal weights give bitwise-equal numbers, which bf16 kernels of other batch shapes do not).  [B, T]"""
    was_training = model.training
    model.eval()
    logps = torch.zeros(batch["completion_ids"].shape, device=batch["completion_ids"].device)
    for mb in micro_batches(len(logps), cfg.per_device_train_batch_size):
        mb_logps, _, T = forward_logps(model, batch, mb, cfg.temperature)
        logps[mb, :T] = mb_logps
    model.train(was_training)
    return logps
