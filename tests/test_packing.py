"""--padding_free and --max_tokens_per_microbatch (options/packing.py, forward.packed_logps): the packed
forward's log-probs, entropy and gradients are the padded forward's (LoRA, MoE, multi-turn,
gradient checkpointing); micro-batches by token budget give the same step, on one process and on
two, where every rank runs as many."""
import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import train
from options import lora, packing
from plumbing import stack
from step import forward
from step.batches import Rollout
from conftest import in_process
from test_train import read_metrics, run, worker


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


def multi_turn_batch(seed=4):
    """long_tail_batch with environment replies inside the longer completions: 5 tokens after each
    third of the model's (0 in generated_mask), context that stays outside s_i."""
    batch = long_tail_batch(seed=seed)
    lengths = batch.completion_mask.sum(-1)  # [B]
    t = torch.arange(batch.completion_mask.shape[1])
    replies = torch.zeros_like(batch.completion_mask, dtype=torch.bool)
    for start in (lengths // 3, 2 * lengths // 3):
        replies |= (t >= start[:, None]) & (t < start[:, None] + 5) & (lengths[:, None] > 15)
    batch.generated_mask = (~replies).long()
    assert batch.model_tokens().sum() < batch.completion_mask.sum() - 20
    return batch


def logps_and_grads(model, batch, padding_free, chunked=None):
    """logps, entropy [B, T] and the gradients of a weighted sum of the sequence log-probs s_i
    (over the model's tokens: multi-turn, not the environment's)."""
    model.zero_grad()
    logps, entropy, T, *_ = forward.forward_logps(model, batch, slice(None), 0.7, chunked=chunked,
                                                 padding_free=padding_free)
    mask = batch.model_tokens()[:, :T].float()
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


@pytest.mark.stack
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


def grouped_batch(G=4, T=8):
    """long_tail_batch of 12 rows whose prompts repeat in runs of G (a prompt's G samples)."""
    batch = long_tail_batch(B=12, T=T)
    for first in range(0, 12, G):
        batch.prompt_ids[first:first + G] = batch.prompt_ids[first]
        batch.prompt_mask[first:first + G] = batch.prompt_mask[first]
    return batch


@pytest.mark.stack
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_prompts_completions_share_it_in_the_packed_row_and_equal_padded(kind):
    """On a CPU the packed row holds each prompt once, followed by its G completions, each attending to it and to
    itself at the positions it has alone: the padded forward's log-probs, entropy and gradients, from a row shorter
    by G - 1 prompts a group."""
    model, batch = tiny(kind), grouped_batch()
    rows = []
    model.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].shape[1]), with_kwargs=True)
    assert_same(logps_and_grads(model, batch, padding_free=True), logps_and_grads(model, batch, padding_free=False))
    prompts = batch.prompt_mask.sum(-1)
    assert rows[0] == int(prompts[::4].sum() + batch.completion_mask.sum()) < int(prompts.sum() +
                                                                                  batch.completion_mask.sum())


@pytest.mark.parametrize("padding_free,collide", [(True, False), (False, False), (False, True)])
def test_rows_that_repeat_go_through_the_model_once_with_each_row_s_numbers_and_gradients(padding_free, collide,
                                                                                         monkeypatch):
    """A group's samples that agree (equal prompt and completion tokens and masks) are one sequence in the
    forward: every row's log-probs and entropy, and the gradient of a sum weighting each row differently, as when
    each row goes through alone. A row with the same tokens and one fewer in its mask stays a row of its own.
    collide: every row hashes alike, so the rows themselves must tell them apart."""
    model, batch = tiny("qwen2"), grouped_batch()
    if collide:
        monkeypatch.setattr(forward, "row_hashes", lambda key: torch.zeros(len(key), dtype=torch.long))
    for copy_, of in ((1, 0), (2, 0), (3, 0), (5, 4)):  # rows 0-3 share a prompt, as do 4-7
        batch.completion_ids[copy_], batch.completion_mask[copy_] = batch.completion_ids[of], batch.completion_mask[of]
    batch.completion_mask[3, batch.completion_mask[3].sum() - 1] = 0  # row 3: one token shorter
    calls = []
    model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape), with_kwargs=True)
    merged = logps_and_grads(model, batch, padding_free)
    monkeypatch.setattr(forward, "distinct_rows", lambda batch, rows: None)
    alone = logps_and_grads(model, batch, padding_free)
    assert_same(merged, alone)
    assert merged[0][1:3].eq(merged[0][0]).all() and not merged[0][3].eq(merged[0][0]).all()
    if padding_free:  # the row is shorter by the copies' completions (their prompt is shared already)
        assert calls[1][1] - calls[0][1] == int(batch.completion_mask[[1, 2, 5]].sum()) > 0
    else:
        assert (calls[0][0], calls[1][0]) == (9, 12)


