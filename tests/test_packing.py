"""--padding_free and --max_tokens_per_microbatch (packing.py, forward.packed_logps): the packed
forward's log-probs, entropy and gradients are the padded forward's; micro-batches by token
budget give the same step."""
import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import forward
import lora
import packing
import train
from batches import Rollout

VOCAB = 64


def tiny(kind):
    """A 2-layer model from config, fp32, grouped-query attention (4 heads, 2 kv heads). Plain RoPE
    is relative: once attention stays within a sequence, positions that do not restart change no
    number. The Llama has dynamic NTK RoPE (long-context models), whose frequencies depend on the
    largest position, so there they do."""
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    if kind == "llama":
        dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
        config = LlamaConfig(**shape, max_position_embeddings=64, rope_parameters=dynamic)
        return LlamaForCausalLM(config).float()
    return Qwen2ForCausalLM(Qwen2Config(**shape, max_position_embeddings=1024)).float()


def long_tail_batch(B=10, L=7, T=60, seed=0):
    """B left-padded prompts of 1..L tokens and right-padded completions of long-tailed lengths
    (most short, one of T)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(1, L + 1, (B,), generator=g)
    completion_lengths = (torch.rand(B, generator=g) ** 3 * (T - 1)).long() + 1
    completion_lengths[0] = T
    prompt_mask = (torch.arange(L) >= L - prompt_lengths[:, None]).long()  # [B, L] left padding
    completion_mask = (torch.arange(T) < completion_lengths[:, None]).long()  # [B, T]
    # padding holds real token ids: a leak across a boundary or into padding changes the numbers
    prompt_ids = torch.randint(1, VOCAB, (B, L), generator=g)
    completion_ids = torch.randint(1, VOCAB, (B, T), generator=g)
    return Rollout(rows={}, prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                   completion_ids=completion_ids, completion_mask=completion_mask,
                   truncated=torch.zeros(B, dtype=torch.bool), completion_lists=[], texts=[])


def logps_and_grads(model, batch, padding_free, chunked=None):
    """logps, entropy [B, T] and the gradients of a weighted sum of the sequence log-probs."""
    model.zero_grad()
    logps, entropy, T, _ = forward.forward_logps(model, batch, slice(None), 0.7, chunked=chunked,
                                                 padding_free=padding_free)
    mask = batch.completion_mask[:, :T].float()
    weights = torch.linspace(-1, 1, len(mask))
    ((logps * mask).sum(-1) * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logps * mask, entropy * mask, grads


def assert_same(packed, padded):
    for got, want in zip(packed[:2], padded[:2]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert packed[2].keys() == padded[2].keys() and padded[2]
    for name in padded[2]:
        torch.testing.assert_close(packed[2][name], padded[2][name], atol=1e-5, rtol=1e-4,
                                   msg=name)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("chunked", [True, False])
def test_packed_forward_equals_padded_in_logps_entropy_and_gradients(kind, chunked):
    model, batch = tiny(kind), long_tail_batch()
    padded = logps_and_grads(model, batch, padding_free=False, chunked=chunked)
    packed = logps_and_grads(model, batch, padding_free=True, chunked=chunked)
    assert_same(packed, padded)
    # the attention stays VARLEN after a packed forward, in front of sdpa for rows not packed
    assert model.config._attn_implementation == packing.VARLEN
    again = logps_and_grads(model, batch, padding_free=False, chunked=chunked)
    assert all(torch.equal(a, b) for a, b in zip(again[:2], padded[:2]))


def test_packed_forward_equals_padded_with_lora():
    base = tiny("llama")
    model = lora.add_adapter(base, dict(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, p in model.named_parameters():  # B random (not 0): A gets gradients too
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape) * 0.05)
    batch = long_tail_batch(seed=1)
    assert_same(logps_and_grads(model, batch, True), logps_and_grads(model, batch, False))


def test_packed_row_has_no_padding_and_attention_one_sequence_at_a_time(monkeypatch):
    """The hot path's shapes: one row of exactly the real tokens, no mask, and per-sequence SDPA
    calls of each sequence's length (never an [N, N] score matrix)."""
    model, batch = tiny("llama"), long_tail_batch()
    lengths = (batch.prompt_mask.sum(-1) + batch.completion_mask.sum(-1)).tolist()
    seen, rows = [], []
    sdpa = packing.F.scaled_dot_product_attention

    def counted(query, key, value, attn_mask=None, **kwargs):
        seen.append((query.shape[2], attn_mask))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(packing.F, "scaled_dot_product_attention", counted)
    model.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].shape),
                                    with_kwargs=True)
    with torch.no_grad():
        forward.forward_logps(model, batch, slice(None), 1.0, padding_free=True)
    assert rows == [(1, sum(lengths))]
    assert seen == [(n, None) for n in lengths] * model.config.num_hidden_layers


