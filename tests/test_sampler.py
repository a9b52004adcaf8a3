"""step/sampler.py's draw (inverse CDF at one counter-based uniform per row and step): what it costs over
[B, vocab] per sampled token, that it follows the softmax, and that a sample is a pure function of
(seed, row, step), so chunked and resumed generation give the same tokens."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2Config, Qwen2ForCausalLM

import rollout
from plumbing.config import Config
from step import sampler

CPU = torch.device("cpu")
B, V = 4, 4096  # B * V above every tensor of the model's but its logits and its embedding table


def gen_cfg(**overrides):
    """A real Config (every field, its default) with the generation flags a test sets."""
    return Config(**{**dict(max_completion_length=2), **overrides})


@pytest.fixture(scope="module")
def wide():
    """A one-layer Qwen2 whose vocabulary dwarfs the rest: [B, V] arrays are the sampler's."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return Qwen2ForCausalLM(config).eval()


class VocabPasses(TorchDispatchMode):
    """Ops that read or write an array of at least B * V elements, by (op, its largest array's
    dtype); views (no kernel) and the model's own forward (paused by its hooks) are not counted."""

    def __init__(self, size):
        super().__init__()
        self.size, self.paused, self.ops = size, False, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [x for x in torch.utils._pytree.tree_leaves((args, kwargs, out))
                   if isinstance(x, torch.Tensor)]
        largest = max(tensors, key=torch.Tensor.numel, default=torch.empty(0))
        if not self.paused and not func.is_view and largest.numel() >= self.size:
            self.ops[(str(func), largest.dtype)] += 1
        return out


def decode_passes(model, cfg):
    """VocabPasses of one decode call of B rows (the model's forwards not counted)."""
    counter = VocabPasses(B * V)
    pause = model.register_forward_pre_hook(lambda *_: setattr(counter, "paused", True))
    resume = model.register_forward_hook(lambda *_: setattr(counter, "paused", False))
    prompt = torch.randint(3, V, (B, 3), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad(), counter:
            rollout.decode(model, prompt, torch.ones_like(prompt), cfg, [V + 1], 0,
                           sampler.row_keys(0, B, CPU))
    finally:
        pause.remove()
        resume.remove()
    return counter.ops


def test_a_sampled_token_costs_7_passes_over_the_vocabulary_not_25(wide):
    """Kernels over [B, vocab] per sampled token (decode at T = 1, no filters, the model's forward
    aside): 25 with argmax p / E and splitmix64 noise over [B, V], 15 of them in int64 (6-7 ms a
    token at B = 512, V = 152k on an H200); 7 with the inverse CDF: softmax, a cast to float64,
    cumsum, a binary search, and log pi_T's divide, log_softmax and gather. None is int64."""
    one, two = (decode_passes(wide, gen_cfg(max_completion_length=n)) for n in (1, 2))
    per_token = two - one  # the second token's passes alone
    assert sum(one.values()) == sum(per_token.values()) == 7, sorted(per_token.items())
    assert not [op for op, dtype in per_token if dtype == torch.int64]
    assert per_token[("aten.cumsum.default", torch.float64)] == 1


def draws(logits, n, seed=0, steps=1):
    """n rows' tokens [n, steps] from one logits row [V], as decode draws them."""
    keys = sampler.row_keys(seed, n, CPU)
    probs = torch.softmax(logits.expand(n, -1), -1)  # [n, V]
    return torch.stack([sampler.inverse_cdf(probs, sampler.row_uniforms(keys, t))
                        for t in range(steps)], -1)


def within_four_sigma(counts, want, n):
    """counts [K] of n draws against probabilities want [K]: binomial 4-sigma bounds."""
    sigma = (n * want * (1 - want)).sqrt()
    return ((counts - n * want).abs() <= 4 * sigma + 1e-9).all()


def test_draws_follow_the_softmax_and_steps_are_independent():
    """20000 rows of a 6-token distribution whose first and last tokens are banned (-inf, the
    binary search's two edges): each step's frequencies are within 4 sigma of the softmax, banned
    tokens never appear, and the pairs (step 0, step 1) follow the product distribution."""
    n = 20000
    want = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4, 0.0], dtype=torch.float64)
    tokens = draws(want.log().float(), n, steps=2)  # [n, 2]
    for t in range(2):
        counts = torch.bincount(tokens[:, t], minlength=6).double()
        assert counts[0] == counts[5] == 0
        assert within_four_sigma(counts, want, n), counts / n
    pairs = torch.bincount(tokens[:, 0] * 6 + tokens[:, 1], minlength=36).double()
    assert within_four_sigma(pairs, (want[:, None] * want[None, :]).flatten(), n)


