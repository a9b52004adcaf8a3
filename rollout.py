"""Prompts -> completions. Backend: Hugging Face `generate` (CPU and GPU, plain or FSDP2-sharded model).

Besides the tokens, generation records the sampler's own per-token log-probs of the temperature-scaled
distribution, log softmax(logits / temperature)[o_t]. They are the "old" log-probs of the KL penalty
(SPEC §1.4), so the trainer needs no separate scoring pass before the update (SPEC §2).
"""

from contextlib import contextmanager

import torch
from torch.distributed.fsdp import FSDPModule
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


def is_conversational(prompt):
    """A conversational prompt is a list of {"role", "content"} messages; a standard one is a string."""
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def prompt_texts(tokenizer, prompts, chat_template_kwargs=None):
    """Conversational prompts get the chat template with add_generation_prompt=True; strings pass through."""
    return [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {}))
            if is_conversational(p) else p for p in prompts]


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


def sampling_processors(cfg, record):
    """Our own processor list, in order: record log pi_T (before any penalty or filter), then the sampling knobs.

    generate() runs with a fresh GenerationConfig in place of the model's, so it adds no processors of its own and a
    model's shipped generation_config (e.g. top_k=20, repetition_penalty=1.05) cannot silently change the sampling.
    """
    processors = [record]
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
    return LogitsProcessorList(processors)


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
def generate(model, tokenizer, prompts, cfg, device):
    """Sample cfg.num_generations completions for each prompt text, group members adjacent.

    Returns a dict of tensors (B = len(prompts) * G; L = longest prompt, T = longest completion):
      prompt_ids, prompt_mask [B, L] (left-padded), completion_ids [B, T] (right-padded after EOS),
      completion_mask [B, T] (1 up to and including the first EOS), truncated [B] (no EOS),
      sampler_logps [B, T] (log pi_T of each sampled token, 0 on padding),
    and completion_lists: the unpadded completion ids (EOS kept), what reward functions receive.
    """
    G = cfg.num_generations
    tokenizer.padding_side = "left"  # left-pad so every prompt ends where generation starts
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    prompt_ids = enc.input_ids.repeat_interleave(G, 0)  # [B, L]
    prompt_mask = enc.attention_mask.repeat_interleave(G, 0)  # [B, L]
    eos_ids = eos_token_ids(tokenizer, model)

    step_logps, last = [], {}

    def record(input_ids, scores):
        # Called once per new token with the raw next-token logits; input_ids[:, -1] is the token just sampled
        # from the previous call's distribution, so log-probs are gathered one call late (and once at the end).
        if "logps" in last:
            step_logps.append(last["logps"].gather(-1, input_ids[:, -1:]))
        last["logps"] = torch.log_softmax(scores.float() / cfg.temperature, dim=-1)  # [B, V]
        return scores

    shipped_config, was_training = model.generation_config, model.training
    model.generation_config = GenerationConfig(do_sample=True, max_new_tokens=cfg.max_completion_length, top_k=0,
                                               eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id)
    model.eval()
    try:
        with unsharded(model):
            sequences = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                                       logits_processor=sampling_processors(cfg, record))
    finally:
        model.generation_config = shipped_config
        model.train(was_training)
    completion_ids = sequences[:, prompt_ids.shape[1]:]  # [B, T]
    step_logps.append(last["logps"].gather(-1, completion_ids[:, -1:]))
    sampler_logps = torch.cat(step_logps, dim=1)  # [B, T]

    completion_ids, completion_mask, truncated = completion_masks(completion_ids, eos_ids, tokenizer.pad_token_id)
    lengths = completion_mask.sum(-1).tolist()
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask, truncated=truncated, sampler_logps=sampler_logps * completion_mask,
                completion_lists=[ids[:n] for ids, n in zip(completion_ids.tolist(), lengths)])
