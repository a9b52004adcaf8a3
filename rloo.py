"""RLOO math: pure functions on tensors. No I/O, no distributed calls, no models.

Notation: B completions, T completion tokens, V vocabulary, G completions per prompt.
Paper: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
from Human Feedback in LLMs", §3 (RLOO estimator, sequence-level KL-shaped reward).
"""

import math

import torch

# exp(20) ~ 5e8: large enough never to bind on sane data, small enough never to overflow
LOG_RATIO_CLAMP = 20.0


def token_logps_and_entropy(logits, token_ids, temperature=1.0, chunk_elements=2**24,
                            entropy=True):
    """Per-token log pi(o_t) and entropy of softmax(logits / temperature).

    logits [B, T, V] (position t predicts token_ids[:, t]), token_ids [B, T]
        -> logps [B, T], entropy [B, T].
    log p = logit[o_t] - logsumexp(logits): no [B, T, V] log-softmax copy. The logsumexp runs over
    chunks of rows whose fp32 temporaries hold at most chunk_elements (64 MB): one chunk for a small
    vocabulary (few ops), one row at a time for a large one. Entropy carries no gradient (a metric);
    entropy=False: zeros instead (a backward's recomputation of log p, a third fewer passes).
    """
    def scaled(x):  # z = logits / T in fp32, as the sampler divides: bf16 / T would round first
        return x.float() / temperature if temperature != 1.0 else x.float()

    picked = scaled(logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1))  # [B, T]
    chunks = logits.split(max(1, chunk_elements // (logits.shape[1] * logits.shape[2])))
    logsumexp = [torch.logsumexp(scaled(chunk), dim=-1) for chunk in chunks]  # [b, T] each
    if not entropy:
        return picked - torch.cat(logsumexp), torch.zeros_like(picked)
    with torch.no_grad():
        # H = logsumexp(z) - sum_v softmax(z)_v z_v
        entropies = [lse - (torch.softmax(z, -1) * z).sum(-1)
                     for lse, z in zip(logsumexp, map(scaled, chunks))]
    return picked - torch.cat(logsumexp), torch.cat(entropies)


def sequence_kl(logps, ref_logps, mask, estimator="k1"):
    """KL(pi_old || pi_ref) of each completion, a per-token estimate summed over its tokens, with
    d_t = log pi_old(o_t) - log pi_ref(o_t) and o_t ~ pi_old (Schulman 2020, "Approximating KL
    divergence"):
        k1 = d_t                    (TRL's RLOO; unbiased, negative on some tokens)
        k3 = exp(-d_t) - 1 + d_t    (unbiased too, since E[exp(-d)] = 1; >= 0, lower variance)
    logps, ref_logps, mask [B, T] -> [B]"""
    d = logps - ref_logps
    if estimator == "k3":  # the clamp keeps exp finite on masked or extreme tokens
        d = torch.exp(-d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) - 1 + d
    return (d * mask).sum(-1)


def combine_rewards(rewards_per_func, weights, clip_range=None):
    """R_i = sum_k w_k R_ik over the functions that scored completion i (NaN = returned None).

    rewards_per_func [B, K], weights [K] -> [B]; NaN where every function returned None
    (unscorable).
    """
    scored = ~torch.isnan(rewards_per_func)  # [B, K]
    total = (torch.nan_to_num(rewards_per_func) * weights).sum(-1)  # [B]
    if clip_range is not None:
        total = total.clamp(clip_range[0], clip_range[1])
    return torch.where(scored.any(-1), total, torch.nan)


def rloo_advantages(rewards, num_generations):
    """Leave-one-out advantages within each group of G consecutive completions.

    b_i = (sum_{j != i} r_j) / (n - 1),  A_i = r_i - b_i  = n/(n-1) * (r_i - mean(r)),
    over the n scorable (non-NaN) members of the group. Unscorable members and groups with n < 2
    get A = 0.
    rewards [B] (B = P*G, group members adjacent) -> advantages [B].
    """
    grouped = rewards.view(-1, num_generations)  # [P, G]
    n = (~torch.isnan(grouped)).sum(-1, keepdim=True)  # [P, 1]
    r = torch.nan_to_num(grouped)
    baseline = (r.sum(-1, keepdim=True) - r) / (n - 1).clamp(min=1)  # [P, G]
    with_baseline = has_baseline(rewards, num_generations).view_as(r)
    return torch.where(with_baseline, r - baseline, 0.0).view(-1)


def estimate_advantages(rewards, num_generations, estimator="rloo", settings=None):
    """The advantages of the estimator --advantage_estimator names (config.ADVANTAGE_ESTIMATORS):
    the function NAME_advantages of this file, rewards [B] (groups of G adjacent) -> [B].
    settings: its own keyword arguments (--advantage_estimator_kwargs), beyond the two every
    estimator takes."""
    return globals()[f"{estimator}_advantages"](rewards, num_generations, **(settings or {}))


def has_baseline(rewards, num_generations):
    """Completions that get a leave-one-out advantage: scorable, in a group with at least 2
    scorable members.  [B]"""
    scorable = ~torch.isnan(rewards.view(-1, num_generations))  # [P, G]
    return (scorable & (scorable.sum(-1, keepdim=True) >= 2)).view(-1)


def normalize_advantages(advantages, mask):
    """A <- (A - mean A) / (std A + 1e-4) over the completions in mask (those with a baseline, over
    the whole global batch: pass every rank's); the others keep A = 0, as in TRL, so their forced
    zeros do not shift the statistics."""
    kept = advantages[mask]
    if kept.numel() < 2:
        return advantages
    return torch.where(mask, (advantages - kept.mean()) / (kept.std() + 1e-4), 0.0)


def rloo_loss(logps, old_logps, advantages, epsilon_low, epsilon_high, num_sequences,
              is_weights=None):
    """Sequence-level clipped surrogate, summed here and divided by the step's sequence count.

    logps, old_logps [B] sequence log-probs s_i = sum_t log pi(o_t) (sum, not mean); advantages [B].
    rho = exp(clamp(s - s_old, -20, 20));
    L = -(1/N) sum_i min(rho A, clip(rho, 1-eps_low, 1+eps_high) A)
    where N = num_sequences counts every sequence of the optimizer step (all micro-batches, all
    ranks), so summing micro-batch losses and averaging gradients over ranks gives the mean over the
    step. With old_logps = logps.detach() (num_iterations == 1) rho == 1 and the gradient is
    REINFORCE's A grad s.
    is_weights [B] (optional, no gradient) multiply each sequence's term: importance_weights, times
    off_policy_mask, when the samples came from a generator whose log-probs differ from the
    trainer's.
    Returns the loss and per-sequence clip indicators (low, high) for the clip_ratio metrics.
    """
    ratio = torch.exp((logps - old_logps).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B]
    clipped_ratio = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    surrogate = torch.min(ratio * advantages, clipped_ratio * advantages)  # [B]
    if is_weights is not None:
        surrogate = surrogate * is_weights
    loss = -surrogate.sum() / num_sequences
    # the clip bound is the active branch of the min
    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return loss, low.detach(), high.detach()


def importance_weights(seq_old, seq_sampled, mode, clip_min=None, clip_max=None):
    """TRL's sequence-level importance weights, for completions drawn by a generator whose
    log-probs are not the trainer's (vLLM's kernels, bf16, async lag). One ratio per completion,
    rho_i = exp(s_i_old - s_i_sampler) = pi_old(o_i) / pi_sampler(o_i), then
        sequence_truncate: w_i = clamp(rho_i, C_min, C_max)               (truncated IS)
        sequence_mask:     w_i = rho_i if C_min <= rho_i <= C_max, else 0 (masked IS)
    A bound that is None does not bind. seq_old, seq_sampled [B] (sums over the loss tokens)
    -> weights [B], outside [B] bool: rho_i outside [C_min, C_max] (truncated or masked)."""
    ratio = torch.exp(seq_old - seq_sampled)  # [B]
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    outside = (ratio < low) | (ratio > high)
    if mode == "sequence_truncate":
        return ratio.clamp(low, high), outside
    if mode == "sequence_mask":
        return ratio.masked_fill(outside, 0.0), outside
    raise ValueError(f"importance sampling mode {mode!r}: sequence_truncate or sequence_mask")


def off_policy_mask(advantages, sampler_logps, logps, mask, threshold):
    """DeepSeek-V3.2's off-policy sequence mask (eq. 9; TRL's get_off_policy_mask): keep completion
    i unless A_i < 0 and its mean per-token KL from the sampler exceeds delta,
        kl_i = sum_t (log pi_sampler(o_t) - log pi(o_t)) m_t / max(sum_t m_t, 1),
    pi the policy being trained (no gradient): a negative sample the policy has moved far from
    is the least trustworthy update. advantages [B]; sampler_logps, logps, mask [B, T] -> keep [B]
    bool."""
    kl = ((sampler_logps - logps) * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
    return (advantages >= 0) | (kl <= threshold)


def sampling_mask(z, top_k=0, top_p=1.0, min_p=None):
    """The tokens vLLM's sampler keeps from z = logits / T [n, V] (fp32), in its order: min-p
    (p >= min_p * p_max), then top-k (ties with the k-th logit kept), then top-p over what is left:
    sorted ascending, a token is dropped while the mass up to and including it is <= 1 - top_p,
    the top token always kept (vllm/v1/sample/ops/topk_topp_sampler.py). With
    --replay_sampling_mask the sampler draws from, and the trainer scores, softmax(z) renormalised
    over these.  -> [n, V]"""
    keep = torch.ones_like(z, dtype=torch.bool)
    if min_p is not None:
        probs = torch.softmax(z, -1)
        keep &= probs >= min_p * probs.amax(-1, keepdim=True)
    z = z.masked_fill(~keep, float("-inf"))
    top_k = top_k if top_k and top_k < z.shape[-1] else 0
    if top_p >= 1.0:
        return keep & (z >= z.topk(top_k, -1).values[..., -1:]) if top_k else keep
    # vLLM sorts once and applies both in sorted order: tied logits keep its (sort's) order
    sorted_z, order = z.sort(-1)  # [n, V] ascending
    if top_k:
        kth = sorted_z[..., -top_k:].narrow(-1, 0, 1)  # [n, 1]
        sorted_z = sorted_z.masked_fill(sorted_z < kth, float("-inf"))
    dropped = torch.softmax(sorted_z, -1).cumsum(-1) <= 1 - top_p  # [n, V]
    dropped[..., -1] = False
    dropped |= sorted_z == float("-inf")
    return keep & ~dropped.scatter(-1, order, dropped)
