"""The training forward: log pi_T and entropy of the sampled tokens, as the loss and the KL see them
(paper §3), through a chunked head that never holds [b, T, V] logits. Its numbers must agree with
the sampler's (rollout.py records log softmax(logits / T) of the same tokens)."""
import warnings
import weakref
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from packaging.version import Version
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint

from options import packing
from plumbing import distributed
from step.metrics import note_memory
from rloo import sampling_mask, token_logps_and_entropy


def micro_batches(batch_size, micro_size):
    return [slice(i, i + micro_size) for i in range(0, batch_size, micro_size)]


# the last batch's token-budget micro-batches by (rows, budget): its scoring, reference and policy
# passes share one all-reduce. Every rank makes the same calls in the same order with a batch of
# its own, so all ranks find an entry or all compute it (and meet in the all-reduce).
SPLITS = {"batch": lambda: None}


def training_micro_batches(batch, rows, micro_size, max_tokens=None):
    """The micro-batches of the training forwards over batch[rows] (a slice): slices of
    micro_size rows, or with max_tokens (--max_tokens_per_microbatch) index tensors of rows whose
    tokens, prompt and completion, fit in it; every rank runs as many as the rank with the most
    (FSDP2's collectives pair up across ranks, one set per micro-batch)."""
    if max_tokens is None:
        return [slice(s.start + rows.start, s.stop + rows.start)
                for s in micro_batches(rows.stop - rows.start, micro_size)]
    if SPLITS["batch"]() is not batch:  # a weak reference: the batch is not kept alive
        SPLITS.clear()
        SPLITS["batch"] = weakref.ref(batch)
    key = (rows.start, rows.stop, max_tokens)
    if key not in SPLITS:
        lengths = batch.prompt_mask[rows].sum(-1) + batch.completion_mask[rows].sum(-1)  # [n]
        groups = first_fit_decreasing(lengths.tolist(), max_tokens)
        most = {"max/groups": torch.tensor(float(len(groups)), device=lengths.device)}
        groups = split_into(groups, int(distributed.reduce_extremes(most)["max/groups"]))
        SPLITS[key] = [torch.tensor(sorted(group), device=lengths.device) + rows.start
                       for group in groups]
    return SPLITS[key]


def first_fit_decreasing(lengths, budget):
    """Indices of `lengths` in groups whose sums fit in budget (a longer one alone), longest
    first, each into the first group it fits. -> [[index, ...], ...]"""
    groups, loads = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = [g for g, load in enumerate(loads) if load + lengths[i] <= budget]
        if not fits:
            groups.append([])
            loads.append(0)
        g = fits[0] if fits else len(groups) - 1
        groups[g].append(i)
        loads[g] += lengths[i]
    return groups


def split_into(groups, count):
    """groups, the largest split until there are count (at most their number of indices)."""
    groups = [list(group) for group in groups]
    while len(groups) < count:
        largest = max(groups, key=len)
        groups.append([largest.pop()])  # the shortest of its sequences
    return groups


def forward_logps(model, batch, rows, temperature, chunked=None, router_aux=False, pad_to=None,
                  padding_free=False):
    """Per-token log pi_T and entropy of the completion tokens of batch[rows] (a Rollout), padding
    trimmed to these rows. Position ids follow the left padding (as in generate); the head runs on
    completion positions only, in chunks through LogpsHead (chunked=False: the model's own head, for
    models that transform their logits). Vision-language rows also pass their pixel inputs; models
    with multimodal rotary positions (Qwen2-VL's get_rope_index) derive the positions themselves.
    router_aux: also the MoE router's load-balancing loss (the model computes it from its router
    logits, padding excluded). pad_to: the sequence is padded on the right (masked) to a multiple
    of it, which changes no log-prob. padding_free: the rows packed into one (packed_logps).
    Rows that repeat another's prompt and completion tokens (a group's samples that agree) go
    through the model once (distinct_rows): the same numbers, and autograd sums each copy's
    gradient into the one forward's.
    -> logps [b, T], entropy [b, T], T, aux loss or None, boundary flips (scored)"""
    # not with pixel inputs (equal tokens, other images) nor a router loss (over every token)
    distinct = None if router_aux or batch.pixel_inputs is not None else distinct_rows(batch, rows)
    if distinct is not None:
        rows, copies = distinct
    if padding_free and batch.pixel_inputs is None:
        per_token, T, aux = packed_logps(model, batch, rows, temperature, chunked, router_aux)
    else:
        if padding_free:
            warnings.warn("--padding_free: vision-language rows (pixel inputs) cannot be packed; "
                          "their forward runs padded")
        per_token, T, aux = padded_logps(model, batch, rows, temperature, chunked, router_aux,
                                         pad_to)
    return scored(per_token if distinct is None else per_token[copies], T, aux)


