"""Padding-free training (--padding_free): the sequences of a micro-batch, prompt and completion
without their padding, packed into one row [1, N] whose position ids restart at each sequence, and
an attention that never crosses a boundary. No padding token goes through the model; the log-probs
come back as the padded forward's [b, T].

The attention is a varlen one, registered with transformers under VARLEN: per-sequence causal SDPA
over the cumulative sequence lengths cu_seqlens [b + 1]. (transformers' own packed-sequence
detection for SDPA builds a dense [1, 1, N, N] mask and computes all N^2 scores: slower than the
padded batch.) On a GPU, the same keyword arguments (cu_seq_lens_q/k, max_length_q/k) are those
transformers' flash_attention_2 integration takes for flash_attn_varlen_func (a test checks the
names against its _flash_attention_forward, and the int32 offsets the kernel needs). VARLEN calls
PyTorch's varlen_attn (FlashAttention) where it fits, else causal SDPA per sequence, the sequences
padded into a few groups of similar length, one call a group (unit_groups); the kernel's layout and
arguments are checked on a CPU against that path, the kernel itself not yet on a GPU.

Where the attention runs per sequence (a CPU), the G completions of a prompt share it: the row holds
the prompt once, then its completions, each attending to the prompt and to itself (a mask per
unit), at the positions it would have alone. The same log-probs for G - 1 fewer prompts' work in
every layer, where that outweighs the masked unit's attention (shared_units)."""
import functools
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from inspect import signature

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from plumbing import stack

try:  # PyTorch's own FlashAttention varlen kernel (CUDA, fp16/bf16; no flash-attn package)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10
    varlen_attn = None
# its keywords by release: causal as is_causal (2.10) or window_size (2.11+); grouped-query heads
# shared by the kernel from 2.12 (enable_gqa), repeated here before
VARLEN_ARGS = set(signature(varlen_attn).parameters) if varlen_attn else set()

VARLEN = "rloo_varlen_sdpa"


@dataclass
class Packed:
    """One micro-batch packed into a row; N = the sum of its sequence lengths, M = its completion
    tokens. With shared prompts a unit is a prompt and the completions that follow it."""
    input_ids: torch.Tensor  # [1, N]
    position_ids: torch.Tensor  # [1, N] 0..len_i - 1 for each sequence i
    cu_seqlens: torch.Tensor  # [u + 1] int32, where each unit starts (and the row ends)
    max_length: int  # the longest unit
    score_index: torch.Tensor  # [M] packed position whose hidden state predicts each target
    targets: torch.Tensor  # [M] the completion tokens, sequence by sequence
    completion_mask: torch.Tensor  # [b, T] where the M tokens go back to (True: a target)
    layouts: tuple | None = None  # each unit's (prompt, completion, ...) lengths, when shared

    def attention_kwargs(self):
        """The keyword arguments the model passes down to its attention (flash-attention names;
        rloo_layouts: the units whose completions share their prompt, for varlen_attention)."""
        shared = {"rloo_layouts": self.layouts} if self.layouts else {}
        return {"cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": self.max_length, "max_length_k": self.max_length, **shared}


