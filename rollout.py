"""Prompts -> completions with the Hugging Face model, and the training forward whose log-probs
must agree with the sampler's.

- `Rollout`: what a generated batch is, field by field, for every backend (vLLM's too).
- Prompts: chat template, tokens, images; the one padding helper.
- `DecodeLoop`: our own sampling loop over the policy (CPU and GPU, plain or FSDP2-sharded; HF
  `generate` for vision-language models). Besides the tokens it records the sampler's log-probs of
  the temperature-scaled distribution, log softmax(logits / T)[o_t]; in fp32 they are the KL's "old"
  log-probs (paper §3: r = R - beta * KL), so no scoring pass is needed (README 'Where we differ
  from TRL, on purpose').
- The training forward: `forward_logps` through `LogpsHead`, and `batch_logps`.

vLLM generation is in vllm_rollout.py; rewards in rewards.py.
"""
import dataclasses
import io
import weakref
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint
from transformers import (DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList,
                          StaticCache)
from transformers.cache_utils import DynamicLayer, StaticLayer
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from config import fail
from rloo import token_logps_and_entropy


# ---------------------------------------------------------------------------------------------
# What a generated batch is
# ---------------------------------------------------------------------------------------------

@dataclass
class Rollout:
    """One generated batch: B = P * G completions, a prompt's G adjacent, in the order the fields
    are produced. Optional fields are None where a backend or a run has none."""
    rows: dict  # the P prompts' dataset columns, {name: [P values]}
    prompt_ids: torch.Tensor  # [B, L] left-padded
    prompt_mask: torch.Tensor  # [B, L]
    completion_ids: torch.Tensor  # [B, T] right-padded after the first EOS
    completion_mask: torch.Tensor  # [B, T] 1 up to and including the first EOS
    truncated: torch.Tensor  # [B] bool: no EOS within max_completion_length
    completion_lists: list  # B unpadded id lists, EOS kept: what reward functions get
    texts: list  # B decoded completions
    # [B, T] log pi_T of each token, where the sampler reports exactly that (sampler_logps_exact)
    sampler_logps: torch.Tensor | None = None
    # vision-language: rows (a slice) -> the processor's tensors of those rows, for the forward
    pixel_inputs: Callable | None = None
    suppressed_ids: torch.Tensor | None = None  # image placeholders the sampler never emits
    rewards_per_func: torch.Tensor | None = None  # [B, K] when dynamic sampling scored it already
    timings: dict = field(default_factory=dict)  # seconds spent inside generation, e.g. the push
    # what reward functions logged (TRL's log_extra, log_metric): column -> B values, name -> values
    logged_columns: dict = field(default_factory=dict)
    logged_metrics: dict = field(default_factory=dict)
    # multi-turn (environments.py): [B, T] 1 where the model sampled the token, 0 where the
    # environment wrote it; B turn lists (the reward functions' completions); {name: [B]} counts
    generated_mask: torch.Tensor | None = None
    turns: list | None = None
    turn_stats: dict | None = None

    def model_tokens(self):
        """[B, T] the completion tokens the model sampled: the only ones in s_i, the KL, the
        entropy and the lengths (environment tokens are context)."""
        if self.generated_mask is None:
            return self.completion_mask
        return self.completion_mask * self.generated_mask

    def take(self, index):
        """The completions at index (a list of row numbers) as a Rollout of their own; rows keeps
        the prompts they belong to, in order (index holds whole groups)."""
        picked = torch.tensor(index)
        G = len(self.completion_lists) // len(next(iter(self.rows.values())))
        prompts = index[::G]
        values = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and f.name != "suppressed_ids":
                value = value[picked.to(value.device)]
            elif isinstance(value, list):
                value = [value[i] for i in index]
            values[f.name] = value
        values["rows"] = {k: [v[i // G] for i in prompts] for k, v in self.rows.items()}
        values["logged_columns"] = {k: [v[i] for i in index]
                                    for k, v in self.logged_columns.items()}
        if self.turn_stats is not None:
            values["turn_stats"] = {k: v[picked.to(v.device)] for k, v in self.turn_stats.items()}
        values["timings"] = {}
        return Rollout(**values)


def concat(rollouts, pad_id):
    """One Rollout of several, prompts re-padded on the left and completions on the right."""
    first, values = rollouts[0], {}
    for f in dataclasses.fields(first):
        parts = [getattr(r, f.name) for r in rollouts]
        if f.name == "rows":
            values[f.name] = {k: [v for p in parts for v in p[k]] for k in parts[0]}
        elif f.name in ("logged_columns", "logged_metrics"):  # a column some parts lack: None
            sizes = [len(r.completion_lists) if f.name == "logged_columns" else 0
                     for r in rollouts]
            keys = dict.fromkeys(k for p in parts for k in p)
            values[f.name] = {k: [v for p, n in zip(parts, sizes) for v in p.get(k, [None] * n)]
                              for k in keys}
        elif isinstance(parts[0], list):
            values[f.name] = [v for p in parts for v in p]
        elif f.name == "turn_stats" and parts[0] is not None:
            values[f.name] = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        elif isinstance(parts[0], torch.Tensor) and parts[0].dim() == 2:
            value = pad_id if f.name.endswith("_ids") else 0
            values[f.name] = pad(parts, value, left=f.name.startswith("prompt"))
        elif isinstance(parts[0], torch.Tensor) and f.name != "suppressed_ids":
            values[f.name] = torch.cat(parts)
        else:
            values[f.name] = parts[0]
    values["timings"] = {}
    return Rollout(**values)


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------

def is_conversational(prompt):
    """A conversational prompt is a list of {"role", "content"} messages; a standard one a
    string."""
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def is_token_ids(prompt):
    """A prompt given as token ids (environments.py continues a trajectory this way)."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(x, int) for x in prompt)


def repeat_each(values, G):
    """Each value G times, adjacent: a prompt's columns for its G completions."""
    return [v for v in values for _ in range(G)]


def pad(pieces, value, left=False):
    """Rows of different lengths (id lists, or [b, t] tensors) -> one [rows, longest] tensor padded
    with value, on the left (prompts, so that each ends where generation starts) or the right."""
    pieces = [p if isinstance(p, torch.Tensor) else torch.tensor([p], dtype=None if p else int)
              for p in pieces]
    width = max(p.shape[1] for p in pieces)
    return torch.cat([F.pad(p, (width - p.shape[1], 0) if left else (0, width - p.shape[1]),
                            value=value) for p in pieces])


def prompt_texts(tokenizer, prompts, chat_template_kwargs=None, images=None):
    """Conversational prompts get the chat template with add_generation_prompt=True; strings pass
    through. With images (a list per row; tokenizer is then the processor) they enter the first
    user message as image parts."""
    if images is not None:
        prompts = [with_images(p, row) for p, row in zip(prompts, images)]
    options = chat_template_kwargs or {}
    return [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True, **options)
            if is_conversational(p) else p for p in prompts]


def tokenize_prompts(tokenizer, prompts, chat_template_kwargs=None):
    """Prompt token ids as TRL makes them: a conversation gets the chat template, which writes its
    own special tokens; a standard string gets the tokenizer's (BOS for Llama, Gemma or Mistral,
    nothing for Qwen or SmolLM2)."""
    if prompts and all(is_token_ids(p) for p in prompts):  # a multi-turn trajectory so far
        return [list(p) for p in prompts]
    texts = prompt_texts(tokenizer, prompts, chat_template_kwargs)
    standard = [not is_conversational(p) for p in prompts]
    ids = {}
    for flag in set(standard):
        chosen = [t for t, s in zip(texts, standard) if s == flag]
        ids[flag] = iter(tokenizer(chosen, add_special_tokens=flag).input_ids)
    return [next(ids[s]) for s in standard]


def prompt_tensors(id_lists, pad_id, G, device):
    """Each prompt's ids G times, left-padded -> prompt_ids, prompt_mask [P * G, longest]."""
    ids = pad(repeat_each(id_lists, G), pad_id, left=True)
    mask = pad(repeat_each([[1] * len(p) for p in id_lists], G), 0, left=True)
    return ids.to(device), mask.to(device)


def with_images(messages, images, part=lambda image: {"type": "image"}):
    """The conversation with one image part per image at the front of its first user message."""
    out, placed = [], False
    for message in messages:
        if not placed and message["role"] == "user":
            content = message["content"]
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            message = {**message, "content": [part(image) for image in images] + list(parts)}
            placed = True
        out.append(message)
    return out


def row_images(rows):
    """Each row's images as RGB PIL images (column `image`: one per row, `images`: a list), None
    without such a column. Takes PIL images, file paths and an undecoded `datasets` Image's dicts.
    An image that does not load stops the run with one line naming it."""
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
    except (OSError, KeyError, TypeError, AttributeError) as e:  # PIL's errors are OSErrors
        fail(f"cannot read image {str(x)[:200]!r}: {e}. Image columns take PIL images, image file "
             "paths, or {'bytes': ..., 'path': ...} dicts")


def processor_inputs(processor, texts, images, device):
    """The processor's tensors for prompt texts and their images, left-padded: input_ids,
    attention_mask and the model's pixel inputs (pixel_values, image_grid_thw, ...). Their layout
    differs per family (patches concatenated, images stacked, padded per row), so any subset of rows
    is processed again, never sliced."""
    enc = processor(text=texts, images=images if any(images) else None, padding=True,
                    padding_side="left", return_tensors="pt")
    return {k: v.to(device) for k, v in enc.items()}


def pixel_inputs_for(processor, prompts, images, G, device, chat_template_kwargs=None):
    """rows -> the processor's tensors for that slice of the B = P*G rows (each prompt and its
    images G times)."""
    texts = repeat_each(prompt_texts(processor, prompts, chat_template_kwargs, images), G)
    images = repeat_each(images, G)
    return lambda rows: processor_inputs(processor, texts[rows], images[rows], device)


def image_token_ids(processor):
    """Placeholder ids the policy must never sample: the forward pairs each with an image
    feature."""
    names = ("image_token_id", "video_token_id")
    return sorted(v for k, v in vars(processor).items() if k.endswith(names) and isinstance(v, int))


def eos_token_ids(tokenizer, model, cfg=None):
    """Every id that ends a completion: the tokenizer's EOS, the model's generation_config EOS (may
    be a list) and generation_kwargs' stop_token_ids."""
    stop_ids = ((cfg and cfg.generation_kwargs) or {}).get("stop_token_ids", [])
    ids = {tokenizer.eos_token_id, *stop_ids}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)


# ---------------------------------------------------------------------------------------------
# Sampling: our decode loop
# ---------------------------------------------------------------------------------------------

class DecodeLoop:
    """The generator without vLLM: samples from the policy's live weights in the precision the
    trainer scores in, so there is nothing to push."""

    def __init__(self, cfg, model, tokenizer, processor, device):
        self.cfg, self.model, self.tokenizer, self.processor = cfg, model, tokenizer, processor
        self.device = device

    def generate(self, rows, seed=None, cfg=None):
        """cfg: this call's settings, if not the run's (a multi-turn turn: one sample per
        trajectory, the budget it has left)."""
        return generate(self.model, self.tokenizer, rows, cfg or self.cfg, self.device,
                        self.processor, seed)

    def session(self, rows):
        """Multi-turn: this generator for the turns of trajectories `rows` (a range)."""
        return DecodeSession(self, rows)

    def push_weights(self):
        pass

    def close(self):
        pass


@dataclass
class DecodeSession:
    """DecodeLoop's generate over the turns of trajectories `rows`, each keeping its KV cache from
    one call to the next: rows["trajectory"] names each prompt's trajectory, whose token ids extend
    what it was given and sampled before, so a turn computes only the new tokens (the environment's
    reply), as vLLM's prefix cache does. The rows of trajectories that ended leave the cache, but
    with --compile_decode they sit the turn out (a new batch size would compile again). A model
    whose cache cannot keep them (sliding windows, recurrent layers) decodes each turn afresh. The
    samples are a function of (seed, trajectory)."""
    loop: DecodeLoop
    rows: range
    static: bool | None = None  # as decode's (None: on a GPU or when compiling)
    state: "Decoding | None" = None
    members: list = field(default_factory=list)  # the trajectory of each of the state's rows

    def generate(self, rows, seed=None, cfg=None):
        loop, index = self.loop, [i - self.rows.start for i in rows["trajectory"]]
        return generate(loop.model, loop.tokenizer, rows, cfg or loop.cfg, loop.device, seed=seed,
                        decoder=lambda *args: self.decode(*args, index, rows["prompt"]))

    def decode(self, model, prompt_ids, prompt_mask, cfg, eos_ids, pad_id, seed, index, given):
        """given: the prompts' token ids (lists), as prompt_ids holds them."""
        keys = row_keys(seed, self.rows.stop, prompt_ids.device)[self.rows.start:]
        if self.state is None:
            columns = prompt_ids.shape[1] + cfg.max_completion_length
            self.state = new_decoding(model, len(index), columns, self.static, pad_id,
                                      prompt_ids.device, cfg)
            self.members = list(index)
        if not self.state.reusable():
            return decode(model, prompt_ids, prompt_mask, cfg, eos_ids, pad_id, keys[index])
        row_of = {i: row for row, i in enumerate(self.members)}
        if index != self.members and not cfg.compile_decode:
            self.state.fit(0, [row_of[i] for i in index])
            self.members, row_of = list(index), {i: row for row, i in enumerate(index)}
        state, new = self.state, {i: [] for i in self.members}  # tokens not yet in the cache
        cached = own_tokens(state.ids[:, :state.filled], state.mask[:, :state.filled])
        for i, ids in zip(index, given):
            row = row_of[i]
            assert ids[:len(cached[row])] == cached[row], "a turn's prompt extends its trajectory"
            new[i] = ids[len(cached[row]):]
            if not new[i]:  # an empty reply: the last token again, its cached column hidden
                state.mask[row, state.mask[row, :state.filled].nonzero()[-1]] = 0
                new[i] = cached[row][-1:]
        block_ids, block_mask = prompt_tensors(list(new.values()), pad_id, 1, prompt_ids.device)
        ids, logps = decode(model, block_ids, block_mask, cfg, eos_ids, pad_id,
                            keys[self.members], state=self.state)
        rows = [row_of[i] for i in index]
        return ids[rows], logps[rows]


@torch.no_grad()
def generate(model, tokenizer, rows, cfg, device, processor=None, seed=None, decoder=None):
    """cfg.num_generations completions for each of rows["prompt"] (strings or conversations) ->
    Rollout. Vision-language: the rows' image columns go through `processor` with the texts. The
    samples of text models are a function of seed and of each row (None: drawn from torch's RNG),
    so decoding in chunks of --generation_chunk_size rows gives the samples of one call.
    decoder: decode_in_chunks' stand-in (a DecodeSession's)."""
    G, pad_id = cfg.num_generations, tokenizer.pad_token_id
    eos_ids, cfg = eos_token_ids(tokenizer, model, cfg), with_bad_word_ids(cfg, tokenizer)
    images = row_images(rows) if processor is not None else None
    if images is None:
        ids = tokenize_prompts(tokenizer, rows["prompt"], cfg.chat_template_kwargs)
        prompt_ids, prompt_mask = prompt_tensors(ids, pad_id, G, device)  # [B, L]
    else:  # each completion gets its own copy of its prompt's images, as the training forward
        rows_inputs = pixel_inputs_for(processor, rows["prompt"], images, G, device,
                                       cfg.chat_template_kwargs)
        pixel_inputs = rows_inputs(slice(None))
        prompt_ids, prompt_mask = pixel_inputs.pop("input_ids"), pixel_inputs.pop("attention_mask")
    was_training = model.training
    model.eval()
    try:
        with unsharded(model):
            if images is None:
                completion_ids, sampler_logps = (decoder or decode_in_chunks)(
                    model, prompt_ids, prompt_mask, cfg, eos_ids, pad_id, seed)
            else:
                inputs = dict(input_ids=prompt_ids, attention_mask=prompt_mask, **pixel_inputs)
                completion_ids, sampler_logps = generate_hf(model, inputs, cfg, eos_ids, pad_id,
                                                            image_token_ids(processor))
    finally:
        model.train(was_training)
    rollout = finish(rows, prompt_ids, prompt_mask, completion_ids, sampler_logps, eos_ids,
                     tokenizer)
    if images is not None:
        rollout.pixel_inputs = rows_inputs
        rollout.suppressed_ids = torch.tensor(image_token_ids(processor), device=device)
    return rollout


def finish(rows, prompt_ids, prompt_mask, completion_ids, sampler_logps, eos_ids, tokenizer):
    """Every backend ends here: completions cut at the first EOS, masked, listed unpadded and
    decoded -> Rollout. sampler_logps None: the backend cannot report log pi_T."""
    completion_ids, completion_mask, truncated = completion_masks(completion_ids, eos_ids,
                                                                  tokenizer.pad_token_id)
    lengths = completion_mask.sum(-1).tolist()
    width = max(lengths)  # the decode loop may run past the last row's EOS (END_CHECK_EVERY)
    completion_ids, completion_mask = completion_ids[:, :width], completion_mask[:, :width]
    lists = [ids[:n] for ids, n in zip(completion_ids.tolist(), lengths)]
    if sampler_logps is not None:
        sampler_logps = sampler_logps[:, :width] * completion_mask
    return Rollout(rows, prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, lists,
                   tokenizer.batch_decode(lists, skip_special_tokens=True), sampler_logps)


def completion_masks(completion_ids, eos_ids, pad_id):
    """Cut each row at its first EOS (kept): -> ids with pad after it [B, T], mask [B, T] (1
    through the EOS), truncated [B] (no EOS at all: the row ran to max_completion_length)."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    truncated = ~is_eos.any(-1)  # [B]
    first_eos = torch.where(truncated, completion_ids.shape[1], is_eos.int().argmax(-1))  # [B]
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    mask = (positions[None] <= first_eos[:, None]).long()  # [B, T], EOS included
    return completion_ids.masked_fill(mask == 0, pad_id), mask, truncated


@contextmanager
def unsharded(model):
    """FSDP2: all-gather the weights once for the whole generation, not once per token; reshard
    after. No collective runs after the first forward, so ranks may stop at different lengths (no
    `synced_gpus`). Plain modules pass through untouched."""
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


def sampling_processors(cfg, prompt_ids, eos_ids):
    """--generation_kwargs' options in vLLM's order (allowed tokens, bad words, logit bias, min
    tokens, penalties), then HF's own penalty and filters in HF generate's order (vLLM's:
    penalties, temperature, filters); applied to the logits after log pi_T is recorded. A model's
    shipped generation_config (e.g. top_k=20) adds none of its own, so it cannot silently change
    the sampling. Bad words are token ids here (with_bad_word_ids)."""
    extra, processors, prompt_length = cfg.generation_kwargs or {}, [], prompt_ids.shape[1]
    if extra.get("allowed_token_ids"):
        processors.append(allowed_only(extra["allowed_token_ids"]))
    if extra.get("bad_words_ids"):
        processors.append(ban_sequences(prompt_length, extra["bad_words_ids"]))
    if extra.get("logit_bias"):
        processors.append(logit_bias(extra["logit_bias"]))
    if extra.get("min_tokens"):
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_length, extra["min_tokens"],
                                                            eos_ids, prompt_ids.device))
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


def allowed_only(allowed):
    """vLLM's allowed_token_ids: every other token gets probability 0."""
    def mask(ids, scores):
        banned = torch.ones(scores.shape[-1], dtype=torch.bool, device=scores.device)
        banned[allowed] = False
        return scores.masked_fill(banned, float("-inf"))
    return mask


def ban_sequences(prompt_length, sequences):
    """vLLM's bad words, as token ids: a token that would complete one of the sequences at the end
    of the completion so far (the prompt is not looked at) gets probability 0."""
    def ban(ids, scores):
        completion, hits = ids[:, prompt_length:], []
        for *prefix, last in sequences:
            if len(prefix) > completion.shape[1]:
                continue
            tail = completion[:, completion.shape[1] - len(prefix):]
            hit = (tail == torch.tensor(prefix, device=ids.device)).all(-1)  # [B]
            hits.append((hit, last))
        for hit, last in hits:
            scores = scores.index_put((hit.nonzero()[:, 0], torch.tensor(last, device=ids.device)),
                                      torch.tensor(float("-inf"), device=ids.device))
        return scores
    return ban


def logit_bias(bias):
    """vLLM's (and OpenAI's) logit_bias: z_v += bias[v]."""
    def add(ids, scores):
        index = torch.tensor(list(bias), device=scores.device)
        values = torch.tensor(list(bias.values()), dtype=scores.dtype, device=scores.device)
        return scores.index_add(-1, index, values.expand(len(scores), -1))
    return add


def bad_word_ids(tokenizer, words):
    """vLLM's tokenization of bad_words (SamplingParams.update_from_tokenizer): each word without
    and, where that gives another first token of the same length, with a leading space."""
    sequences = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            fail(f"--generation_kwargs bad_words: {word!r} is no token of this tokenizer")
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences


def with_bad_word_ids(cfg, tokenizer):
    """cfg with generation_kwargs' bad_words turned into token ids, beside bad_words_ids."""
    extra = cfg.generation_kwargs or {}
    if not extra.get("bad_words"):
        return cfg
    ids = extra.get("bad_words_ids", []) + bad_word_ids(tokenizer, extra["bad_words"])
    options = {**{k: v for k, v in extra.items() if k != "bad_words"}, "bad_words_ids": ids}
    return dataclasses.replace(cfg, generation_kwargs=options)


def check_token_ids(cfg, model, tokenizer):
    """Token ids in --generation_kwargs exist in the model's vocabulary, and a bad word is at
    least one token (at start-up)."""
    vocab, extra = model.config.get_text_config().vocab_size, cfg.generation_kwargs or {}
    bad_word_ids(tokenizer, extra.get("bad_words", []))
    named = {"stop_token_ids": extra.get("stop_token_ids", []),
             "allowed_token_ids": extra.get("allowed_token_ids", []),
             "logit_bias": list(extra.get("logit_bias", {})),
             "bad_words_ids": [i for ids in extra.get("bad_words_ids", []) for i in ids]}
    for key, ids in named.items():
        outside = [i for i in ids if not 0 <= i < vocab]
        if outside:
            fail(f"--generation_kwargs {key}: token ids {outside[:5]} are not in the model's "
                 f"vocabulary of {vocab}")


def completion_penalties(prompt_length, presence, frequency):
    """OpenAI's (and vLLM's) penalties: z_v -= frequency * c_v + presence * [c_v > 0], c_v the
    count of v in the completion so far (the prompt is not counted)."""
    def penalize(ids, scores):
        completion = ids[:, prompt_length:]
        ones = torch.ones_like(completion, dtype=scores.dtype)
        counts = torch.zeros_like(scores).scatter_add_(1, completion, ones)
        return scores - frequency * counts - presence * (counts > 0).float()
    return penalize


# splitmix64 (Steele et al. 2014) in int64 arithmetic, which wraps as uint64 does; the shifts are
# masked to act as logical ones. Counter-based: the noise of (row, step, token) needs no state.
GOLDEN, MIX1, MIX2 = -7046029254386353131, -4658895280553007687, -7723592293110705685


def splitmix(x):
    x = (x ^ ((x >> 30) & (2**34 - 1))) * MIX1
    x = (x ^ ((x >> 27) & (2**37 - 1))) * MIX2
    return x ^ ((x >> 31) & (2**33 - 1))


def row_keys(seed, num_rows, device):
    """One int64 key per completion row, from the call's seed (None: a draw from torch's
    checkpointed RNG).  [B]"""
    if seed is None:
        seed = int(torch.randint(2**62, ()).item())
    rows = torch.arange(1, num_rows + 1, device=device)
    return splitmix(splitmix(torch.tensor(seed % 2**62, device=device)) + rows * GOLDEN)


def exponential_noise(keys, t, vocab_size):
    """Exp(1) draws [B, V]: -log U, U a pure function of (row key, step t, token) on a 24-bit grid
    in (0, 1)."""
    tokens = torch.arange(vocab_size, device=keys.device)
    bits = splitmix(keys[:, None] + (t * vocab_size + tokens + 1) * GOLDEN)
    uniform = ((bits >> 40) & (2**24 - 1)).float().add_(0.5).mul_(2.0**-24)
    return uniform.log_().neg_()


def decode_in_chunks(model, prompt_ids, prompt_mask, cfg, eos_ids, pad_id, seed):
    """decode over chunks of at most --generation_chunk_size rows (0: all), each row keeping its
    noise key, so the samples do not depend on the chunking. -> completion_ids, log pi_T [B, T]"""
    keys = row_keys(seed, len(prompt_ids), prompt_ids.device)
    chunks = [decode(model, prompt_ids[rows], prompt_mask[rows], cfg, eos_ids, pad_id, keys[rows])
              for rows in micro_batches(len(prompt_ids), cfg.generation_chunk_size or len(keys))]
    return pad([ids for ids, _ in chunks], pad_id), pad([logps for _, logps in chunks], 0.0)


class KVBuffer(DynamicLayer):
    """A cache layer that writes each token's keys and values into a buffer sized for the whole
    generation. DynamicLayer concatenates instead, copying the whole cache at every token: 40% of a
    4M-parameter model's decode time at 64 tokens on CPU, and quadratic in the length."""

    def __init__(self, capacity):
        super().__init__()
        self.capacity = capacity

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            # [B, H, capacity, D]; keys and values may differ in H or D
            buffers = [x.new_empty(*x.shape[:2], self.capacity, x.shape[3])
                       for x in (key_states, value_states)]
            self.key_buffer, self.value_buffer = buffers
        start = self.get_seq_length()  # the views below are the cache so far
        end = start + key_states.shape[-2]
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values

    def resize(self, rows, capacity):
        """Only these rows, in buffers of `capacity` tokens."""
        self.capacity = capacity
        if self.is_initialized:
            n, kept = self.get_seq_length(), [x[rows] for x in (self.keys, self.values)]
            self.key_buffer, self.value_buffer = [torch.cat([x, x.new_empty(
                *x.shape[:2], capacity - n, x.shape[3])], 2) for x in kept]
            self.keys, self.values = self.key_buffer[:, :, :n], self.value_buffer[:, :, :n]


# A host sync (has every row ended?) every this many tokens: on a GPU each drains the launch queue.
END_CHECK_EVERY = 8


@dataclass
class Decoding:
    """The rows being decoded, as columns: every token fed to the model so far (ids; mask 1 at a
    row's own tokens, 0 at padding and where a row waits after its EOS) in buffers, and their KV
    cache, `filled` columns long. decode() starts one, or (multi-turn) extends one by a turn."""
    ids: torch.Tensor  # [B, capacity]
    mask: torch.Tensor  # [B, capacity]
    cache: object
    static: bool  # StaticCache: fixed shapes, the full-width mask
    filled: int = 0

    def fit(self, columns, rows=slice(None)):
        """Room for `columns`, and only `rows` (row numbers) if given: the buffers and every cache
        layer move to new ones (static: in 256-token steps, so that few shapes compile)."""
        width = max(self.ids.shape[1], round_up(columns, 256) if self.static else columns)
        if width == self.ids.shape[1] and rows == slice(None):
            return
        grow = (0, width - self.ids.shape[1])
        self.ids, self.mask = F.pad(self.ids[rows], grow), F.pad(self.mask[rows], grow)
        for layer in self.cache.layers:
            if isinstance(layer, KVBuffer):
                layer.resize(rows, width)
            elif layer.is_initialized:  # StaticLayer: new zeroed buffers, marked static
                old, layer.max_cache_len = (layer.keys[rows], layer.values[rows]), width
                layer.lazy_initialization(*old)
                layer.keys[:, :, :old[0].shape[2]], layer.values[:, :, :old[1].shape[2]] = old
            else:
                layer.max_cache_len = width

    def reusable(self):
        """Only full-attention layers can keep a row's cache across turns: the waiting columns
        would eat a sliding window, and a recurrent state cannot skip them."""
        return all(type(layer) in (KVBuffer, StaticLayer) for layer in self.cache.layers)


def own_tokens(ids, mask):
    """[B, n] ids and mask -> each row's own tokens, as lists (two copies to the host)."""
    return [[t for t, m in zip(row, flags) if m] for row, flags in zip(ids.tolist(), mask.tolist())]


def decode(model, prompt_ids, prompt_mask, cfg, eos_ids, pad_id, keys, static=None, state=None):
    """HF generate's sampling without its per-token bookkeeping (a third of a small model's decode
    step on CPU). One forward per token on the KV cache; HF's processors, in order; log pi_T of each
    token from the raw logits; rows that ended get padding; stops once every row has (checked every
    END_CHECK_EVERY tokens). Ids and mask live in buffers sized for the whole generation; on a GPU
    the cache is static (fixed shapes, so --compile_decode can capture the step in a CUDA graph).
    keys [B]: each row's noise key (row_keys); static None: on a GPU or when compiling.
    state: a Decoding to extend by this turn, prompt_ids [B, E] then being each row's tokens not yet
    in its cache, right-aligned (a row with none sits the turn out).
    -> completion_ids [B, T] and their log pi_T [B, T]"""
    B, E = prompt_ids.shape
    T = cfg.max_completion_length
    if state is None:
        state = new_decoding(model, B, E + T, static, pad_id, prompt_ids.device, cfg)
    state.fit(state.filled + E + T)
    ids, mask, cache, static, L = state.ids, state.mask, state.cache, state.static, state.filled + E
    ids[:, L - E:L], mask[:, L - E:L] = prompt_ids, prompt_mask
    positions = (mask[:, :L].cumsum(-1) - 1).clamp(min=0)[:, L - E:]  # a row's own tokens count
    processors = sampling_processors(cfg, ids[:, :L], eos_ids)
    eos = torch.tensor(eos_ids, device=prompt_ids.device)
    out = model(input_ids=prompt_ids, attention_mask=mask if static else mask[:, :L],
                position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
    step, positions = decode_step(model, cfg), positions[:, -1:] + 1  # [B, 1]
    logps = torch.zeros(B, T, device=prompt_ids.device)  # [B, T]
    ended = ~prompt_mask.any(-1)  # [B] rows sitting the turn out
    for t in range(T):
        logits = out.logits[:, -1].float()  # [B, V]
        scores = logits
        for process in processors:
            scores = process(ids[:, :L + t], scores)
        # torch.multinomial's own method, argmax p / E with E ~ Exp(1) (3x faster on CPU)
        probs = torch.softmax(scores, -1)
        token = (probs / exponential_noise(keys, t, probs.shape[-1])).argmax(-1)  # [B]
        token = token.masked_fill(ended, pad_id)
        log_pi = torch.log_softmax(logits / cfg.temperature, -1)
        logps[:, t] = log_pi.gather(-1, token[:, None])[:, 0]
        ids[:, L + t], own = token, ~ended  # the EOS is the row's own token, what follows is not
        ended |= torch.isin(token, eos)
        if t + 1 == T or (t + 1) % END_CHECK_EVERY == 0 and ended.all():
            break
        mask[:, L + t] = own
        out = step(input_ids=ids[:, L + t:L + t + 1], position_ids=positions,
                   attention_mask=mask if static else mask[:, :L + t + 1], past_key_values=cache,
                   use_cache=True)
        positions = positions + own[:, None]
    state.filled = L + t  # the last token is sampled, not yet fed
    return ids[:, L:L + t + 1].clone(), logps[:, :t + 1]


def new_decoding(model, rows, columns, static, pad_id, device, cfg):
    """static None: on a GPU or when compiling."""
    static = device.type == "cuda" or cfg.compile_decode if static is None else static
    width = round_up(columns, 256) if static else columns  # few distinct shapes: few compilations
    return Decoding(torch.full((rows, width), pad_id, device=device),
                    torch.zeros((rows, width), dtype=torch.long, device=device),
                    kv_cache(model, width, static), static)


def round_up(n, multiple):
    return -(-n // multiple) * multiple


def kv_cache(model, capacity, static):
    """The cache the model would build, its full-attention layers preallocated for `capacity`
    tokens: HF's StaticCache (fixed shapes) or KVBuffer (views that grow, so attention spans only
    the tokens so far)."""
    if static:
        return StaticCache(config=model.config, max_cache_len=capacity)
    cache = DynamicCache(config=model.config)
    cache.layers = [KVBuffer(capacity) if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]
    return cache


COMPILED_STEPS = weakref.WeakKeyDictionary()


def decode_step(model, cfg):
    """The per-token forward: the model, or with --compile_decode its torch.compile (CUDA graphs on
    a GPU, mode reduce-overhead), compiled once per model and reused while shapes repeat."""
    if not cfg.compile_decode:
        return model
    if model not in COMPILED_STEPS:
        mode = "reduce-overhead" if next(model.parameters()).device.type == "cuda" else None
        COMPILED_STEPS[model] = torch.compile(model, mode=mode, dynamic=False)
    return COMPILED_STEPS[model]


class RecordLogps(LogitsProcessor):
    """generate_hf's logits processor, right after the placeholder suppression: keeps log pi_T =
    log_softmax(logits / T) of every sampled token. A LogitsProcessor, not a closure: transformers
    inspects every processor's signature at every token, and a function's is parsed from text."""

    def __init__(self, temperature):
        self.temperature, self.step_logps, self.last = temperature, [], None

    def __call__(self, input_ids, scores):
        # once per new token with the raw logits; input_ids[:, -1] was sampled from the previous
        # call's distribution, so log-probs are gathered one call late (and once more in logps())
        if self.last is not None:
            self.step_logps.append(self.last.gather(-1, input_ids[:, -1:]))
        self.last = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # [B, V]
        return scores

    def logps(self, completion_ids):
        """[B, T] log-probs of the completion tokens, once generation is done."""
        return torch.cat(self.step_logps + [self.last.gather(-1, completion_ids[:, -1:])], dim=1)


def generate_hf(model, inputs, cfg, eos_ids, pad_id, suppress):
    """Vision-language models: HF generate, which knows each family's position bookkeeping
    (Qwen2-VL's 3-D rotary offsets), on the processor's inputs. Image placeholders are suppressed
    before log pi_T is recorded: the policy is the model without them, in training too. The model's
    shipped generation config is swapped for a bare one for the call."""
    record = RecordLogps(cfg.temperature)
    shipped_config = model.generation_config
    model.generation_config = GenerationConfig(
        do_sample=True, max_new_tokens=cfg.max_completion_length, top_k=0, eos_token_id=eos_ids,
        pad_token_id=pad_id)
    try:
        processors = [SuppressTokensLogitsProcessor(suppress), record]
        processors += sampling_processors(cfg, inputs["input_ids"], eos_ids)
        sequences = model.generate(**inputs, logits_processor=LogitsProcessorList(processors))
    finally:
        model.generation_config = shipped_config
    completion_ids = sequences[:, inputs["input_ids"].shape[1]:]  # [B, T]
    return completion_ids, record.logps(completion_ids)


# ---------------------------------------------------------------------------------------------
# The training forward: log pi_T of the sampled tokens, as the loss and the KL see them
# ---------------------------------------------------------------------------------------------

def micro_batches(batch_size, micro_size):
    return [slice(i, i + micro_size) for i in range(0, batch_size, micro_size)]


def forward_logps(model, batch, rows, temperature, chunked=None, router_aux=False, pad_to=None):
    """Per-token log pi_T and entropy of the completion tokens of batch[rows] (a Rollout), padding
    trimmed to these rows. Position ids follow the left padding (as in generate); the head runs on
    completion positions only, in chunks through LogpsHead (chunked=False: the model's own head, for
    models that transform their logits). Vision-language rows also pass their pixel inputs; models
    with multimodal rotary positions (Qwen2-VL's get_rope_index) derive the positions themselves.
    router_aux: also the MoE router's load-balancing loss (the model computes it from its router
    logits, padding excluded). pad_to: the sequence is padded on the right (masked) to a multiple
    of it, which changes no log-prob. -> logps [b, T], entropy [b, T], T, aux loss or None"""
    prompt_mask, completion_mask = batch.prompt_mask[rows], batch.completion_mask[rows]
    prompt_len, completion_len = int(prompt_mask.sum(-1).max()), int(completion_mask.sum(-1).max())
    width = completion_len  # completion positions in the forward
    if pad_to:
        width = -(-(prompt_len + completion_len) // pad_to) * pad_to - prompt_len
    prompt_ids = batch.prompt_ids[rows, -prompt_len:]
    completion_ids = F.pad(batch.completion_ids[rows, :completion_len],
                           (0, width - completion_len))
    input_ids = torch.cat([prompt_ids, completion_ids], 1)  # [b, L+T]
    attention_mask = torch.cat([prompt_mask[:, -prompt_len:],
                                F.pad(completion_mask[:, :completion_len],
                                      (0, width - completion_len))], 1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    pixel_inputs = {}
    if batch.pixel_inputs is not None:  # the processor left-pads these rows to the same prompt_len
        pixel_inputs = batch.pixel_inputs(rows)
        del pixel_inputs["input_ids"], pixel_inputs["attention_mask"]
        for key in ("token_type_ids", "mm_token_type_ids"):  # completion tokens are text (0)
            if key in pixel_inputs:
                text = torch.zeros_like(completion_ids)
                pixel_inputs[key] = torch.cat([pixel_inputs[key], text], 1)
        if hasattr(getattr(model, "model", None), "get_rope_index"):
            position_ids = None
    head = LogpsHead(completion_ids, temperature, batch.suppressed_ids)
    chunked = plain_head(model) if chunked is None else chunked
    if router_aux:
        pixel_inputs["output_router_logits"] = True
    with swapped_head(model, head) if chunked else nullcontext():
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    logits_to_keep=width + 1, use_cache=False, **pixel_inputs)
    logits = out.logits
    per_token = logits if chunked else head.score(logits[:, :-1], completion_ids)  # [b, T, 2]
    per_token = per_token[:, :completion_len]
    aux = out.aux_loss if router_aux else None
    return per_token[..., 0], per_token[..., 1], completion_len, aux


# fp32 elements of one chunk's logits in LogpsHead (64 MB)
HEAD_CHUNK_ELEMENTS = 2**24


class LogpsHead(torch.nn.Module):
    """Stands in for the LM head in a training forward: hidden states [b, T + 1, H] -> [b, T, 2],
    the log pi_T and entropy of each completion token, where the model expects logits. Chunks of
    positions go through the real head one at a time and are recomputed in backward
    (torch.utils.checkpoint), so one chunk of logits is alive at most: b * T * V * 8 bytes less (40
    GB at b=8, T=4096, V=152k). Image placeholders (suppressed) are never sampled, so they are not
    in the policy's distribution either (finite, for the entropy)."""

    def __init__(self, targets, temperature, suppressed=None):
        super().__init__()
        self.targets, self.temperature, self.suppressed = targets, temperature, suppressed
        self.lm_head = None

    def forward(self, hidden):
        hidden = hidden[:, :-1]  # position t predicts targets[:, t]
        width = max(1, HEAD_CHUNK_ELEMENTS // (hidden.shape[0] * self.lm_head.weight.shape[0]))
        pieces = []
        for start in range(0, hidden.shape[1], width):
            args = (hidden[:, start:start + width], self.targets[:, start:start + width])
            recomputed = torch.is_grad_enabled()
            pieces.append(checkpoint(self.chunk, *args, use_reentrant=False) if recomputed
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
    """The model with `head` in place of its LM head (the real one as head.lm_head) for one forward.
    FSDP2 keeps managing the real head's parameters: unsharded in the root's forward and
    backward."""
    base = base_of(model)
    head.lm_head = base.get_output_embeddings()
    base.set_output_embeddings(head)
    try:
        yield
    finally:
        base.set_output_embeddings(head.lm_head)


# config fields with which a model transforms its head's output: LogpsHead would skip them
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier",
                    "lm_head_multiplier", "logits_scaling")


def plain_head(model):
    """Whether the model's logits are its head's output as they are (LogpsHead can stand in)."""
    config = base_of(model).config.get_text_config()
    return all(getattr(config, name, None) in (None, 1, 1.0) for name in LOGIT_TRANSFORMS)


@torch.no_grad()
def batch_logps(model, batch, cfg):
    """log pi_T of every completion token from a no-grad forward, in training's micro-batches (so
    that two models with equal weights give bitwise-equal numbers, which bf16 kernels of other
    batch shapes do not).  [B, T]"""
    was_training = model.training
    model.eval()
    logps = torch.zeros(batch.completion_ids.shape, device=batch.completion_ids.device)
    for mb in micro_batches(len(logps), cfg.per_device_train_batch_size):
        mb_logps, _, T, _ = forward_logps(model, batch, mb, cfg.temperature,
                                          pad_to=cfg.pad_to_multiple_of)
        logps[mb, :T] = mb_logps
    model.train(was_training)
    return logps
