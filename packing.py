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
PyTorch's varlen_attn (FlashAttention) where it fits, else causal SDPA per sequence; the kernel's
layout and arguments are checked on a CPU against that loop, the kernel itself not yet on a GPU."""
from contextlib import contextmanager
from dataclasses import dataclass
from inspect import signature

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import stack

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
    tokens."""
    input_ids: torch.Tensor  # [1, N]
    position_ids: torch.Tensor  # [1, N] 0..len_i - 1 for each sequence i
    cu_seqlens: torch.Tensor  # [b + 1] int32, where each sequence starts (and the row ends)
    max_length: int  # the longest sequence
    score_index: torch.Tensor  # [M] packed position whose hidden state predicts each target
    targets: torch.Tensor  # [M] the completion tokens, sequence by sequence
    completion_mask: torch.Tensor  # [b, T] where the M tokens go back to (True: a target)

    def attention_kwargs(self):
        """The keyword arguments the model passes down to its attention (flash-attention names)."""
        return {"cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": self.max_length, "max_length_k": self.max_length}


def pack(prompt_ids, prompt_mask, completion_ids, completion_mask):
    """Left-padded prompts [b, L] and right-padded completions [b, T] (masks 1 on real tokens) ->
    Packed: for each sequence its real prompt tokens, then its real completion tokens."""
    prompt_mask, completion_mask = prompt_mask.bool(), completion_mask.bool()
    mask = torch.cat([prompt_mask, completion_mask], 1)  # [b, L+T]
    input_ids = torch.cat([prompt_ids, completion_ids], 1)[mask]  # [N] row-major: in order
    lengths = mask.sum(-1)  # [b]
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)  # [b + 1]
    starts = cu_seqlens[:-1].long()
    position_ids = torch.arange(len(input_ids), device=input_ids.device) - \
        starts.repeat_interleave(lengths)  # [N] restarts at each sequence
    # completion token t of sequence i sits at starts_i + P_i + t and is predicted one before it
    prompt_lengths = prompt_mask.sum(-1)  # [b]
    completion_pos = completion_mask.long().cumsum(-1) - 1  # [b, T]
    packed_pos = starts[:, None] + prompt_lengths[:, None] + completion_pos  # [b, T]
    return Packed(input_ids[None], position_ids[None], cu_seqlens, int(lengths.max()),
                  packed_pos[completion_mask] - 1, completion_ids[completion_mask],
                  completion_mask)


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
    kernel, why = packed_kernel(query, dropout)
    stack.took("packed attention", kernel, why)
    if kernel == FLASH:
        return flash_varlen(query, key, value, cu_seq_lens_q, kwargs.get("max_length_q"),
                            scaling), None
    groups = query.shape[1] // key.shape[1]  # grouped-query attention: kv heads shared
    if groups > 1:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    lengths = cu_seq_lens_q.diff().tolist()  # note: a device-to-host sync, once per layer
    dtype = query.dtype
    if query.device.type == "cpu":
        # CPU bf16 SDPA compiles a kernel per new sequence length (5-35 ms each, measured, and a
        # packed row brings a new length per sequence); fp32 compiles none and is as fast here
        query, key, value = query.float(), key.float(), value.float()
    # split, not a slice per sequence: a slice's backward writes a zero [1, heads, N, d] gradient
    # each, so b sequences cost b times the row (split's backward is one concatenation)
    pieces = [F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling,
                                             is_causal=True)
              for q, k, v in zip(*(x.split(lengths, 2) for x in (query, key, value)))]
    return torch.cat(pieces, 2).to(dtype).transpose(1, 2).contiguous(), None


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