def pack(prompt_ids, prompt_mask, completion_ids, completion_mask, costs=None):
    """Left-padded prompts [b, L] and right-padded completions [b, T] (masks 1 on real tokens) ->
    Packed: for each sequence its real prompt tokens, then its real completion tokens. costs
    (shared_prompt_costs; None: no sharing): rows that repeat the row before's prompt (the G
    completions of a prompt are adjacent) follow it without it, where that saves work: the prompt
    is in the row once, each completion attends to it and to itself (varlen_attention) at the
    positions it has alone. The same numbers, for G - 1 fewer prompts' work."""
    prompt_mask, completion_mask = prompt_mask.bool(), completion_mask.bool()
    b, L = prompt_mask.shape
    prompt_lengths, completion_lengths = prompt_mask.sum(-1), completion_mask.sum(-1)  # [b]
    first, layouts = torch.ones(b, dtype=torch.bool, device=prompt_ids.device), None  # [b]
    if costs is not None and b > 1:
        first, layouts = shared_units(prompt_ids, prompt_mask, prompt_lengths,
                                      completion_lengths, costs)
    mask = torch.cat([prompt_mask & first[:, None], completion_mask], 1)  # [b, L+T] kept tokens
    input_ids = torch.cat([prompt_ids, completion_ids], 1)[mask]  # [N] row-major: in order
    lengths = mask.sum(-1)  # [b] tokens each row adds
    starts = F.pad(lengths.cumsum(0), (1, 0))[:-1]  # [b]
    unit = first.long().cumsum(0) - 1  # [b] each row's unit
    # positions: a prompt's 0..P-1, its completion's P.. (each completion as if alone)
    grid = torch.cat([torch.arange(L, device=mask.device) - (L - prompt_lengths[:, None]),
                      prompt_lengths[:, None] + torch.arange(completion_mask.shape[1],
                                                             device=mask.device)], 1)
    # completion token t of row i sits at starts_i + (its prompt, if it has it) + t and is
    # predicted one before it; its first token by the prompt's last, at the unit's start + P - 1
    completion_pos = completion_mask.long().cumsum(-1) - 1  # [b, T]
    predictor = (starts + prompt_lengths * first)[:, None] + completion_pos - 1  # [b, T]
    predictor[:, 0] = starts[first][unit] + prompt_lengths - 1
    unit_lengths = torch.zeros(int(first.sum()), dtype=lengths.dtype,
                               device=lengths.device).index_add_(0, unit, lengths)  # [u]
    cu_seqlens = F.pad(unit_lengths.cumsum(0), (1, 0)).to(torch.int32)  # [u + 1]
    return Packed(input_ids[None], grid[mask][None], cu_seqlens, int(unit_lengths.max()),
                  predictor[completion_mask], completion_ids[completion_mask], completion_mask,
                  layouts)


def shared_units(prompt_ids, prompt_mask, prompt_lengths, completion_lengths, costs):
    """Which rows start a unit ([b] bool; the others follow the row before without its prompt),
    and each unit's layout: (P, T_1, ..., T_k) with its prompt shared, (P + T,) alone. A run of
    rows with one prompt shares it where the k - 1 prompts saved cost more than the attention
    its mask adds (the unit's n^2 scores, against the sequences' causal halves): costs = (FLOPs a
    token, FLOPs a query-key pair)."""
    same = ((prompt_ids[1:] == prompt_ids[:-1]) | ~prompt_mask[1:]).all(-1) & \
        (prompt_mask[1:] == prompt_mask[:-1]).all(-1)  # [b - 1]
    runs = [[0]]
    for i, repeats in enumerate(same.tolist(), 1):  # one host copy each
        runs[-1].append(i) if repeats else runs.append([i])
    P, T = prompt_lengths.tolist(), completion_lengths.tolist()
    token, pair = costs
    first, layouts = [], []
    for run in runs:
        p, ts = P[run[0]], [T[i] for i in run]
        n, alone = p + sum(ts), sum((p + t) ** 2 for t in ts) / 2
        if len(run) > 1 and (len(run) - 1) * p * token > (n * n - alone) * pair:
            first += [True] + [False] * (len(run) - 1)
            layouts.append((p, *ts))
        else:
            first += [True] * len(run)
            layouts += [(p + t,) for t in ts]
    if all(first):
        return torch.ones(len(first), dtype=torch.bool, device=prompt_ids.device), None
    return torch.tensor(first, device=prompt_ids.device), tuple(layouts)


def shared_prompt_costs(model):
    """(FLOPs a token, FLOPs a query-key pair) of a forward, the weights of shared_units' choice:
    2 per weight outside the embeddings; 4 per head dimension, head and layer (scores and their
    weighted sum). Counted once a model."""
    if model not in COSTS:
        COSTS[model] = forward_costs(model)
    return COSTS[model]


COSTS = weakref.WeakKeyDictionary()


def forward_costs(model):
    config = model.config.get_text_config()
    heads, layers = config.num_attention_heads, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    embeddings = sum(p.numel() for m in (model.get_input_embeddings(),) for p in m.parameters())
    weights = sum(p.numel() for p in model.parameters()) - embeddings
    return 2 * weights, 4 * head_dim * heads * layers


