"""The training forward: log pi_T and entropy of the sampled tokens, as the loss and the KL see them
(paper §3), through a chunked head that never holds [b, T, V] logits. Its numbers must agree with
the sampler's (rollout.py records log softmax(logits / T) of the same tokens)."""
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rloo import token_logps_and_entropy


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