def test_a_prompt_is_shared_only_where_that_saves_work():
    """The shared unit's attention mask costs its n^2 scores: with long completions and a short prompt the rows
    stay sequences of their own (no layouts); with short ones they share."""
    batch = grouped_batch(T=60)
    args = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    short = packing.pack(*(x[:, :8] if i > 1 else x for i, x in enumerate(args)), costs=(10**6, 100))
    assert short.layouts and all(len(layout) == 5 for layout in short.layouts)
    dear = packing.pack(*args, costs=(100, 10**6))
    assert dear.layouts is None and len(dear.cu_seqlens) == 13


@pytest.mark.stack
def test_a_copy_of_a_model_after_a_packed_forward_still_runs_padded_and_packed():
    """Review: a copy.deepcopy of the model (a reference made from the policy, a user's EMA) after a packed forward
    raised KeyError in the mask function, its config unknown to packing.BASE; it now falls back to sdpa."""
    import copy
    model, batch = tiny("qwen2"), long_tail_batch()
    padded = logps_and_grads(model, batch, padding_free=False)
    logps_and_grads(model, batch, padding_free=True)
    twin = copy.deepcopy(model)
    assert_same(logps_and_grads(twin, batch, padding_free=False), padded)
    assert_same(logps_and_grads(twin, batch, padding_free=True), padded)


@pytest.mark.stack
def test_packed_forward_equals_padded_with_lora():
    base = tiny("llama")
    model = lora.add_adapter(base, dict(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, p in model.named_parameters():  # B random (not 0): A gets gradients too
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape) * 0.05)
    batch = long_tail_batch(seed=1)
    assert_same(logps_and_grads(model, batch, True), logps_and_grads(model, batch, False))


