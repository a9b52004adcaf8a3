"""rloo.py against closed forms, brute force, autograd and finite differences."""

import math

import pytest
import torch

from rloo import (combine_rewards, has_baseline, normalize_advantages, rloo_advantages, rloo_loss, sequence_kl,
                  token_logps_and_entropy)

nan = math.nan


def brute_force_advantages(rewards, G):
    """The paper's definition, one completion at a time: A_i = r_i - mean of the group's other scorable r_j."""
    out = []
    for group in rewards.view(-1, G).tolist():
        valid = [r for r in group if not math.isnan(r)]
        for r in group:
            if math.isnan(r) or len(valid) < 2:
                out.append(0.0)
            else:
                out.append(r - (sum(valid) - r) / (len(valid) - 1))
    return torch.tensor(out)


def test_two_generations_give_plus_minus_reward_difference():
    r = torch.tensor([3.0, 1.0, -2.0, 5.0])
    assert rloo_advantages(r, 2).tolist() == [2.0, -2.0, -7.0, 7.0]


def test_group_advantages_sum_to_zero_and_match_scaled_mean_identity():
    torch.manual_seed(0)
    for G in (2, 3, 4, 8):
        r = torch.randn(5 * G, dtype=torch.float64)
        a = rloo_advantages(r, G).view(-1, G)
        grouped = r.view(-1, G)
        torch.testing.assert_close(a.sum(-1), torch.zeros(5, dtype=torch.float64), atol=1e-12, rtol=0)
        # A_i = n/(n-1) * (r_i - mean r)
        torch.testing.assert_close(a, G / (G - 1) * (grouped - grouped.mean(-1, keepdim=True)))
        torch.testing.assert_close(a.view(-1), brute_force_advantages(r, G).double())


def test_unscorable_members_are_excluded_from_baseline_and_get_zero():
    r = torch.tensor([1.0, nan, 3.0, 5.0])
    # valid {1, 3, 5}: A(1) = 1 - 4 = -3, A(3) = 3 - 3 = 0, A(5) = 5 - 2 = 3
    assert rloo_advantages(r, 4).tolist() == [-3.0, 0.0, 0.0, 3.0]
    torch.testing.assert_close(rloo_advantages(r, 4), brute_force_advantages(r, 4))


def test_groups_with_fewer_than_two_scorable_members_get_zero():
    r = torch.tensor([7.0, nan, nan, nan, nan, nan, 2.0, 4.0])
    assert rloo_advantages(r, 4).tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -2.0, 2.0]


def test_combine_rewards_weights_none_and_clip():
    per_func = torch.tensor([[1.0, 2.0], [nan, 2.0], [nan, nan], [4.0, -10.0]])
    w = torch.tensor([1.0, 0.5])
    out = combine_rewards(per_func, w)
    assert out[:2].tolist() == [2.0, 1.0] and math.isnan(out[2]) and out[3].item() == -1.0
    clipped = combine_rewards(per_func, w, clip_range=(-0.5, 1.5))
    assert clipped[[0, 1, 3]].tolist() == [1.5, 1.0, -0.5] and math.isnan(clipped[2])


def test_normalize_advantages_mean_zero_std_one():
    a = torch.tensor([1.0, 2.0, 3.0, 10.0], dtype=torch.float64)
    n = normalize_advantages(a, torch.ones(4, dtype=torch.bool))
    assert abs(n.mean().item()) < 1e-12
    assert n.std().item() == pytest.approx(a.std().item() / (a.std().item() + 1e-4))


def test_normalize_advantages_uses_only_completions_with_a_baseline():
    # group 1: one unscorable member; group 2: a single scorable member (no baseline); group 3: all scorable
    r = torch.tensor([1.0, 3.0, nan, 2.0, nan, nan, nan, 5.0, 0.0, 1.0, 2.0, 3.0], dtype=torch.float64)
    mask = has_baseline(r, 4)
    assert mask.tolist() == [True, True, False, True] + [False] * 4 + [True] * 4
    a = rloo_advantages(r, 4)
    n = normalize_advantages(a, mask)
    kept = a[mask]  # by hand: mean and std over the 7 completions with a baseline, the others stay exactly 0
    torch.testing.assert_close(n[mask], (kept - kept.mean()) / (kept.std() + 1e-4))
    assert n[~mask].tolist() == [0.0] * 5
    assert abs(n[mask].mean().item()) < 1e-12


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_elements", [2**24, 1, 2 * 5 * 11])  # all rows at once, one row, chunks of 2 and 1
def test_token_logps_and_entropy_match_log_softmax_and_autograd(temperature, chunk_elements):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 11, (3, 5))
    logps, entropy = token_logps_and_entropy(logits, ids, temperature, chunk_elements)
    reference = torch.log_softmax(logits / temperature, -1)
    torch.testing.assert_close(logps.double(), reference.gather(-1, ids[..., None]).squeeze(-1), atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy.double(), -(reference.exp() * reference).sum(-1), atol=1e-6, rtol=0)
    assert not entropy.requires_grad
    weights = torch.randn(3, 5)
    (grad,) = torch.autograd.grad((logps * weights).sum(), logits)
    (ref_grad,) = torch.autograd.grad((reference.gather(-1, ids[..., None]).squeeze(-1) * weights).sum(), logits)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)