def test_pack_restarts_positions_and_scores_each_completion_token_from_the_one_before():
    batch = long_tail_batch(B=3, L=3, T=4)
    packed = packing.pack(batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                          batch.completion_mask)
    lengths = (batch.prompt_mask.sum(-1) + batch.completion_mask.sum(-1)).tolist()
    assert packed.position_ids[0].tolist() == [p for n in lengths for p in range(n)]
    assert packed.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert torch.equal(packed.input_ids[0, packed.score_index + 1], packed.targets)
    per_token = torch.arange(len(packed.targets)).float() + 1
    assert torch.equal(packing.unpack(per_token, packed) > 0, batch.completion_mask.bool())


def test_first_fit_decreasing_fills_the_budget_and_splits_to_a_count():
    groups = forward.first_fit_decreasing([5, 1, 9, 3, 4, 2], budget=10)
    assert groups == [[2, 1], [0, 4], [3, 5]]
    assert forward.first_fit_decreasing([12, 3], budget=10) == [[0], [1]]  # too long: alone
    assert sorted(map(len, forward.split_into(groups, 5))) == [1, 1, 1, 1, 2]


@pytest.mark.parametrize("padding_free", [False, True])
def test_token_budget_micro_batches_give_the_sequence_count_step(padding_free):
    """policy_step's update (SGD, lr 1: minus the gradient) with micro-batches of at most 40 tokens
    equals per_device_train_batch_size 4's: the loss stays the mean over the step's sequences."""
    model, batch = tiny("qwen2"), long_tail_batch(B=8)
    advantages = torch.linspace(-1, 1, 8)
    scores = train.Scores(None, None, batch.completion_mask.float(), advantages)
    cfg = train.parse_config([])
    cfg.per_device_train_batch_size, cfg.max_grad_norm, cfg.beta = 4, 0.0, 0.0
    cfg.padding_free = padding_free
    updated = []
    for budget in (None, 40):
        cfg.max_tokens_per_microbatch = budget
        m = copy.deepcopy(model)
        optimizer = torch.optim.SGD(m.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        seq_logps, stats, _, _ = train.policy_step(cfg, m, optimizer, scheduler, batch, scores)
        weights = torch.cat([p.detach().flatten() for p in m.parameters()])
        updated.append((weights, seq_logps, stats["sequences"]))
    mbs = forward.training_micro_batches(batch, slice(0, 8), 4, 40)
    assert len(mbs) > 2  # the budget, not the count, made them
    torch.testing.assert_close(updated[1][0], updated[0][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(updated[1][1], updated[0][1], atol=1e-5, rtol=1e-5)  # row order
    assert updated[1][2] == updated[0][2] == 8


def test_packed_router_aux_loss_is_over_real_tokens_as_padded():
    """A MoE model's load-balancing loss: the packed row has no padding, the padded forward masks
    it; both average over the same real tokens."""
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        attn_implementation="sdpa")).float()
    batch = long_tail_batch(seed=2)
    got, want = [forward.forward_logps(model, batch, slice(None), 1.0, router_aux=True,
                                       padding_free=padding_free)
                 for padding_free in (True, False)]
    mask = batch.completion_mask[:, :want[2]]
    torch.testing.assert_close(got[0] * mask, want[0] * mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[3], want[3], atol=1e-5, rtol=1e-5)


def test_packed_forward_equals_padded_under_gradient_checkpointing():
    model = tiny("qwen2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = long_tail_batch(seed=3)
    assert_same(logps_and_grads(model, batch, True), logps_and_grads(model, batch, False))


def test_recurrent_layers_are_refused_in_one_line():
    config = LlamaConfig(num_hidden_layers=2)
    config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(ValueError, match="recurrent ones would carry state"):
        packing.check_packable(config)
    packing.check_packable(LlamaConfig(num_hidden_layers=2))  # attention only: packable