def test_the_cdf_keeps_a_tail_token_that_float32_would_round_away():
    """p = (3/4, 2^-26, 1/4 - 2^-26): in fp32 3/4 + 2^-26 rounds to 3/4 (steps of 2^-24 there),
    so the middle token could never be drawn; the float64 cdf draws it at u in
    [3/4, 3/4 + 2^-26)."""
    probs = torch.tensor([[0.75, 2.0**-26, 0.25 - 2.0**-26]])
    assert (probs.cumsum(-1)[0, 1] == 0.75).item()  # what an fp32 cdf would hold
    at = [0.75 - 2.0**-30, 0.75 + 2.0**-27, 0.75 + 2.0**-25, 0.0, 1 - 2.0**-53]
    got = [sampler.inverse_cdf(probs, torch.tensor([u], dtype=torch.float64)).item() for u in at]
    assert got == [0, 1, 2, 0, 2]


def test_a_row_draws_the_same_in_chunks_and_after_a_resume(wide):
    """A draw is a function of (seed, row, step) alone: 9 rows decoded in chunks of 4 give one
    call's tokens; a later call with the same seed (other draws and torch's RNG in between) gives
    them again, and so does a seed of None after torch's RNG state is restored (a checkpoint's)."""
    prompt = torch.randint(3, V, (9, 3), generator=torch.Generator().manual_seed(1))
    mask, cfg = torch.ones_like(prompt), gen_cfg(max_completion_length=8, temperature=1.5)
    with torch.no_grad():
        whole, logps = rollout.decode_in_chunks(wide, prompt, mask, cfg, [V + 1], 0, seed=7)
        cfg.generation_chunk_size = 4
        chunked, chunked_logps = rollout.decode_in_chunks(wide, prompt, mask, cfg, [V + 1], 0, 7)
        torch.rand(100)
        rollout.decode_in_chunks(wide, prompt, mask, cfg, [V + 1], 0, seed=8)
        again, _ = rollout.decode_in_chunks(wide, prompt, mask, cfg, [V + 1], 0, seed=7)
        state = torch.get_rng_state()
        drawn, _ = rollout.decode_in_chunks(wide, prompt, mask, cfg, [V + 1], 0, seed=None)
        torch.set_rng_state(state)
        resumed, _ = rollout.decode_in_chunks(wide, prompt, mask, cfg, [V + 1], 0, seed=None)
    assert whole.shape == (9, 8) and len(set(whole.flatten().tolist())) > 20  # not one token
    assert torch.equal(chunked, whole) and torch.equal(again, whole) and torch.equal(resumed, drawn)
    torch.testing.assert_close(chunked_logps, logps, atol=1e-5, rtol=0)
    # each step's uniform depends on (row key, t) only: step 5 alone is step 5 of a sequence
    keys = sampler.row_keys(7, 9, CPU)
    assert torch.equal(sampler.row_uniforms(keys[4:], 5), sampler.row_uniforms(keys, 5)[4:])
    assert not torch.equal(sampler.row_uniforms(keys, 5), sampler.row_uniforms(keys, 6))
