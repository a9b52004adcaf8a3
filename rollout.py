"""Prompts -> completions with the Hugging Face model: our own decode loop (CPU and GPU, plain or
FSDP2-sharded; HF `generate` for vision-language models). Besides the tokens it records the
sampler's log-probs of the temperature-scaled distribution, log softmax(logits / T)[o_t]; in fp32
they are the KL's "old" log-probs (paper §3: r = R - beta * KL), so no scoring pass is needed
(docs/coming-from-trl.md 'Where we differ from TRL, on purpose'). The training forward whose
log-probs must agree with these is step/forward.py; the sampling distribution step/sampler.py; vLLM
generation options/vllm_rollout.py.
"""
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from transformers import (DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList,
                          StaticCache)
from transformers.cache_utils import DynamicLayer, StaticLayer
from transformers.generation.logits_process import SuppressTokensLogitsProcessor

from plumbing import stack
from step.batches import Rollout
from step.forward import micro_batches
from step.metrics import note_memory
from step.prompting import (completion_texts, eos_token_ids, image_token_ids, pad, pixel_inputs_for,
                            prompt_tensors, row_images, tokenize_prompts)
from step.sampler_rules import sampling_filter
from step.sampler import draw, row_keys, sampling_processors, with_bad_word_ids


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
    static: bool | None = None  # as decode's (None: static_cache's choice)
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
        with unsharded(model, plain=images is None):
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
                     tokenizer, sampling_filter(cfg))
    if images is not None:
        rollout.pixel_inputs = rows_inputs
        rollout.suppressed_ids = torch.tensor(image_token_ids(processor), device=device)
    return rollout


def finish(rows, prompt_ids, prompt_mask, completion_ids, sampler_logps, eos_ids, tokenizer,
           replayed=None):
    """Every backend ends here: completions cut at the first EOS, masked, listed unpadded and
    decoded -> Rollout. sampler_logps None: the backend cannot report log pi_T. replayed: the
    {filter: value} the log-probs are truncated to (sampler_rules.sampling_filter)."""
    completion_ids, completion_mask, truncated = completion_masks(completion_ids, eos_ids,
                                                                  tokenizer.pad_token_id)
    lengths = completion_mask.sum(-1).tolist()
    width = max(lengths)  # the decode loop may run past the last row's EOS (END_CHECK_EVERY)
    completion_ids, completion_mask = completion_ids[:, :width], completion_mask[:, :width]
    lists = [ids[:n] for ids, n in zip(completion_ids.tolist(), lengths)]
    if sampler_logps is not None:
        # where(), not a product: padding sampled outside a replayed kept set has log-prob -inf
        sampler_logps = torch.where(completion_mask.bool(), sampler_logps[:, :width], 0.0)
    return Rollout(rows, prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, lists,
                   completion_texts(tokenizer, lists), sampler_logps,
                   sampling_filter=replayed)


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
def unsharded(model, plain=True):
    """FSDP2: all-gather the weights once for the whole generation, not once per token; reshard
    after. No collective runs after the first forward, so ranks may stop at different lengths (no
    `synced_gpus`). plain: the units run as plain modules meanwhile (our decode loop; HF generate
    for vision-language models keeps FSDP2's hooks, which also cast the pixel inputs). Plain
    modules pass through untouched."""
    if not isinstance(model, FSDPModule):
        yield
        return
    settings = reshard_settings(model)
    model.set_reshard_after_forward(False)
    for module in settings:
        module.unshard()
    try:
        with without_fsdp_hooks(settings if plain else []):
            yield
    finally:
        for module, reshard in settings.items():
            module.reshard()
            module.set_reshard_after_forward(reshard, recurse=False)