def unpack(per_token, packed):
    """[M, ...] per completion token -> [b, T, ...] in the padded layout, zero on padding."""
    out = per_token.new_zeros(*packed.completion_mask.shape, *per_token.shape[1:])
    out[packed.completion_mask] = per_token
    return out


# id(config) -> the attention implementation VARLEN stands in front of ("sdpa"): rows that are
# not packed (generation, the padded forward) go to it unchanged. A copy of a packed model
# (copy.deepcopy) has a config of its own, not here: it gets sdpa
BASE = {}
# True while a packed row goes through the model: its mask function returns no mask
PACKED_FORWARD = [False]


def varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     cu_seq_lens_q=None, **kwargs):
    """Causal SDPA within each packed sequence. query [1, heads, N, d], key/value [1, kv_heads, N,
    d] -> ([1, N, heads, d], None), as transformers' attention functions return. The packed row
    is recognised by its cu_seq_lens_q, an argument of the layer's call, so a layer recomputed
    in backward (gradient checkpointing) takes the same path."""
    if cu_seq_lens_q is None:
        base = ALL_ATTENTION_FUNCTIONS[BASE.get(id(module.config), "sdpa")]
        return base(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                    **kwargs)
    unsupported = [name for name in ("sliding_window", "softcap", "s_aux") if kwargs.get(name)]
    if unsupported:
        raise ValueError(f"--padding_free: this model's attention uses {unsupported}, which the "
                         "packed attention does not implement; run without --padding_free")
    layouts = kwargs.get("rloo_layouts")  # prompts shared: masks FlashAttention's kernel lacks
    kernel, why = (PER_SEQUENCE, "prompts shared") if layouts else packed_kernel(query, dropout)
    stack.took("packed attention", kernel, why)
    if kernel == FLASH:
        return flash_varlen(query, key, value, cu_seq_lens_q, kwargs.get("max_length_q"),
                            scaling), None
    repeats = query.shape[1] // key.shape[1]  # grouped-query attention: kv heads shared
    if repeats > 1:
        key, value = key.repeat_interleave(repeats, 1), value.repeat_interleave(repeats, 1)
    lengths = cu_seq_lens_q.diff().tolist()  # note: a device-to-host sync, once per layer
    dtype = query.dtype
    if query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16):
        # CPU bf16 SDPA compiles a kernel per new sequence length (5-35 ms each, measured, and a
        # packed row brings a new length per sequence); fp32 compiles none and is as fast here
        query, key, value = query.float(), key.float(), value.float()
    index, groups, inverse = unit_groups(tuple(layouts or ((n,) for n in lengths)),
                                         query.shape[1] * query.shape[3], query.device)
    # one gather a tensor and one back, of whole tokens ([N, heads, d] rows), each the other's
    # backward (Regather): backward writes the row a few times, not once a unit
    sizes = [units * m for _, (units, m) in groups]
    parts = [Regather.apply(x[0].transpose(0, 1), index, inverse).split(sizes)
             for x in (query, key, value)]
    pieces = []
    for (mask, shape), q, k, v in zip(groups, *parts):  # mask [units, 1, m, m], shape (units, m)
        q, k, v = (x.unflatten(0, shape).transpose(1, 2) for x in (q, k, v))  # [units, heads, m, d]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                  scale=scaling, is_causal=mask is None)
        pieces.append(attended.transpose(1, 2).flatten(0, 1))  # [units * m, heads, d]
    out = Regather.apply(torch.cat(pieces), inverse, index)  # [N, heads, d]: back in row order
    return out.to(dtype)[None], None


class Regather(torch.autograd.Function):
    """x.index_select(0, index), whose backward is the gradient's index_select(0, back): exact
    where index and back are each other's inverse on the row's tokens. A padding slot (a copy of
    token 0) is read by no real query (unit_groups' masks) and its gradient is dropped: no zero
    row and scatter-add per tensor, which index_select's own backward costs."""

    @staticmethod
    def forward(ctx, x, index, back):
        ctx.save_for_backward(back)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.saved_tensors[0]), None, None