def distinct_rows(batch, rows):
    """Where rows of batch[rows] (a slice or index tensor) repeat each other's prompt and
    completion tokens and masks: (the first row of each distinct sequence, in batch order, so a
    prompt's rows stay adjacent for packing's sharing [u]; each row's place among them [b]). None
    where all differ. Rows are told apart by a hash (a 1-D unique, 10x faster than unique over
    rows) and checked token by token, a collision falling back to the rows themselves. Host syncs
    on a GPU: one where all differ (the unique's size), three where some repeat (the token check,
    the first rows' selection), four after a collision."""
    index = torch.arange(len(batch.prompt_ids), device=batch.prompt_ids.device)[rows]  # [b]
    key = torch.cat([batch.prompt_ids[index], batch.prompt_mask[index].long(),
                     batch.completion_ids[index], batch.completion_mask[index].long()], -1)
    hashes, copies = torch.unique(row_hashes(key), return_inverse=True)  # [u], [b]
    if len(hashes) == len(index):  # distinct hashes: distinct rows
        return None
    order = torch.arange(len(index), device=index.device)

    def first_of(copies):  # [b]: the first row of each row's class
        return order.new_full((len(index),), len(index)).scatter_reduce(0, copies, order,
                                                                        "amin")[copies]

    first = first_of(copies)
    if bool((key != key[first]).any()):  # two different rows hashed alike
        first = first_of(torch.unique(key, dim=0, return_inverse=True)[1])
    is_first = torch.zeros(len(index), dtype=torch.bool, device=index.device)
    is_first[first] = True
    return index[is_first], (is_first.cumsum(0) - 1)[first]


def row_hashes(key):
    """[b, W] integer rows -> [b] int64: each column weighted by a fixed odd multiplier (int64
    products and sums wrap around), so equal rows hash alike and different ones rarely do."""
    odd = torch.arange(key.shape[1], device=key.device) * 2 + 1
    return (key * (odd * 2654435761)).sum(-1)  # Knuth's multiplicative hash constant


def padded_logps(model, batch, rows, temperature, chunked, router_aux, pad_to):
    """forward_logps's rows, left-padded prompts then right-padded completions: -> per-token
    [b, T, C] (LogpsHead.score), T, aux loss or None"""
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
    head = LogpsHead(completion_ids, temperature, batch.suppressed_ids, batch.sampling_filter)
    chunked = plain_head(model) if chunked is None else chunked
    if router_aux:
        pixel_inputs["output_router_logits"] = True
    with swapped_head(model, head) if chunked else nullcontext():
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    logits_to_keep=width + 1, use_cache=False, **pixel_inputs)
    logits = out.logits
    per_token = logits if chunked else head.score(logits[:, :-1], completion_ids)  # [b, T, 2]
    return per_token[:, :completion_len], completion_len, out.aux_loss if router_aux else None


def scored(per_token, T, aux):
    """[b, T, C] from LogpsHead.score -> logps, entropy, T, aux, flips ([b, T] 0/1, or None
    without --replay_sampling_mask). The memory in use is read into the open phases here, where a
    training forward holds the most: its activations, before backward frees them."""
    note_memory()
    flips = per_token[..., 2].detach() if per_token.shape[-1] == 3 else None
    return per_token[..., 0], per_token[..., 1], T, aux, flips


def packed_logps(model, batch, rows, temperature, chunked=None, router_aux=False):
    """forward_logps with no padding token in the model: batch[rows] packed into one row whose
    positions restart at each sequence, attention within each (options/packing.py); the head runs on
    the completion tokens' predicting positions only, given to the model as an index
    (logits_to_keep). -> padded_logps's, zero on padding. router_aux: the row has no padding, so the
    router's loss is over real tokens."""
    completion_mask = batch.completion_mask[rows]
    completion_len = int(completion_mask.sum(-1).max())
    # each prompt once for its completions where the attention runs per sequence (a CPU; the
    # GPU's FlashAttention varlen kernel has no such mask); not with a router loss, which would
    # count a shared prompt's tokens once instead of G times
    share = batch.prompt_ids.device.type != "cuda" and not router_aux
    packed = packing.pack(batch.prompt_ids[rows], batch.prompt_mask[rows],
                          batch.completion_ids[rows, :completion_len],
                          completion_mask[:, :completion_len],
                          packing.shared_prompt_costs(base_of(model)) if share else None)
    head = LogpsHead(packed.targets[None], temperature, batch.suppressed_ids,
                     batch.sampling_filter, packed=True)
    chunked = plain_head(model) if chunked is None else chunked
    extra = {"output_router_logits": True} if router_aux else {}
    with packing.packed_forward(base_of(model)), \
            swapped_head(model, head) if chunked else nullcontext():
        out = model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                    logits_to_keep=packed.score_index, use_cache=False,
                    **packed.attention_kwargs(), **extra)
    logits = out.logits[0]  # [M, 2] from LogpsHead, else [M, V]
    per_token = logits if chunked else head.score(logits, packed.targets)  # [M, 2]
    per_token = packing.unpack(per_token, packed)  # [b, T, 2]
    return per_token, completion_len, out.aux_loss if router_aux else None