@contextmanager
def without_fsdp_hooks(units):
    """The gathered units as plain modules: their FSDP2 forward hooks taken out (they would only
    find the weights gathered, and they are dynamo-disabled: a compiled decode step broke into a
    graph per layer, recompiling on each layer's index)."""
    saved = []
    for module in units:
        state = module._get_fsdp_state()
        for name in ("_forward_pre_hooks", "_forward_hooks"):
            hooks = getattr(module, name)
            saved.append((module, name, hooks))
            setattr(module, name, type(hooks)((key, hook) for key, hook in hooks.items()
                                              if getattr(hook, "__self__", None) is not state))
    try:
        yield
    finally:
        for module, name, hooks in saved:
            setattr(module, name, hooks)


def reshard_settings(model):
    """Each FSDP2 unit's own reshard-after-forward, to be put back: recursing with True would
    reshard the root (and an fp32 head) after every forward, one extra all-gather a micro-batch.
    The root's is False where FSDP2 sets it so at its first forward (torch 2.13's FSDPState)."""
    settings = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            root_default = module is model and state._auto_reshard_after_forward
            groups = stack.fsdp_param_groups(module)
            settings[module] = not root_default and any(
                group.post_forward_mesh_info is not None for group in groups)
    return settings


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
    model: object = None  # whose kept static caches a grown one is taken from

    def fit(self, columns, rows=slice(None)):
        """Room for `columns`, and only `rows` (row numbers) if given: the buffers and every cache
        layer move to new ones (static: in 256-token steps, so that few shapes compile)."""
        width = max(self.ids.shape[1], round_up(columns, 256) if self.static else columns)
        if width == self.ids.shape[1] and rows == slice(None):
            return
        grow = (0, width - self.ids.shape[1])
        self.ids, self.mask = F.pad(self.ids[rows], grow), F.pad(self.mask[rows], grow)
        if self.static:  # into the model's kept cache of the new width, not new buffers: a compiled
            # step's CUDA graphs replay on the addresses they were recorded on (kv_cache)
            old, self.cache = self.cache, kv_cache(self.model, width, True, len(self.ids))
            for layer, kept in zip(old.layers, self.cache.layers):
                if layer.is_initialized:
                    keys, values = layer.keys[rows], layer.values[rows]
                    if not kept.is_initialized:
                        kept.lazy_initialization(keys, values)
                    n = keys.shape[2]
                    kept.keys[:, :, :n], kept.values[:, :, :n] = keys, values
                    kept.cumulative_length.copy_(layer.cumulative_length)
            return
        for layer in self.cache.layers:
            if isinstance(layer, KVBuffer):
                layer.resize(rows, width)

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
    END_CHECK_EVERY tokens). Ids and mask live in buffers sized for the whole generation; the cache
    is static only under --compile_decode (static_cache). keys [B]: each row's noise key (row_keys);
    static None: static_cache's choice.
    state: a Decoding to extend by this turn, prompt_ids [B, E] then being each row's tokens not yet
    in its cache, right-aligned (a row with none sits the turn out).
    -> completion_ids [B, T] and their log pi_T [B, T]"""
    B, E = prompt_ids.shape
    T = cfg.max_completion_length
    fresh = state is None
    if fresh:
        state = new_decoding(model, B, E + T, static, pad_id, prompt_ids.device, cfg)
    state.fit(state.filled + E + T)
    ids, mask, cache, static, L = state.ids, state.mask, state.cache, state.static, state.filled + E
    ids[:, L - E:L], mask[:, L - E:L] = prompt_ids, prompt_mask
    positions = (mask[:, :L].cumsum(-1) - 1).clamp(min=0)[:, L - E:]  # a row's own tokens count
    processors = sampling_processors(cfg, ids[:, :L], eos_ids)
    replay = sampling_filter(cfg) is not None
    eos = torch.tensor(eos_ids, device=prompt_ids.device)
    out = prefill(model, prompt_ids, mask if static else mask[:, :L], positions, cache, fresh)
    step, positions = decode_step(model, cfg), positions[:, -1:] + 1  # [B, 1]
    if cfg.compile_decode:
        watch_static_inputs(model, cache, ids.shape)
    logps = torch.zeros(B, T, device=prompt_ids.device)  # [B, T]
    ended = ~prompt_mask.any(-1)  # [B] rows sitting the turn out
    for t in range(T):
        logits = out.logits[:, -1].float()  # [B, V]
        scores = logits
        for process in processors:
            scores = process(ids[:, :L + t], scores)
        # an exact draw at one uniform per (row, step): no [B, V] noise, 4 passes over [B, V]
        token = draw(scores, keys, t, greedy=cfg.temperature == 0).masked_fill(ended, pad_id)
        # --replay_sampling_mask: log pi_T over the kept set (the filters are the last processors)
        log_pi = torch.log_softmax(scores if replay else logits / (cfg.temperature or 1.0), -1)
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
    note_memory()  # the generation phase's peak: the KV cache full (read once, not per token)
    return ids[:, L:L + t + 1].clone(), logps[:, :t + 1]


def prefill(model, prompt_ids, attention_mask, positions, cache, fresh):
    """The prompts' forward into the KV cache -> the model's output ([B, 1, V] logits). A fresh
    KVBuffer cache computes each run of equal adjacent prompts (a prompt's G samples) once and
    copies its keys and values to the run's rows: G times less prefill, the same numbers."""
    rows = repeated_rows(prompt_ids, attention_mask[:, -prompt_ids.shape[1]:]) if fresh and all(
        type(layer) is KVBuffer for layer in cache.layers) else None
    if rows is None:
        return model(input_ids=prompt_ids, attention_mask=attention_mask,
                     position_ids=positions, past_key_values=cache, use_cache=True,
                     logits_to_keep=1)
    firsts, copies = rows
    out = model(input_ids=prompt_ids[firsts], attention_mask=attention_mask[firsts],
                position_ids=positions[firsts], past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    for layer in cache.layers:
        layer.resize(copies, layer.capacity)
    out.logits = out.logits[copies]
    return out


def repeated_rows(prompt_ids, prompt_mask):
    """Where adjacent rows repeat a prompt: (the first row of each run [U], each row's run [B]),
    or None when none does. One host copy."""
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(-1) & \
        (prompt_mask[1:] == prompt_mask[:-1]).all(-1)  # [B - 1]
    if not bool(same.any()):
        return None
    starts = torch.cat([same.new_ones(1), ~same])  # [B]
    return starts.nonzero()[:, 0], starts.long().cumsum(0) - 1


def static_cache(device_type, cfg):
    """Whether decode keeps HF's StaticCache: only under --compile_decode, whose CUDA graphs need
    fixed shapes, and on every device alike. A StaticLayer reports its whole capacity as the key
    length (transformers 5.19), so the mask stays and attention reads capacity keys per token, not
    the L + t written so far (KVBuffer's)."""
    return bool(cfg.compile_decode)


def new_decoding(model, rows, columns, static, pad_id, device, cfg):
    """static None: static_cache's choice."""
    static = static_cache(device.type, cfg) if static is None else static
    width = round_up(columns, 256) if static else columns  # few distinct shapes: few compilations
    stack.took("KV cache", "StaticCache" if static else "KVBuffer",
               "--compile_decode: fixed shapes" if static else "grows in place")
    return Decoding(torch.full((rows, width), pad_id, device=device),
                    torch.zeros((rows, width), dtype=torch.long, device=device),
                    kv_cache(model, width, static, rows), static, model=model)


def round_up(n, multiple):
    return -(-n // multiple) * multiple


def kv_cache(model, capacity, static, rows=None):
    """The cache the model would build, its full-attention layers preallocated for `capacity`
    tokens: HF's StaticCache (fixed shapes) or KVBuffer (views that grow, so attention spans only
    the tokens so far)."""
    if static:  # one per shape, kept: CUDA graphs replay on the buffers they were recorded with
        caches = STATIC_CACHES.setdefault(model, {})
        if (rows, capacity) not in caches:
            caches[rows, capacity] = StaticCache(config=model.config, max_cache_len=capacity)
        caches[rows, capacity].reset()
        return caches[rows, capacity]
    cache = DynamicCache(config=model.config)
    cache.layers = [KVBuffer(capacity) if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]
    return cache


STATIC_CACHES = weakref.WeakKeyDictionary()  # model -> {(rows, capacity): StaticCache}
COMPILED_STEPS = weakref.WeakKeyDictionary()
COMPILE_BACKEND = "inductor"  # tests count graphs with another


def decode_step(model, cfg):
    """The per-token forward: the model, or with --compile_decode its torch.compile, compiled once
    per model and reused while shapes repeat (compile_mode: with CUDA graphs or without)."""
    if not cfg.compile_decode:
        return model
    if model not in COMPILED_STEPS:
        mode, why = compile_mode(model, next(model.parameters()).device)
        stack.took("decode step", f"torch.compile mode {mode}", why)
        COMPILED_STEPS[model] = torch.compile(model, mode=mode, dynamic=False,
                                              backend=COMPILE_BACKEND)
    return COMPILED_STEPS[model]


def compile_mode(model, device):
    """CUDA graphs (mode reduce-overhead) where their static inputs stay put from one generation to
    the next: the weights of a model FSDP2 does not shard (updated in place) and the kept static
    caches (kv_cache). An FSDP2 model's weights are gathered anew into fresh storage at each
    generation (its reshard frees them for training), so CUDA graphs would re-record every time:
    compiled without them. watch_static_inputs counts what moved. -> (mode, why)"""
    if device.type != "cuda":
        return None, "no CUDA graphs off a GPU"
    if isinstance(model, FSDPModule):
        return None, "FSDP2 gathers the weights to new addresses each generation: no CUDA graphs"
    return "reduce-overhead", "CUDA graphs"


# --compile_decode: for each model and decode shape, the addresses of the step's static inputs (its
# weights, the static KV cache) at the last generation, and how many generations found them moved
STATIC_INPUTS = weakref.WeakKeyDictionary()  # model -> {shape: addresses}
STATIC_INPUTS_MOVED = [0]


def watch_static_inputs(model, cache, shape):
    """Count a generation whose static inputs sit elsewhere than the last one of the same shape:
    where CUDA graphs run, cudagraph trees would record them again."""
    addresses = [p.data_ptr() for p in model.parameters()] + [
        t.data_ptr() for layer in cache.layers if getattr(layer, "is_initialized", False)
        for t in (layer.keys, layer.values)]
    seen = STATIC_INPUTS.setdefault(model, {})
    if seen.get(tuple(shape), addresses) != addresses:
        STATIC_INPUTS_MOVED[0] += 1
    seen[tuple(shape)] = addresses


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
    record = RecordLogps(cfg.temperature or 1.0)  # 0: evaluation's greedy decode
    shipped_config = model.generation_config
    model.generation_config = GenerationConfig(
        do_sample=cfg.temperature > 0, max_new_tokens=cfg.max_completion_length, top_k=0,
        eos_token_id=eos_ids, pad_token_id=pad_id)
    try:
        processors = [SuppressTokensLogitsProcessor(suppress), record]
        processors += sampling_processors(cfg, inputs["input_ids"], eos_ids)
        if sampling_filter(cfg):  # the kept set's log-probs: recorded after the filters, at T
            record = RecordLogps(1.0)
            processors = processors[:1] + processors[2:] + [record]
        sequences = model.generate(**inputs, logits_processor=LogitsProcessorList(processors))
    finally:
        model.generation_config = shipped_config
    completion_ids = sequences[:, inputs["input_ids"].shape[1]:]  # [B, T]
    return completion_ids, record.logps(completion_ids)
