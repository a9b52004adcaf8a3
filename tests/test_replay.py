"""--replay_sampling_mask (issue 32): with top-k, top-p or min-p the sampler's recorded log-probs
and the training forward's are both of the truncated, renormalised distribution the tokens were
drawn from; without the flag nothing changes."""


import pytest
import torch

import rollout
from plumbing import config, models
from step import data, forward, sampler_rules
from plumbing.config import Config
from conftest import requires_vllm
from rloo import sampling_mask
from test_off_policy import startup_error
from test_train import read_metrics, run

CPU = torch.device("cpu")
PROMPTS = {"prompt": ["123=", "4=", "98765=", "55="]}


def gen_cfg(**overrides):
    """A real Config (every field, its default) with the generation flags a test sets."""
    return Config(**{**dict(num_generations=4, max_completion_length=8, replay_sampling_mask=True), **overrides})


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer, _ = data.embedded_task(seed=0)
    return model.float().eval(), tokenizer


def full_logits(model, out):
    """z = logits of every completion position, from one plain forward.  [B, T, V] fp32"""
    input_ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits
    L = out.prompt_ids.shape[1]
    return logits[:, L - 1:-1].float()


def recorded_and_trained(model, tokenizer, cfg, seed=0):
    out = rollout.generate(model, tokenizer, PROMPTS, cfg, CPU, seed=seed)
    with torch.no_grad():
        trained, _, T, *_ = forward.forward_logps(model, out, slice(None), cfg.temperature)
    return out, out.sampler_logps[:, :T], trained


def assert_on_tokens(out, got, want):
    mask = out.completion_mask.bool()
    assert mask.sum() > 8
    torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=1e-5)


def test_top_k_5_log_probs_are_the_log_softmax_over_the_5_kept_tokens(tiny):
    model, tokenizer = tiny
    out, recorded, trained = recorded_and_trained(model, tokenizer, gen_cfg(top_k=5))
    z = full_logits(model, out)  # T = 1
    top5 = z.topk(5, -1)
    picked = z.gather(-1, out.completion_ids[..., None])[..., 0]
    in_top5 = picked >= top5.values[..., -1]
    assert in_top5[out.completion_mask.bool()].all()  # every sampled token is one of the 5
    want = picked - torch.logsumexp(top5.values, -1)
    assert_on_tokens(out, recorded, want)
    assert_on_tokens(out, trained, want)
    assert out.sampling_filter == {"top_k": 5}
    assert out.sampler_logps.isfinite().all()  # padding drawn outside the 5 is masked, not NaN
    with torch.no_grad():  # packed rows (--padding_free) replay the same kept sets
        packed, _, T, _, flips = forward.forward_logps(model, out, slice(None), 1.0, padding_free=True)
    assert_on_tokens(out, packed, want)
    assert flips[out.completion_mask[:, :T].bool()].sum() == 0


def test_top_p_log_probs_renormalise_over_the_nucleus_vllm_keeps(tiny):
    """vLLM's nucleus: a token is kept while the mass strictly above it is < top_p (so the token
    that crosses top_p is in), at temperature 0.7."""
    model, tokenizer = tiny
    cfg = gen_cfg(top_p=0.8, temperature=0.7)
    out, recorded, trained = recorded_and_trained(model, tokenizer, cfg)
    z = full_logits(model, out) / 0.7
    sorted_z, order = z.sort(-1, descending=True)
    above = torch.softmax(sorted_z, -1).cumsum(-1) - torch.softmax(sorted_z, -1)
    kept = torch.zeros_like(z, dtype=torch.bool).scatter(-1, order, above < 0.8)
    want = torch.log_softmax(z.masked_fill(~kept, float("-inf")), -1)
    want = want.gather(-1, out.completion_ids[..., None])[..., 0]
    assert kept.sum(-1).float().mean() < z.shape[-1]  # the nucleus truncates
    assert_on_tokens(out, recorded, want)
    assert_on_tokens(out, trained, want)


def test_min_p_log_probs_renormalise_over_the_tokens_above_min_p_of_the_top(tiny):
    model, tokenizer = tiny
    out, recorded, trained = recorded_and_trained(model, tokenizer, gen_cfg(min_p=0.1))
    probs = torch.softmax(full_logits(model, out), -1)
    kept = probs >= 0.1 * probs.amax(-1, keepdim=True)
    want = (probs * kept).div(probs.mul(kept).sum(-1, keepdim=True)).log()
    want = want.gather(-1, out.completion_ids[..., None])[..., 0]
    assert_on_tokens(out, recorded, want)
    assert_on_tokens(out, trained, want)