# What an SDPA call costs beyond its arithmetic, as the FLOPs of scores it could compute instead:
# about 40 us of this project's CPU (2 threads), each call and its backward, on the embedded
# model's units. A unit joins the group of a longer one where its padding costs less.
CALL_FLOPS = 3e6


@functools.lru_cache(maxsize=8)
def unit_groups(layouts, width, device):
    """Units (their layouts, in row order) padded into groups of one length, one SDPA call a
    group: a unit joins the group of the longest unit not yet placed (m tokens) where the scores
    its padding adds, 4 * width * (m^2 - n^2) FLOPs (width: heads * head dim), cost less than a
    call (CALL_FLOPS). Small units, whose calls cost more than their attention, go in few calls;
    large ones pad only where they are nearly as long. A unit's layout: (n,) a plain sequence,
    causal; (P, T_1, ..., T_k) a prompt of P tokens and its completions, each token attending
    causally to its prompt and its own completion. -> the groups' tokens as indices into the
    row [sum of units * m], the groups [(mask [units, 1, m, m], or None where causal suffices:
    plain sequences of one length; (units, m))], and each row token's place in the groups'
    tokens [N]. A padding slot repeats token 0 and attends to itself alone: no real query reads
    it, and its output (dropped) reaches no real token's gradient (Regather). Built once a batch:
    every layer and pass of one micro-batch has the same layouts."""
    lengths = [sum(layout) for layout in layouts]
    n = torch.tensor(lengths)  # [u]
    starts = n.cumsum(0) - n
    # each token's segment in its unit: 0 the prompt (or a plain sequence), j its j-th completion
    segment = torch.tensor([j for layout in layouts for j, part in enumerate(layout)
                            for _ in range(part)])  # [N]
    order = sorted(range(len(layouts)), key=lambda i: -lengths[i])
    indices, groups, inverse, placed = [], [], torch.empty(len(segment), dtype=torch.long), 0
    while order:
        m = lengths[order[0]]
        units = [i for i in order if 4 * width * (m * m - lengths[i] ** 2) <= CALL_FLOPS]
        order = order[len(units):]
        position = torch.arange(m)
        real = position < n[units, None]  # [g, m]
        index = torch.where(real, starts[units, None] + position, 0)  # [g, m] padding: token 0
        inverse[index[real]] = (placed + torch.arange(len(units) * m)).view(-1, m)[real]
        placed += len(units) * m
        indices.append(index.flatten())
        if all(len(layouts[i]) == 1 for i in units) and real.all():  # causal suffices
            groups.append((None, (len(units), m)))
            continue
        seg = torch.where(real, segment[index], -1)  # [g, m]
        mask = (seg[:, None] == 0) | (seg[:, None] == seg[:, :, None])  # [g, query, key]
        mask &= real[:, None] & real[:, :, None] & torch.ones(m, m, dtype=torch.bool).tril()
        mask |= torch.eye(m, dtype=torch.bool) & ~real[:, :, None]  # padding: itself alone
        groups.append((mask[:, None].to(device), (len(units), m)))
    return torch.cat(indices).to(device), groups, inverse.to(device)


FLASH, PER_SEQUENCE = "FlashAttention varlen", "causal SDPA per sequence"


def packed_kernel(query, dropout):
    """Which kernel attends a packed row, and why: FlashAttention's varlen kernel takes fp16/bf16
    on an Ampere or later GPU, without dropout; elsewhere SDPA runs per sequence."""
    if varlen_attn is None:
        return PER_SEQUENCE, f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if not query.is_cuda:
        return PER_SEQUENCE, "CPU"
    if dropout or query.dtype not in (torch.float16, torch.bfloat16):
        return PER_SEQUENCE, "dropout" if dropout else f"{query.dtype} (FlashAttention: fp16/bf16)"
    major, minor = torch.cuda.get_device_capability(query.device)
    if major < 8:
        return PER_SEQUENCE, f"GPU compute capability {major}.{minor} (FlashAttention: 8.0+)"
    return FLASH, f"torch {torch.__version__}'s varlen_attn"