# fp32 elements of one chunk's logits in LogpsHead on a CPU (16 MB); a GPU takes GPU_HEAD_SHARE of
# its memory (0.9 GB on an H200: 1,500 tokens at V = 152k). A chunk's backward holds about five
# [n, V] fp32 arrays at once (logits, exp, softmax, their product, the gradient; measured as RSS):
# the working set is 80 MB on a CPU, 1/32 of a GPU.
HEAD_CHUNK_ELEMENTS, GPU_HEAD_SHARE = 2**22, 1 / 160


def head_chunk_tokens(vocab_size, device_type, memory_bytes=None):
    """Tokens per LogpsHead chunk: as many as the budget holds fp32 logits of. memory_bytes: the
    GPU's (None: asked of the current device)."""
    if device_type != "cuda":
        return max(1, HEAD_CHUNK_ELEMENTS // vocab_size)
    memory_bytes = memory_bytes or torch.cuda.get_device_properties(0).total_memory
    return max(1, int(memory_bytes * GPU_HEAD_SHARE) // (4 * vocab_size))


class LogpsHead(torch.nn.Module):
    """Stands in for the LM head in a training forward: hidden states [b, T + 1, H] -> [b, T, 2],
    the log pi_T and entropy of each completion token, where the model expects logits. The b * T
    tokens go through the real head in chunks (head_chunk_tokens) and are recomputed in backward,
    so one chunk of logits is alive at most: b * T * V * 8 bytes less (40 GB at b=8, T=4096,
    V=152k). Image placeholders (suppressed) are never sampled, so they are not in the policy's
    distribution either (finite, for the entropy). packed: hidden [1, M, H] are already the
    positions that predict targets [1, M] (a packed row's, selected by logits_to_keep).
    replayed: {filter: value} of --replay_sampling_mask, the kept set recomputed per chunk
    from the chunk's logits (rloo.sampling_mask), so log pi_T is the truncated distribution's; a
    third channel flags the targets that set dropped (score)."""

    def __init__(self, targets, temperature, suppressed=None, replayed=None, packed=False):
        super().__init__()
        self.targets, self.temperature, self.suppressed = targets, temperature, suppressed
        self.replayed = replayed
        self.packed, self.lm_head = packed, None

    def forward(self, hidden):
        b, T = self.targets.shape
        if not self.packed:
            hidden = hidden[:, :-1]  # position t predicts targets[:, t]
        # [b * T, C] -> [b, T, C], copied (C = 2 or 3 a token): FSDP2 warns when its root returns
        # a view (an in-place op on one would skip its pre-backward hook)
        return self.rows(hidden.reshape(b * T, -1), self.targets.reshape(b * T)).view(b, T, -1) \
            .clone()

    def rows(self, hidden, targets):
        head = self.lm_head
        tokens = head_chunk_tokens(head.weight.shape[0], hidden.device.type)
        if isinstance(head, torch.nn.Linear) and head.bias is None and \
                not hasattr(head.weight, "quant_state"):  # a plain weight (not 4-bit): F.linear
            # ChunkedHead as the head's forward for this one call: its hooks (an FSDP2 unit of its
            # own under --cast_lm_head_to_fp32: gather, fp32 input) run once, not once per chunk
            head.forward = lambda x: ChunkedHead.apply(x, head.weight, targets, tokens, self.score)
            try:
                return head(hidden)
            finally:
                del head.forward
        # a head with adapters (LoRA, 4-bit): called per chunk
        pieces = []
        for rows in micro_batches(len(hidden), tokens):
            args = (hidden[rows], targets[rows])
            pieces.append(checkpoint(self.chunk, *args, use_reentrant=False)
                          if torch.is_grad_enabled() else self.chunk(*args))
        return torch.cat(pieces)

    def chunk(self, hidden, targets):
        return self.score(self.lm_head(hidden), targets)

    def score(self, logits, targets, entropy=True):
        """logits [b, t, V] or [n, V] -> [b, t, C] or [n, C] (log pi_T, entropy) of the targets;
        replayed: C = 3, the third 1 where the kept set dropped the target (a boundary flip).
        entropy=False: zeros in its place (it carries no gradient)."""
        if self.suppressed is not None:
            logits = logits.index_fill(-1, self.suppressed, -1e30)
        if logits.dim() == 2:
            return self.score(logits[None], targets[None], entropy)[0]
        if self.replayed is None:
            return torch.stack(token_logps_and_entropy(logits, targets, self.temperature,
                                                       entropy=entropy), -1)
        # z / T over the kept set; -1e30, not -inf: a finite entropy
        logits = logits.float() / self.temperature
        with torch.no_grad():
            kept = sampling_mask(logits, **self.replayed)  # [b, t, V], one chunk's
            # a token the sampler kept at the boundary that these logits drop (other kernels,
            # bf16, older weights: a boundary flip) stays in: its log-prob is then of a
            # slightly larger set, not -1e30; the third channel counts them
            flipped = ~kept.gather(-1, targets[..., None])
            kept.scatter_(-1, targets[..., None], True)
        logits = logits.masked_fill(~kept, -1e30)
        return torch.stack([*token_logps_and_entropy(logits, targets, 1.0, entropy=entropy),
                            flipped[..., 0]], -1)


class ChunkedHead(torch.autograd.Function):
    """score(hidden @ weight.T, targets) over chunks of `tokens` rows, keeping no logits: backward
    recomputes each chunk's log-probs (not the entropy: a metric, no gradient) and sums the
    weight's gradient in fp32, rounded to its dtype once (a bf16 sum over hundreds of chunks
    doubled the gradient's error). hidden [n, H], weight [V, H]."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, tokens, score):
        ctx.save_for_backward(hidden, weight, targets)
        ctx.tokens, ctx.score = tokens, score
        return torch.cat([score(F.linear(hidden[rows], weight), targets[rows])
                          for rows in micro_batches(len(hidden), tokens)])

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        # a frozen head (LoRA) gets no [V, H] gradient at all; a trained one a single fp32 sum
        trained = ctx.needs_input_grad[1]
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if trained else None
        for rows in micro_batches(len(hidden), ctx.tokens):
            logits = F.linear(hidden[rows], weight).requires_grad_()  # [n, V], no graph behind
            with torch.enable_grad():
                out = ctx.score(logits, targets[rows], entropy=False)  # no gradient through it
                (grad_logits,) = torch.autograd.grad(out, logits, grad_out[rows])
            grad_hidden[rows] = grad_logits @ weight  # d/dh of h W^T
            if trained:  # d/dW of h W^T, summed into fp32 without a [V, H] temporary per chunk
                add_weight_grad(grad_weight, grad_logits.T, hidden[rows])
        grad_weight = grad_weight.to(weight.dtype) if trained else None
        return grad_hidden, grad_weight, None, None, None


# Where the head's gradient sums bf16/fp16 factors into its fp32 buffer in one GEMM on tensor
# cores: CUDA's addmm with out_dtype (torch 2.8) into an fp32 `self` (from 2.10,
# pytorch/pytorch#167931). The CPU has no such kernel; fp32 copies of the factors on a GPU ran the
# largest GEMM of the backward without tensor cores, under the run's IEEE fp32 matmuls.
FP32_OUT_DEVICES = ("cuda",) if Version(torch.__version__).release >= (2, 10) else ()


def add_weight_grad(grad_weight, grad_logits_t, hidden):
    """grad_weight [V, H] fp32 += grad_logits_t [V, n] @ hidden [n, H], the same fp32 sum on every
    device: from the bf16/fp16 factors themselves where the device sums them into fp32
    (FP32_OUT_DEVICES), else from fp32 copies of them."""
    low = hidden.dtype in (torch.bfloat16, torch.float16) and grad_logits_t.dtype == hidden.dtype
    if low and grad_weight.device.type in FP32_OUT_DEVICES:
        torch.addmm(grad_weight, grad_logits_t, hidden, out_dtype=torch.float32, out=grad_weight)
    else:
        grad_weight.addmm_(grad_logits_t.float(), hidden.float())


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
    per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    for rows in micro_batches(len(logps), per_step):  # update()'s mini-batches
        for mb in training_micro_batches(batch, rows, cfg.per_device_train_batch_size,
                                         cfg.max_tokens_per_microbatch):
            mb_logps, _, T, *_ = forward_logps(model, batch, mb, cfg.temperature,
                                              pad_to=cfg.pad_to_multiple_of,
                                              padding_free=cfg.padding_free)
            logps[mb, :T] = mb_logps
    model.train(was_training)
    released(model)
    return logps


def released(model):
    """After a no-grad pass: FSDP2 keeps the root's weights gathered after forward for a backward,
    and none follows; gathered, they stayed so into the checkpoint (a LoRA modules_to_save head
    lost its key)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