def test_without_the_flag_the_samples_are_the_same_and_log_probs_the_full_softmax(tiny):
    """Replay changes the log-probs only: the same seed draws the same tokens either way."""
    model, tokenizer = tiny
    cfg = gen_cfg(top_k=5, replay_sampling_mask=False)
    off, recorded, trained = recorded_and_trained(model, tokenizer, cfg)
    on = rollout.generate(model, tokenizer, PROMPTS, gen_cfg(top_k=5), CPU, seed=0)
    assert off.sampling_filter is None
    assert torch.equal(off.completion_ids, on.completion_ids)
    want = torch.log_softmax(full_logits(model, off), -1)
    want = want.gather(-1, off.completion_ids[..., None])[..., 0]
    assert_on_tokens(off, recorded, want)
    assert_on_tokens(off, trained, want)


def test_the_flag_is_refused_where_the_kept_set_cannot_be_recomputed():
    assert "none is set" in startup_error(["--replay_sampling_mask", "true"])
    assert "repetition_penalty" in startup_error(["--replay_sampling_mask", "true", "--top_k", "5",
                                                  "--repetition_penalty", "1.2"])
    assert startup_error(["--replay_sampling_mask", "true", "--top_p", "0.9"]) is None


def test_a_filter_at_its_off_value_is_no_filter():
    """--min_p 0 (vLLM's off value; ours is None) keeps every token: no filter to replay, and vLLM's log-probs are
    exact as with none; --top_p 1 and --top_k 0 likewise."""
    for flags in (["--min_p", "0"], ["--top_p", "1"], ["--top_k", "0"]):
        cfg = config.parse_config(["--use_vllm", "--vllm_mode", "colocate", *flags])
        assert sampler_rules.active_filters(cfg) == {}, flags
        assert sampler_rules.sampler_logps_exact(cfg), flags
        assert sampler_rules.vllm_filters(cfg) == {"min_p": 0.0, "top_k": 0, "top_p": 1.0}
    assert startup_error(["--replay_sampling_mask", "true", "--min_p", "0"]) is not None  # none is set
    cfg = config.parse_config(["--min_p", "0.05", "--top_k", "7"])
    assert sampler_rules.active_filters(cfg) == {"min_p": 0.05, "top_k": 7}  # in vLLM's order


def test_vllm_processed_log_probs_count_as_exact_only_when_replayed():
    cfg = config.parse_config(["--use_vllm", "--top_k", "5", "--vllm_mode", "colocate",
                                "--temperature", "0.7"])
    assert not sampler_rules.sampler_logps_exact(cfg)
    cfg.replay_sampling_mask = True
    assert sampler_rules.sampler_logps_exact(cfg)
    assert sampler_rules.vllm_logprobs_mode(cfg) == "processed_logprobs"