def flash_varlen(query, key, value, cu_seqlens, max_length, scaling):
    """The packed row in one kernel call: no loop over sequences, no device-to-host sync (the
    longest length comes from pack(), on the host). [1, heads, N, d] -> [1, N, heads, d]; the
    kernel's layout is [N, heads, d]. torch 2.15 prefers cuDNN's varlen kernel where eligible:
    FlashAttention is pinned, so that the kernel named at start-up is the one that runs."""
    if max_length is None:
        max_length = int(cu_seqlens.diff().max())
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    options = {"window_size": (-1, 0)} if "window_size" in VARLEN_ARGS else {"is_causal": True}
    if k.shape[1] != q.shape[1]:  # grouped-query attention: the kernel shares kv heads, or we do
        if "enable_gqa" in VARLEN_ARGS:
            options["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_length, max_length, scale=scaling,
                          **options)
    return out[None]


def varlen_mask(config=None, **kwargs):
    """A packed row's attention mask: none (the boundaries are in cu_seqlens); others' the base
    implementation's."""
    if PACKED_FORWARD[0]:
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS[BASE.get(id(config), "sdpa")](config=config, **kwargs)


AttentionInterface.register(VARLEN, varlen_attention)
AttentionMaskInterface.register(VARLEN, varlen_mask)


def check_packable(config):
    """Recurrent layers (linear attention, Mamba) carry state along the row, across sequences."""
    kinds = set(getattr(config.get_text_config(), "layer_types", None) or [])
    if kinds - {"full_attention", "sliding_attention"}:
        raise ValueError(f"--padding_free: this model has {sorted(kinds)} layers; recurrent ones "
                         "would carry state from one packed sequence into the next; drop the flag")


def choose_padding_free(cfg, model, vision, device):
    """--padding_free unset: packed rows where they give the padded forward's numbers and are the
    faster (a CPU: 1.2-2.6x in the training phase, less memory, docs/benchmark.md), else padded;
    said once either way."""
    if cfg.padding_free is not None:
        stack.took("training rows", "packed" if cfg.padding_free else "padded",
                   f"--padding_free {str(cfg.padding_free).lower()}")
        return
    why = unpackable(model.config, vision, cfg.pad_to_multiple_of) or (
        "a GPU: FlashAttention's varlen kernel is not measured on one yet (gpu_check.py's "
        "packed variant)" if device.type == "cuda" else None)
    cfg.padding_free = why is None
    stack.took("training rows", "packed" if why is None else "padded",
               f"--padding_free unset: {why or 'a CPU, and the model allows it'}; "
               "--padding_free true/false overrides")


def unpackable(config, vision, pad_to):
    """Why a run's rows cannot be packed (None: they can): images, rounded lengths, or a model
    whose attention the packed one does not implement (recurrent or sliding-window layers,
    softcapping, an implementation other than sdpa)."""
    text = config.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or [])
    sliding = getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
    attention = config._attn_implementation
    reasons = [(vision, "vision-language rows"), (pad_to, "--pad_to_multiple_of"),
               (kinds - {"full_attention"}, f"{sorted(kinds)} layers"),
               (sliding, "sliding-window attention"),
               (getattr(text, "attn_logit_softcapping", None), "attention softcapping"),
               (attention not in ("sdpa", VARLEN), f"attn_implementation {attention}")]
    return next((why for flagged, why in reasons if flagged), None)


def text_configs(model):
    """The configs whose _attn_implementation the model's attention layers read."""
    configs = [model.config]
    text = model.config.get_text_config()
    return configs + [text] if text is not model.config else configs


@contextmanager
def packed_forward(model):
    """One forward of a packed row. The model's attention becomes VARLEN from the first one on and
    stays so (a layer recomputed in backward reads it after this forward), in front of its own
    implementation, which every row that is not packed still gets."""
    check_packable(model.config)
    for config in text_configs(model):
        if config._attn_implementation != VARLEN:
            base = config._attn_implementation
            if base not in ALL_ATTENTION_FUNCTIONS or base not in ALL_MASK_ATTENTION_FUNCTIONS:
                raise ValueError(f"--padding_free needs attn_implementation sdpa (or flash); this "
                                 f"model has {base}: set it in --model_init_kwargs")
            BASE[id(config)] = base
            config._attn_implementation = VARLEN
    PACKED_FORWARD[0] = True
    try:
        yield
    finally:
        PACKED_FORWARD[0] = False
