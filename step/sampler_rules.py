"""Which log-probs the sampler reports: the one rule both generators and the trainer follow, and
what the trainer makes of the difference (the KL's old log-probs, the importance weights).

The trainer scores log pi_T = log_softmax(z / T) (or, with --replay_sampling_mask, the truncated
distribution top-k/top-p/min-p sampled from); a generator's own log-probs stand in for a forward
only where they are that quantity (sampler_logps_exact). And the precision the weights are kept
in, which decides whether two kernels give the same log-probs.
"""

from plumbing.domains import GENERATION_KWARGS
from rloo import importance_weights, off_policy_mask

# The logit filters, each a flag of plumbing/config.py, in the order both generators apply them
# (rloo.sampling_mask, vLLM's sampler): flag -> (its value when off, vLLM's SamplingParams value
# when off; None: vLLM has no such filter, and --use_vllm refuses it). Everything else derives.
FILTERS = {"min_p": (None, 0.0), "top_k": (0, 0), "top_p": (1.0, 1.0)}


def active_filters(cfg):
    """{flag: value} of the filters cfg sets, in FILTERS' order (None, and vLLM's off value such
    as --min_p 0, are off too)."""
    values = {f: getattr(cfg, f) for f in FILTERS}
    return {f: v for f, v in values.items() if v is not None and v not in FILTERS[f]}


def vllm_filters(cfg):
    """Every filter vLLM has, as SamplingParams fields: the off ones too, so a server's defaults
    (a model's generation_config) cannot add a filter."""
    active = active_filters(cfg)
    return {f: active.get(f, vllm_off) for f, (_, vllm_off) in FILTERS.items()
            if vllm_off is not None}


def vllm_logprobs_mode(cfg, vision=False):
    """raw_logprobs (log_softmax of the raw logits) is log pi_T at T = 1 whatever the penalty and
    filters; otherwise processed_logprobs, log pi_T when neither is set. A VLM's placeholder
    suppression is a logit bias that only processed_logprobs include."""
    if replays_filters(cfg):  # the kept set, renormalised: what top-k/top-p/min-p sampled from
        return "processed_logprobs"
    return "raw_logprobs" if cfg.temperature == 1.0 and not vision else "processed_logprobs"


def replays_filters(cfg):
    """--replay_sampling_mask with a filter to replay: log-probs are of the truncated
    distribution (rloo.sampling_mask)."""
    return bool(cfg.replay_sampling_mask and active_filters(cfg))


def sampling_filter(cfg):
    """{flag: value} of the filters the training forward replays (rloo.sampling_mask), or None."""
    return active_filters(cfg) if replays_filters(cfg) else None


def sampler_logps_exact(cfg, vision=False):
    """Whether the generator reports log pi_T = log_softmax(z / T), the trainer's log-probs.

    Our decode loop always does. vLLM's `processed_logprobs` come after the repetition penalty and
    top-k/top-p/min-p (renormalised over the kept tokens: a KL biased by -log(kept mass) per token)
    and `raw_logprobs` at temperature 1, so vLLM's are used only where they are that quantity: with
    no penalty and no filter, or raw ones from a colocated text engine (a server runs its own mode).
    """
    if not cfg.use_vllm:
        return True
    # replayed filters: processed log-probs are the kept set's, which the trainer scores too
    filtered = bool(active_filters(cfg)) and not replays_filters(cfg)
    plain = not filtered and not logit_shapers(cfg)
    # guided decoding masks the logits before vLLM's sampler sees them: raw ones too
    raw = (cfg.vllm_mode == "colocate" and vllm_logprobs_mode(cfg, vision) == "raw_logprobs"
           and not cfg.vllm_structured_outputs_regex)
    return plain or raw


def logit_shapers(cfg):
    """The flags, besides temperature and the filters, that change the logits the sampler draws
    from (and vLLM's processed log-probs are taken from): every --generation_kwargs option but
    extra stop ids, the repetition penalty, a structured-outputs regex."""
    extra = cfg.generation_kwargs if isinstance(cfg.generation_kwargs, dict) else {}
    shaped = [k for k in GENERATION_KWARGS if k != "stop_token_ids" and extra.get(k)]
    shaped += ["repetition_penalty"] if cfg.repetition_penalty != 1.0 else []
    return shaped + (["vllm_structured_outputs_regex"] if cfg.vllm_structured_outputs_regex else [])


def weights_dtype(cfg):
    """The dtype the weights are kept in: --model_init_kwargs' dtype (a name such as "bfloat16"),
    else float32."""
    return str((cfg.model_init_kwargs or {}).get("dtype", "float32")).removeprefix("torch.")


def low_precision(cfg):
    """bf16 compute or weights kept below fp32: kernels of another batch shape give other
    log-probs."""
    return cfg.bf16 or cfg.load_in_4bit or weights_dtype(cfg) != "float32"


def old_logps_from_sampler(cfg, vision=False):
    """Whether the KL's log pi_old can be the sampler's own log-probs: where they are exactly the
    trainer's (sampler_rules.sampler_logps_exact) and in fp32. In bf16 the sampler's and the
    trainer's kernels differ (0.03-0.05 nats per token on SmolLM2-135M), and an async batch's are
    of older weights: a no-grad forward of the policy computes them (TRL's scoring pass)."""
    return sampler_logps_exact(cfg, vision) and not low_precision(cfg) and not cfg.async_generation


def sampler_weights(cfg, seq_old, sampled, logps, mask, advantages, sampling):
    """The loss weights [b] of completions the generator drew, None where no flag asks for any:
    TRL's sequence-level importance weight (docs/vllm.md 'vLLM generation'), times DeepSeek-V3.2's
    off-policy mask. The sequences each truncates, masks or drops go into sampling (metrics)."""
    weights = None
    if cfg.vllm_importance_sampling_correction:  # the generator's log-probs are not the trainer's
        mode = cfg.vllm_importance_sampling_mode
        weights, outside = importance_weights(  # [b] from pi_old / pi_sampler
            seq_old, (sampled * mask).sum(-1), mode, cfg.vllm_importance_sampling_clip_min,
            cfg.vllm_importance_sampling_clip_max)
        sampling["is_weight"].append(weights)
        sampling["is_truncated" if mode == "sequence_truncate" else "is_masked"].append(outside)
    if cfg.off_policy_mask_threshold is not None:  # eq. 9: A < 0 and far from the sampler
        keep = off_policy_mask(advantages, sampled, logps, mask, cfg.off_policy_mask_threshold)
        weights = keep.float() if weights is None else weights * keep
        sampling["off_policy_masked"].append(~keep)
    return weights