@requires_vllm
def test_the_kept_set_is_vllms_on_ties_and_at_the_top_p_boundary():
    """rloo.sampling_mask against vLLM's own top-k/top-p (its pytorch path, which the CPU runs)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch
    torch.manual_seed(0)
    z = torch.randn(64, 50)
    z[:, 10:14] = z[:, 9:10]  # ties at a random rank
    z[0, :3] = torch.tensor([0.0, 0.0, -1e9]).log_softmax(-1)  # mass 0.5, 0.5: top_p = 0.5 exactly
    for top_k, top_p in [(5, 1.0), (0, 0.9), (7, 0.6), (0, 0.5), (13, 0.5)]:
        k = torch.full((64,), top_k) if top_k else None
        p = torch.full((64,), top_p) if top_p < 1 else None
        theirs = apply_top_k_top_p_pytorch(z.clone(), k, p, allow_cpu_sync=True).isfinite()
        assert torch.equal(sampling_mask(z, top_k, top_p), theirs), (top_k, top_p)


@requires_vllm
def test_lifted_refusals_vllm_corrections_and_async_accept_replayed_filters():
    vllm = ["--use_vllm", "--top_k", "5", "--temperature", "0.7",
            "--vllm_importance_sampling_correction"]
    assert "needs vLLM's log-probs" in startup_error(vllm)
    assert startup_error(vllm + ["--replay_sampling_mask", "true"]) is None
    server = ["--use_vllm", "--vllm_mode", "server", "--async_generation", "--top_p", "0.9"]
    assert "cannot report" in startup_error(server)
    assert startup_error(server + ["--replay_sampling_mask", "true"]) is None


@requires_vllm
def test_a_colocated_engine_reports_the_kept_sets_log_probs(tmp_path):
    """The embedded task on vLLM with top-k 3 at T = 1: vLLM's processed log-probs and the trainer's
    replayed ones agree (raw ones would be of the full softmax)."""
    out = run(["--use_vllm", "--top_k", "3", "--replay_sampling_mask", "true",
               "--vllm_importance_sampling_correction", "--max_steps", "2", "--logging_steps", "1",
               "--output_dir", str(tmp_path / "run")])
    assert out.returncode == 0, out.stderr[-3000:]
    for m in read_metrics(tmp_path / "run"):
        assert m["sampling/sampling_logp_difference/max"] < 1e-5
        assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(1, abs=1e-4)
        assert m["sampling/replay_boundary_flips"] < 0.01  # the same kept sets


def test_a_boundary_flip_is_counted_and_scored_over_the_kept_set_with_the_token():
    """The trainer's recomputed kept set can drop a token the sampler kept (other kernels, older
    weights): its log-prob is then over the kept set plus it, flagged in the third channel; the
    gradient through the chunked head is autograd's of that closed form."""
    torch.manual_seed(0)
    n, H, V, T = 12, 8, 30, 0.7
    head = forward.LogpsHead(torch.randint(V, (1, n)), T, replayed={"top_k": 4})
    head.lm_head = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(1, n + 1, H, requires_grad=True)
    out = head(hidden)  # [1, n, 3]
    z = hidden[0, :-1] @ head.lm_head.weight.T / T  # [n, V]
    targets = head.targets[0]
    outside = z.detach().argsort(-1, descending=True)[:, 4:].eq(targets[:, None]).any(-1)
    assert 0 < outside.sum() < n  # both kinds in the batch
    kept = sampling_mask(z.detach(), 4)
    kept[torch.arange(n), targets] = True
    want = z.gather(-1, targets[:, None])[:, 0] - z.masked_fill(~kept, -torch.inf).logsumexp(-1)
    torch.testing.assert_close(out[0, :, 0], want, rtol=0, atol=1e-5)
    assert torch.equal(out[0, :, 2], outside.float())
    got, = torch.autograd.grad(out[..., 0].sum(), hidden, retain_graph=True)
    expected, = torch.autograd.grad(want.sum(), hidden)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_boundary_flips_are_logged_none_on_policy_some_after_an_update(tmp_path):
    """On our fp32 loop the first pass recomputes the sampler's kept sets exactly: no flip (the
    padding after each completion, outside top-3, must not count); the second iteration's weights
    have moved, and some sampled tokens fall outside their kept sets."""
    out = run(["--top_k", "3", "--replay_sampling_mask", "true", "--num_iterations", "2",
               "--max_steps", "2", "--logging_steps", "1", "--output_dir", str(tmp_path)])
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = [m["sampling/replay_boundary_flips"] for m in read_metrics(tmp_path)]
    assert first == 0 and 0.01 < second < 0.9, (first, second)


def test_a_vision_language_model_records_and_trains_on_the_kept_set(tmp_path, image_dataset):
    """The VLM path (HF generate, image placeholders suppressed) with top-k 3: the recorded log-probs and the
    training forward's are both of the kept set: equal, never below the full softmax's and above it where the mass
    outside the top 3 counts; no flip on the same weights."""
    from datasets import load_dataset
    from conftest import build_vlm

    model, processor = models.load_model(build_vlm(tmp_path / "llava", "llava"), vision=True)
    rows = load_dataset("json", data_files=image_dataset, split="train")[:3]
    torch.manual_seed(0)
    batch = rollout.generate(model, processor.tokenizer, rows, gen_cfg(num_generations=2, top_k=3), CPU, processor)
    with torch.no_grad():
        replayed, _, T, _, flips = forward.forward_logps(model, batch, slice(None), 1.0)
        batch.sampling_filter = None  # the same tokens scored by the full softmax
        full, *_ = forward.forward_logps(model, batch, slice(None), 1.0)
    mask = batch.completion_mask[:, :T].bool()
    assert mask.sum() > 8
    torch.testing.assert_close(replayed[mask], batch.sampler_logps[:, :T][mask], rtol=0, atol=2e-5)
    assert (replayed[mask] >= full[mask] - 1e-5).all() and (replayed[mask] > full[mask] + 1e-3).float().mean() > 0.5
    assert flips[mask].sum() == 0