@pytest.mark.stack
def test_packed_row_has_no_padding_and_attention_one_sequence_at_a_time(monkeypatch):
    """The hot path's shapes: one row of exactly the real tokens, and per layer a few SDPA calls,
    each over sequences padded to the longest of its group: every sequence in one call, a mask only
    where a group pads (causal suffices for sequences of one length), padding scores that cost
    less than the calls they save (packing.CALL_FLOPS a sequence), never an [N, N] score matrix."""
    model, batch = tiny("llama"), long_tail_batch()
    lengths = (batch.prompt_mask.sum(-1) + batch.completion_mask.sum(-1)).tolist()
    seen, rows, widths = [], [], set()
    sdpa = packing.F.scaled_dot_product_attention

    def counted(query, key, value, attn_mask=None, **kwargs):
        seen.append((*query.shape[:3:2], attn_mask is not None))  # units, m, masked
        widths.add(query.shape[1] * query.shape[3])
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(packing.F, "scaled_dot_product_attention", counted)
    model.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].shape),
                                    with_kwargs=True)
    with torch.no_grad():
        forward.forward_logps(model, batch, slice(None), 1.0, padding_free=True)
    assert rows == [(1, sum(lengths))]
    layers = model.config.num_hidden_layers
    assert len(seen) % layers == 0 and len(seen) // layers < len(set(lengths)) < len(lengths)
    per_layer = seen[:len(seen) // layers]
    assert seen == per_layer * layers
    assert sum(units for units, _, _ in per_layer) == len(lengths)
    assert max(m for _, m, _ in per_layer) == max(lengths) < sum(lengths)
    padding = sum(units * m * m for units, m, _ in per_layer) - sum(n * n for n in lengths)
    assert 0 < 4 * widths.pop() * padding <= len(lengths) * packing.CALL_FLOPS


@pytest.mark.stack
@pytest.mark.parametrize("layouts", [((3, 2, 4), (1,), (6,), (2, 1), (5,), (4, 3, 3, 1)),
                                     ((5,), (3,), (1,), (4,), (3,))])
def test_grouped_units_attend_as_each_alone_and_padding_stays_finite(layouts):
    """unit_groups' padding on hand-built layouts, plain and with a shared prompt, a unit of one
    token among them: each query's attention and the gradients of q, k and v equal those of a
    softmax over its own unit's keys (its prompt and its own completion, causally), brute force;
    a padding query with no key would give NaN, one that saw real keys wrong gradients."""
    lengths = [sum(layout) for layout in layouts]
    N = sum(lengths)
    q, k, v = (torch.randn(1, 2, N, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out, _ = packing.varlen_attention(None, q, k, v, None, cu_seq_lens_q=cu_seqlens,
                                      rloo_layouts=layouts)  # [1, N, heads, d]
    want, start = [], 0
    for layout in layouts:
        segment = [j for j, part in enumerate(layout) for _ in range(part)]
        for i in range(len(segment)):
            idx = torch.tensor([j for j in range(i + 1) if segment[j] in (0, segment[i])]) + start
            scores = (q[0, :, start + i, None] * k[0, :, idx]).sum(-1) / 2  # [heads, keys]
            want.append((scores.softmax(-1)[..., None] * v[0, :, idx]).sum(1))  # [heads, d]
        start += len(segment)
    want = torch.stack(want)  # [N, heads, d]
    torch.testing.assert_close(out[0], want)
    weights = torch.randn_like(want)
    got_grads = torch.autograd.grad((out[0] * weights).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for got, expected in zip(got_grads, want_grads):
        torch.testing.assert_close(got, expected)
    groups = packing.unit_groups(layouts, 2 * 4, q.device)[1]
    assert len(groups) == 1 and groups[0][0] is not None


class Written(TorchDispatchMode):
    """Counts the elements the ops write (their outputs' sizes, views aside): a pass's traffic."""
    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.elements += sum(t.numel() for t in torch.utils._pytree.tree_leaves(out)
                                 if isinstance(t, torch.Tensor))
        return out


@pytest.mark.stack
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_attention_backward_writes_the_row_a_few_times_not_once_per_sequence(dtype):
    """48 sequences in a row: a slice per sequence would make backward write a zero gradient of the
    whole row per slice (48 rows each for q, k, v); split's backward is one concatenation. On a CPU
    the attention runs in fp32 (bf16 SDPA compiles a kernel per new length) and returns the
    row's dtype. Sequences of similar length attend in one call (unit_groups)."""
    lengths = [1 + (7 * i) % 23 for i in range(48)]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(1, 4, sum(lengths), 8, dtype=dtype, requires_grad=True)
               for _ in range(3))
    seen = []
    sdpa = packing.F.scaled_dot_product_attention

    def recorded(query, *args, **kwargs):
        seen.append(query.dtype)
        return sdpa(query, *args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(packing.F, "scaled_dot_product_attention", recorded)
        out, _ = packing.varlen_attention(None, q, k, v, None, cu_seq_lens_q=cu_seqlens)
    assert out.dtype == dtype and out.shape == (1, sum(lengths), 4, 8)
    assert set(seen) == {torch.float32} and len(seen) < len(set(lengths))  # calls: groups
    with Written() as written:
        out.sum().backward()
    # fp32 18 x, bf16 22 x (casts; the groups' gathers and their padding); slices: 290 x
    assert written.elements < 30 * q.numel()
    for i, (s, e) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        if i % 10 == 0:  # each sequence attends within itself only
            want = sdpa(*(x.detach()[:, :, s:e].float() for x in (q, k, v)), is_causal=True)
            torch.testing.assert_close(out[0, s:e].float(), want[0].transpose(0, 1),
                                       atol=1e-2, rtol=1e-2)


@pytest.mark.slow
def test_embedded_task_learns_packed_with_a_token_budget(tmp_path):
    """`python train.py --padding_free --max_tokens_per_microbatch 256`: every training forward packed,
    micro-batches of at most 256 tokens, 250 of the default's 500 steps (it passes 0.95 by step 190)."""
    out = in_process(["--padding_free", "--max_tokens_per_microbatch", "256", "--output_dir", str(tmp_path),
                      "--logging_steps", "1", "--max_steps", "250"])
    assert out.returncode == 0, out.stderr[-3000:]
    rewards = [m["reward"] for m in read_metrics(tmp_path)]
    tenth = len(rewards) // 10
    first, last = sum(rewards[:tenth]) / tenth, sum(rewards[-tenth:]) / tenth
    assert last >= 0.8 and last >= 3 * first, (first, last)


@pytest.mark.stack
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


@pytest.mark.stack
def test_first_fit_decreasing_fills_the_budget_and_splits_to_a_count():
    groups = forward.first_fit_decreasing([5, 1, 9, 3, 4, 2], budget=10)
    assert groups == [[2, 1], [0, 4], [3, 5]]
    assert forward.first_fit_decreasing([12, 3], budget=10) == [[0], [1]]  # too long: alone
    assert sorted(map(len, forward.split_into(groups, 5))) == [1, 1, 1, 1, 2]


@pytest.mark.stack
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
        logps, stats, _, _ = train.policy_step(cfg, m, optimizer, scheduler, batch, scores)
        weights = torch.cat([p.detach().flatten() for p in m.parameters()])
        updated.append((weights, (logps * scores.loss_mask).sum(-1), stats["sequences"]))
    mbs = forward.training_micro_batches(batch, slice(0, 8), 4, 40)
    assert len(mbs) > 2  # the budget, not the count, made them
    torch.testing.assert_close(updated[1][0], updated[0][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(updated[1][1], updated[0][1], atol=1e-5, rtol=1e-5)  # row order
    assert updated[1][2] == updated[0][2] == 8


@pytest.mark.stack
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


@pytest.mark.stack
def test_packed_forward_equals_padded_under_gradient_checkpointing():
    model = tiny("qwen2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = long_tail_batch(seed=3)
    assert_same(logps_and_grads(model, batch, True), logps_and_grads(model, batch, False))


@pytest.mark.stack
def test_recurrent_layers_are_refused_in_one_line():
    config = LlamaConfig(num_hidden_layers=2)
    config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(ValueError, match="recurrent ones would carry state"):
        packing.check_packable(config)
    packing.check_packable(LlamaConfig(num_hidden_layers=2))  # attention only: packable


@pytest.mark.stack
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_multi_turn_packed_equals_padded_and_environment_tokens_stay_context(kind):
    """Multi-turn trajectories: the environment's replies go through the model as context (their
    log-probs are computed) but are outside s_i: packed and padded agree on every completion
    token, on the entropy and gradients over the model's tokens, on a whole policy_step, and the
    environment's tokens get no gradient."""
    model, batch = tiny(kind), multi_turn_batch()
    assert_same(logps_and_grads(model, batch, True), logps_and_grads(model, batch, False))
    everything = copy.copy(batch)
    everything.generated_mask = None
    with torch.no_grad():
        got, want = [forward.forward_logps(model, everything, slice(None), 0.7,
                                           padding_free=padding_free)[0] * batch.completion_mask
                     for padding_free in (True, False)]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # environment tokens too
    cfg = train.parse_config([])
    cfg.per_device_train_batch_size, cfg.max_grad_norm, cfg.beta = 4, 0.0, 0.0
    advantages = torch.linspace(-1, 1, len(batch.completion_mask))
    steps = []
    for padding_free in (False, True):
        cfg.padding_free = padding_free
        m = tiny(kind)  # the same weights (a copy after a packed forward lost its base attention)
        optimizer = torch.optim.SGD(m.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        scores = train.Scores(None, None, batch.model_tokens().float(), advantages)
        logps, stats, _, _ = train.policy_step(cfg, m, optimizer, scheduler, batch, scores)
        weights = torch.cat([p.detach().flatten() for p in m.parameters()])
        steps.append((weights, (logps * scores.loss_mask).sum(-1), stats["entropy"], stats["tokens"]))
    for got, want in zip(steps[1], steps[0]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert steps[1][3] == batch.model_tokens().sum()
    logps, _, T, *_ = forward.forward_logps(model, batch, slice(None), 1.0, padding_free=True)
    logps.retain_grad()
    ((logps * batch.model_tokens()[:, :T]).sum(-1) * advantages).sum().backward()
    replies = batch.completion_mask.bool() & ~batch.generated_mask.bool()
    assert (logps.grad[replies[:, :T]] == 0).all()
    assert (logps.grad[batch.model_tokens()[:, :T].bool()] != 0).all()


@pytest.mark.slow
@pytest.mark.stack
def test_two_process_packed_step_equals_padded_step(tmp_path):
    """tests/dist_worker.py's step (2 FSDP2 ranks on gloo, fp32, gradient checkpointing, a
    reference forward first): padded micro-batches of 4 vs packed ones of at most 24 tokens, for
    which rank 0's 8 sequences fit in 3 and rank 1's in 4; rank 0 splits one so both run 4 (else
    FSDP2's collectives would not pair up). Same loss, gradient norm and updated weights."""
    fp32 = ["--bf16", "false"]
    padded = worker(tmp_path / "padded.pt", True, *fp32)
    packed = worker(tmp_path / "packed.pt", True, *fp32, "--padding_free", "true",
                    "--max_tokens_per_microbatch", "24")
    assert abs(padded["loss"]) > 1e-3
    assert packed["loss"] == pytest.approx(padded["loss"], rel=1e-5, abs=1e-6)
    assert packed["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-5)
    diff = max((padded["state"][k] - packed["state"][k]).abs().max().item()
               for k in padded["state"])
    assert diff < 1e-6, diff


@pytest.mark.stack
def test_every_rank_runs_as_many_micro_batches_as_the_busiest_with_one_all_reduce(monkeypatch):
    """The rank whose sequences fit in fewer micro-batches splits its largest until it has the
    count the all-reduce returns (another rank's 6 here), each row in exactly one; the scoring,
    reference and policy passes over the same batch and rows share that one all-reduce."""
    batch, asked = long_tail_batch(B=8), []

    def busiest(extremes):
        asked.append(extremes)
        return {"max/groups": torch.tensor(6.0)}

    monkeypatch.setattr(forward.distributed, "reduce_extremes", busiest)
    mbs = forward.training_micro_batches(batch, slice(0, 8), 4, 70)
    assert len(forward.first_fit_decreasing(
        (batch.prompt_mask.sum(-1) + batch.completion_mask.sum(-1)).tolist(), 70)) < 6
    assert len(mbs) == 6 and sorted(torch.cat(mbs).tolist()) == list(range(8))
    for _ in range(2):
        assert forward.training_micro_batches(batch, slice(0, 8), 4, 70) is mbs
    assert len(asked) == 1
    forward.training_micro_batches(copy.copy(batch), slice(0, 8), 4, 70)  # the next step's
    assert len(asked) == 2


@pytest.mark.stack
def test_the_packed_attention_arguments_are_those_flash_attention_varlen_takes():
    """On a GPU transformers' flash_attention_2 passes cu_seq_lens_q/k and max_length_q/k on to
    flash_attn_varlen_func as cu_seqlens_q/k, max_seqlen_q/k (modeling_flash_attention_utils.py):
    the names are its parameters; the kernel needs int32 offsets from 0 to N and an int maximum."""
    from transformers.modeling_flash_attention_utils import _flash_attention_forward

    batch = long_tail_batch()
    packed = packing.pack(batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                          batch.completion_mask)
    kwargs = packed.attention_kwargs()
    assert set(kwargs) <= set(inspect.signature(_flash_attention_forward).parameters)
    cu = kwargs["cu_seq_lens_q"]
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == packed.input_ids.shape[1]
    assert isinstance(kwargs["max_length_q"], int) and kwargs["max_length_q"] == cu.diff().max()


# varlen_attn's keywords by torch release: causal as is_causal (2.10) or window_size (2.11), kv
# heads shared by the kernel (enable_gqa) from 2.12
VARLEN_RELEASES = {"2.10": {"is_causal"}, "2.11": {"window_size"},
                   "2.12+": {"window_size", "enable_gqa"}}


def flash_stand_in(calls, release="2.12+"):
    """torch.nn.attention.varlen.varlen_attn's contract as its docstring states it, for one release's
    keywords, computed by causal SDPA per sequence: [N, heads, d] in and out, int32 offsets, int
    maxima, causal, grouped-query heads only with enable_gqa. (The kernel itself needs a GPU; its
    signature and shapes are checked against the installed torch on the meta device below.)"""
    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, **options):
        assert set(options) <= VARLEN_RELEASES[release], f"{set(options)} on torch {release}"
        assert q.dim() == k.dim() == 3 and q.stride(-1) == 1 and cu_q.dtype == torch.int32
        assert type(max_q) is int and max_q == max_k == cu_q.diff().max() and cu_k is cu_q
        causal = options.get("is_causal") or tuple(options.get("window_size", ())) == (-1, 0)
        gqa = options.get("enable_gqa", False)
        assert causal and (k.shape[1] == q.shape[1] or gqa)
        calls.append(q.shape)
        with sdpa_kernel([SDPBackend.MATH]):  # packing pins FlashAttention, which a CPU lacks
            return torch.cat([F.scaled_dot_product_attention(
                *(x[s:e].transpose(0, 1) for x in (q, k, v)), scale=scale, is_causal=True,
                enable_gqa=gqa).transpose(0, 1)
                for s, e in zip(cu_q[:-1].numpy(), cu_q[1:].numpy())])  # on the host: CPU only
    return varlen_attn


@pytest.mark.stack
@pytest.mark.parametrize("kind,release", [("llama", "2.12+"), ("qwen2", "2.12+"),
                                          ("qwen2", "2.11"), ("qwen2", "2.10")])
def test_flash_varlen_takes_the_packed_row_in_one_call_per_layer_and_equals_padded(
        kind, release, monkeypatch):
    """Where FlashAttention's varlen kernel fits (CUDA, fp16/bf16, no dropout) VARLEN hands it the
    whole row once a layer, without the host sync of the SDPA loop: layout, offsets, maxima from
    pack() and grouped-query heads (the kernel's from torch 2.12, repeated before) checked through
    the models' own attention calls, for each release's keywords."""
    x = torch.zeros(1, 2, 3, 4)
    assert packing.packed_kernel(x, 0.0) == (packing.PER_SEQUENCE, "CPU" if packing.varlen_attn else
                                              f"torch {torch.__version__} has no torch.nn.attention.varlen")
    calls = []
    monkeypatch.setattr(packing, "varlen_attn", flash_stand_in(calls, release))
    monkeypatch.setattr(packing, "VARLEN_ARGS", VARLEN_RELEASES[release])
    monkeypatch.setattr(packing, "packed_kernel", lambda query, dropout: (packing.FLASH, "test"))
    model, batch = tiny(kind), long_tail_batch()
    inside = [False]  # within a layer's attention: no device-to-host read (a sync on a GPU)
    for read in ("tolist", "item", "__int__"):
        def banned(self, *args, _read=getattr(torch.Tensor, read)):
            assert not inside[0], "a host sync in the attention"
            return _read(self, *args)
        monkeypatch.setattr(torch.Tensor, read, banned)
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        layer.self_attn.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    packed = logps_and_grads(model, batch, padding_free=True)
    monkeypatch.undo()
    N = int(batch.prompt_mask.sum() + batch.completion_mask.sum())
    assert calls == [(N, 4, 8)] * model.config.num_hidden_layers
    assert_same(packed, logps_and_grads(model, batch, padding_free=False))
    assert stack.PATHS["packed attention"] == packing.FLASH


@pytest.mark.stack
@pytest.mark.skipif(packing.varlen_attn is None, reason="this torch has no varlen_attn")
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_flash_varlen_calls_the_installed_kernel_as_it_is_declared(kv_heads):
    """The call packing makes, to the installed torch's own varlen_attn on the meta device (its
    registered shapes run there, no GPU needed): a keyword this torch does not take, a layout or
    dtype it refuses, or grouped-query heads without enable_gqa fail here, forward and backward."""
    meta = dict(device="meta", dtype=torch.bfloat16, requires_grad=True)
    query, key, value = (torch.empty(1, h, 37, 16, **meta) for h in (8, kv_heads, kv_heads))
    cu_seqlens = torch.tensor([0, 10, 37], dtype=torch.int32, device="meta")
    out = packing.flash_varlen(query, key, value, cu_seqlens, 27, 0.25)
    assert out.shape == (1, 37, 8, 16) and out.dtype == torch.bfloat16
    out.sum().backward()
    assert key.grad.shape == key.shape and query.grad.shape == query.shape


def test_the_default_packs_on_a_cpu_where_the_model_allows_it_and_says_which(tmp_path):
    """--padding_free unset: the embedded default trains on packed rows on a CPU (the start-up line says so, and the
    flag alone is still true); padded where packing would change the numbers or cannot run: images, rounded
    lengths, sliding-window or recurrent layers, softcapping, another attention implementation."""
    out = run(["--max_steps", "2", "--output_dir", str(tmp_path / "auto")])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "path: training rows = packed (--padding_free unset: a CPU" in out.stdout + out.stderr
    assert train.parse_config(["--padding_free"]).padding_free is True
    config = tiny("qwen2").config
    assert packing.unpackable(config, False, None) is None
    assert packing.unpackable(config, True, None) == "vision-language rows"
    assert packing.unpackable(config, False, 8) == "--pad_to_multiple_of"
    sliding = Qwen2Config(**{**config.to_dict(), "use_sliding_window": True, "sliding_window": 16})
    assert "sliding" in packing.unpackable(sliding, False, None)
    eager = copy.deepcopy(config)
    eager._attn_implementation = "eager"
    assert packing.unpackable(eager, False, None) == "attn_implementation eager"