def test_bf16_logits_are_divided_by_the_temperature_in_fp32_as_the_sampler_does():
    """The sampler records log softmax(logits.float() / T); bf16 logits divided by T before the upcast round to bf16
    first (~1e-2 nats apart at T = 0.7), noise in the drift metric and the importance weights."""
    torch.manual_seed(0)
    logits = (torch.randn(2, 4, 50) * 3).bfloat16()
    ids = torch.randint(0, 50, (2, 4))
    logps, _ = token_logps_and_entropy(logits, ids, 0.7)
    sampler = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(logps, sampler, atol=1e-5, rtol=0)


def test_sequence_kl_sums_masked_log_ratio():
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    ref = torch.tensor([[-1.5, -1.0, -100.0], [-1.0, -0.25, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert sequence_kl(logps, ref, mask).tolist() == [0.5 - 1.0, 0.5 - 0.25 - 9.0]


def test_k3_is_an_unbiased_non_negative_kl_estimate():
    """k3 = exp(-d) - 1 + d, d = log p(o) - log q(o): by hand on one token; its expectation under o ~ p, summed
    exactly over a categorical vocabulary, is KL(p || q) in closed form (as k1's is); it is >= 0 on every token,
    where k1 is not; masked tokens add nothing."""
    d = torch.tensor([[math.log(2.0), -math.log(2.0), 5.0]])
    mask = torch.tensor([[1, 1, 0]])
    want = (0.5 - 1 + math.log(2.0)) + (2.0 - 1 - math.log(2.0))
    assert sequence_kl(d, torch.zeros_like(d), mask, "k3").item() == pytest.approx(want, abs=1e-6)
    g = torch.Generator().manual_seed(0)
    p, q = torch.softmax(torch.randn(50, generator=g), 0), torch.softmax(torch.randn(50, generator=g), 0)
    closed_form = (p * (p.log() - q.log())).sum()
    every_token = torch.ones(50, 1)  # each vocabulary entry as a one-token completion, weighted by p below
    for estimator in ("k1", "k3"):
        per_token = sequence_kl(p.log()[:, None], q.log()[:, None], every_token, estimator)
        torch.testing.assert_close((p * per_token).sum(), closed_form, atol=1e-6, rtol=0)
    assert (sequence_kl(p.log()[:, None], q.log()[:, None], every_token, "k3") >= 0).all()
    assert (sequence_kl(p.log()[:, None], q.log()[:, None], every_token, "k1") < 0).any()


def test_on_policy_loss_is_reinforce_with_unit_ratio():
    """old = logps.detach(): rho == 1, loss = -mean(A), and d loss / d s_i = -A_i / N."""
    s = torch.tensor([-3.0, -1.0, -2.0, -4.0], requires_grad=True)
    a = torch.tensor([1.0, -1.0, 0.5, -0.5])
    loss, low, high = rloo_loss(s, s.detach(), a, 0.2, 0.2, num_sequences=8)
    loss.backward()
    assert loss.item() == pytest.approx(-a.sum().item() / 8)
    torch.testing.assert_close(s.grad, -a / 8)
    assert not low.any() and not high.any()


def test_loss_gradient_matches_finite_differences():
    torch.manual_seed(0)
    s = (torch.randn(6, dtype=torch.float64) * 0.1).requires_grad_()
    old = torch.zeros(6, dtype=torch.float64)
    a = torch.randn(6, dtype=torch.float64)
    loss, _, _ = rloo_loss(s, old, a, 0.2, 0.3, num_sequences=6)
    (grad,) = torch.autograd.grad(loss, s)
    h = 1e-6
    for i in range(6):
        e = torch.zeros(6, dtype=torch.float64)
        e[i] = h
        fd = (rloo_loss(s.detach() + e, old, a, 0.2, 0.3, 6)[0] - rloo_loss(s.detach() - e, old, a, 0.2, 0.3, 6)[0])
        assert grad[i].item() == pytest.approx(fd.item() / (2 * h), abs=1e-6)


def test_clipping_stops_gradient_only_on_the_pessimistic_side():
    # log-ratios: ratio 1.5 (above 1+eps_high), 0.5 (below 1-eps), each with A > 0 and A < 0
    s = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5])).requires_grad_()
    a = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, low, high = rloo_loss(s, torch.zeros(4), a, 0.2, 0.3, num_sequences=4)
    loss.backward()
    # ratio 1.5 > 1.3 with A > 0: clipped (no gradient); with A < 0 the unclipped branch is the min: gradient
    # ratio 0.5 < 0.8 with A < 0: clipped; with A > 0: gradient flows
    assert s.grad[0] == 0 and s.grad[3] == 0
    assert s.grad[1].item() == pytest.approx(1.5 / 4) and s.grad[2].item() == pytest.approx(-0.5 / 4)
    assert high.tolist() == [True, False, False, False] and low.tolist() == [False, False, False, True]
    # the loss value: -(1/4) * (1.3*1 + 1.5*(-1) + 0.5*1 + 0.8*(-1))
    assert loss.item() == pytest.approx(-(1.3 - 1.5 + 0.5 - 0.8) / 4)


def test_log_ratio_clamp_keeps_loss_finite():
    s = torch.tensor([500.0, -500.0], requires_grad=True)
    loss, _, _ = rloo_loss(s, torch.zeros(2), torch.tensor([-1.0, 1.0]), 0.2, 0.2, num_sequences=2)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(s.grad).all()
