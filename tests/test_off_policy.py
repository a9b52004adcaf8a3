"""Off-policy corrections (issue 32): TRL's sequence-level importance-sampling modes (sequence_truncate,
sequence_mask, clip_min / clip_max, the deprecated --vllm_importance_sampling_cap), DeepSeek-V3.2's off-policy
sequence mask, the flags refused with why, the sampler-mismatch metrics (TRL's names, extremes over ranks) and a
short run that logs them. Each closed form is chosen so that a flipped sign or an inverted mask gives another
number."""

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import train
from plumbing import distributed
from step import data, metrics
from rloo import importance_weights, off_policy_mask
from conftest import requires_vllm
from test_train import FAST, cfg_for, hand_built_batch, read_metrics, run

# log rho = s_old - s_sampler of four sequences: rho = 0.25, 0.5, 2, 5
LOG_RATIOS = torch.tensor([0.25, 0.5, 2.0, 5.0]).log()


def startup_error(args):
    """The one line parsing and check_config stop with for these flags, or None."""
    try:
        train.check_config(train.parse_config(args))
    except SystemExit as e:
        return str(e)
    return None


# ------------------------------------------------------------------------------------------------ the weights

def test_sequence_truncate_clamps_rho_into_clip_min_clip_max():
    """w = clamp(exp(s_old - s_sampler), C_min, C_max); rho = 1/x instead (the sign flipped) would give
    [3, 2, 0.5, 0.4]."""
    weights, outside = importance_weights(LOG_RATIOS, torch.zeros(4), "sequence_truncate", 0.4, 3.0)
    torch.testing.assert_close(weights, torch.tensor([0.4, 0.5, 2.0, 3.0]))
    assert outside.tolist() == [True, False, False, True]
    weights, outside = importance_weights(LOG_RATIOS, torch.zeros(4), "sequence_truncate", None, 3.0)
    torch.testing.assert_close(weights, torch.tensor([0.25, 0.5, 2.0, 3.0]))  # no C_min: only the top binds
    assert outside.tolist() == [False, False, False, True]


def test_sequence_mask_zeroes_the_sequences_outside_the_bounds_and_keeps_the_rest_as_they_are():
    weights, outside = importance_weights(LOG_RATIOS, torch.zeros(4), "sequence_mask", 0.4, 3.0)
    torch.testing.assert_close(weights, torch.tensor([0.0, 0.5, 2.0, 0.0]))
    assert outside.tolist() == [True, False, False, True]
    weights, _ = importance_weights(LOG_RATIOS, torch.zeros(4), "sequence_mask", 0.4, None)  # only C_min
    torch.testing.assert_close(weights, torch.tensor([0.0, 0.5, 2.0, 5.0]))
    weights, _ = importance_weights(LOG_RATIOS, torch.zeros(4), "sequence_mask", None, 3.0)
    torch.testing.assert_close(weights, torch.tensor([0.25, 0.5, 2.0, 0.0]))


def test_off_policy_mask_drops_only_negative_advantages_far_from_the_sampler():
    """DeepSeek-V3.2 eq. 9 as TRL computes it: keep unless A < 0 and mean_t (log pi_sampler - log pi) > delta.
    Row 0: A < 0, KL 1 > 0.5: dropped. Row 1: KL 0.2 per token (0.8 summed: a sum would drop it). Row 2: A > 0.
    Row 3: KL -1 (a flipped sign would drop it; its padding, 9 per token, would too if the mask were inverted).
    Row 4: A = 0 is kept, as in TRL."""
    sampler = torch.tensor([[1.0, 1.0, -9.0, -9.0], [0.2] * 4, [1.0, 1.0, 0.0, 0.0], [-1.0, -1.0, 9.0, 9.0],
                            [1.0, 1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]]).float()
    advantages = torch.tensor([-1.0, -1.0, 1.0, -1.0, 0.0])
    keep = off_policy_mask(advantages, sampler, torch.zeros_like(sampler), mask, 0.5)
    assert keep.tolist() == [False, True, True, True, True]
    # the same KL measured against a policy that moved up by as much is zero: nothing dropped
    assert off_policy_mask(advantages, sampler, sampler, mask, 0.5).all()


# ------------------------------------------------------------------------------------------------ policy_step

def step_on(model, cfg, batch, advantages):
    """One policy_step, SGD lr 1 and no gradient clipping (the update is minus the gradient) -> (the updated
    model, this step's metrics)."""
    model = copy.deepcopy(model)
    cfg.max_grad_norm = 0.0
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    scores = train.Scores(None, None, batch.completion_mask.float(), advantages)
    _, sums, grad_norm, _ = train.policy_step(cfg, model, optimizer, scheduler, batch, scores)
    step = metrics.step_metrics(distributed.reduce_sums(sums), grad_norm, scheduler, {"time/training": 1.0}, 1)
    return model, step


@pytest.fixture(scope="module")
def shifted_batch():
    """hand_built_batch (4 completions of 3, 4, 1, 4 loss tokens) whose sampler log-probs are lowered by
    LOG_RATIOS on each first token: rho_i = exp(s_i - s_i_sampler) = 0.25, 0.5, 2, 5 on-policy."""
    model, tokenizer, _ = data.embedded_task(seed=0)
    _, batch = hand_built_batch(model, tokenizer)
    batch.sampler_logps[:, 0] -= LOG_RATIOS
    return model, batch


ADVANTAGES = torch.tensor([-1.0, -2.0, 0.75, -1.5])


TRUNCATE = dict(vllm_importance_sampling_mode="sequence_truncate", vllm_importance_sampling_clip_min=0.4)
MASK = dict(vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_min=0.4)


@pytest.mark.parametrize("flags, weights, ratio_range", [
    (TRUNCATE, [0.4, 0.5, 2, 3], (0.4, 3.0)),
    (MASK, [0, 0.5, 2, 0], (0.0, 2.0)),
    # row 0: A < 0 and mean KL log(4) / 3 = 0.46 > 0.3: dropped; row 3's is -log(5) / 4 (a flipped sign drops it)
    ({**TRUNCATE, "off_policy_mask_threshold": 0.3}, [0, 0.5, 2, 3], (0.4, 3.0)),
    (dict(vllm_importance_sampling_correction=False, off_policy_mask_threshold=0.3), [0, 1, 1, 1], None),
])
def test_the_step_loss_is_minus_the_weighted_mean_advantage(shifted_batch, flags, weights, ratio_range):
    """On-policy rho == 1, so L = -(1/N) sum_i w_i A_i with w each mode's weight, computed by hand."""
    model, batch = shifted_batch
    cfg = cfg_for(**{"vllm_importance_sampling_correction": True, **flags})
    _, step = step_on(model, cfg, batch, ADVANTAGES)
    want = -(ADVANTAGES * torch.tensor(weights, dtype=torch.float32)).sum().item() / 4
    assert step["loss"] == pytest.approx(want, abs=1e-5)
    if ratio_range is not None:  # the importance weights' extremes, and the share truncated or masked
        low, high = step["sampling/importance_sampling_ratio/min"], step["sampling/importance_sampling_ratio/max"]
        assert (low, high) == pytest.approx(ratio_range, abs=1e-5)
        kind = "truncated" if "truncate" in cfg.vllm_importance_sampling_mode else "masked"
        assert step[f"sampling/importance_sampling_ratio/{kind}_fraction"] == 0.5
    else:
        assert not any(name.startswith("sampling/importance_sampling_ratio") for name in step)
    if cfg.off_policy_mask_threshold:
        assert step["sampling/off_policy_masked_fraction"] == 0.25
    # |log pi_sampler - log pi_trainer| is the shift on the first tokens: log 5 at most, over 12 loss tokens
    assert step["sampling/sampling_logp_difference/max"] == pytest.approx(math.log(5), abs=1e-5)
    mean = LOG_RATIOS.abs().sum().item() / 12
    assert step["sampling/sampling_logp_difference/mean"] == pytest.approx(mean, abs=1e-5)


def test_the_deprecated_cap_is_sequence_truncate_with_clip_max_bit_for_bit(shifted_batch):
    """--vllm_importance_sampling_cap C parses to correction, sequence_truncate, clip_max C; its update equals the
    explicit flags' to the bit and the old inline formula min(exp(s - s_sampler), C)'s closed form; --async_generation
    still gets C = 2."""
    model, batch = shifted_batch
    alias = train.parse_config(["--vllm_importance_sampling_cap", "2"])
    explicit = train.parse_config(["--vllm_importance_sampling_correction", "--vllm_importance_sampling_mode",
                                   "sequence_truncate", "--vllm_importance_sampling_clip_max", "2"])
    assert (alias.vllm_importance_sampling_correction, alias.vllm_importance_sampling_mode,
            alias.vllm_importance_sampling_clip_max, alias.vllm_importance_sampling_clip_min) == \
        (True, "sequence_truncate", 2.0, None)
    stale = train.parse_config(["--async_generation"])
    assert (stale.vllm_importance_sampling_mode, stale.vllm_importance_sampling_clip_max) == ("sequence_truncate", 2.0)
    (by_alias, alias_step), (by_flags, flags_step) = (step_on(model, c, batch, ADVANTAGES) for c in (alias, explicit))
    for p, q in zip(by_alias.parameters(), by_flags.parameters()):
        assert torch.equal(p, q)
    assert alias_step["loss"] == flags_step["loss"]
    want = -(ADVANTAGES * torch.tensor([0.25, 0.5, 2.0, 2.0])).sum().item() / 4
    assert alias_step["loss"] == pytest.approx(want, abs=1e-5)
    assert alias_step["sampling/importance_sampling_ratio/max"] == 2.0
    assert alias_step["sampling/importance_sampling_ratio/truncated_fraction"] == 0.25


# ------------------------------------------------------------------------------------------------ refusals

@pytest.mark.parametrize("args, message", [
    (["--vllm_importance_sampling_correction", "--vllm_importance_sampling_mode", "token_truncate"],
     "--vllm_importance_sampling_mode token_truncate: RLOO's loss has one ratio per sequence"),
    (["--vllm_importance_sampling_correction", "--vllm_importance_sampling_mode", "token_mask"],
     "--vllm_importance_sampling_mode token_mask: RLOO's loss has one ratio per sequence"),
    (["--use_bias_correction_kl"], "RLOO's KL sits in the reward (r = R - beta * kl) with no gradient"),
    (["--vllm_importance_sampling_cap", "2", "--vllm_importance_sampling_correction"],
     "give one of --vllm_importance_sampling_cap (deprecated) and --vllm_importance_sampling_correction"),
    (["--vllm_importance_sampling_mode", "sequence_truncate"],
     "--vllm_importance_sampling_mode sequence_truncate means nothing without --vllm_importance_sampling_correction"),
    (["--vllm_importance_sampling_correction", "--vllm_importance_sampling_clip_min", "1",
      "--vllm_importance_sampling_clip_max", "1"], "vllm_importance_sampling_clip_min=1.0 must be below"),
    (["--vllm_importance_sampling_clip_min", "1.5"], "--vllm_importance_sampling_clip_min 1.5: must be in [0, 1]"),
    (["--vllm_importance_sampling_clip_max", "0.5"], "--vllm_importance_sampling_clip_max 0.5: must be >= 1"),
    (["--off_policy_mask_threshold", "0"], "--off_policy_mask_threshold 0.0: must be > 0"),
    (["--vllm_importance_sampling_mode", "sequence"], "--vllm_importance_sampling_mode sequence: must be one of"),
])
def test_what_rloo_cannot_mean_is_one_line_saying_why(args, message):
    error = startup_error(args)
    assert error is not None and message in error and "\n" not in error, error


@requires_vllm
@pytest.mark.parametrize("flag", [["--vllm_importance_sampling_correction"], ["--off_policy_mask_threshold", "0.5"]])
def test_each_correction_needs_the_samplers_exact_log_probs(flag):
    """vLLM reports log-probs after top-k renormalisation at T != 1: neither ratio nor KL would be the trainer's."""
    error = startup_error(["--use_vllm", "--top_k", "5", "--temperature", "0.7", *flag])
    assert error is not None and f"{flag[0][2:]} needs vLLM's log-probs" in error, error


# ------------------------------------------------------------------------------------------------ metrics

def extremes_worker(rank, path):
    dist.init_process_group("gloo", init_method=f"file://{path}.store", rank=rank, world_size=2)
    sums = {"loss": torch.tensor(rank + 1.0), "max/is_weight": torch.tensor([0.5, 3.0][rank]),
            "min/is_weight": torch.tensor([0.25, 2.0][rank])}
    reduced = distributed.reduce_sums(sums)
    if rank == 0:
        torch.save(reduced, path)
    dist.destroy_process_group()


def test_maxima_and_minima_are_taken_over_ranks_beside_the_sums(tmp_path):
    path = str(tmp_path / "reduced.pt")
    mp.start_processes(extremes_worker, args=(path,), nprocs=2, start_method="fork")  # fork: no re-import
    assert torch.load(path) == {"loss": 3.0, "max/is_weight": 3.0, "min/is_weight": 0.25}


def test_a_short_run_logs_trls_sampling_metrics_also_when_old_logps_come_from_a_forward(tmp_path):
    """bf16: the KL's log pi_old come from a no-grad forward, and with two mini-batches the second step's s_old is
    stored (old_logps not None): the drift is logged on both steps, with the importance ratios (sequence_mask)."""
    out = run(FAST + ["--max_steps", "2", "--bf16", "true", "--beta", "0.1", "--per_device_train_batch_size", "8",
                      "--steps_per_generation", "2", "--vllm_importance_sampling_correction",
                      "--off_policy_mask_threshold", "0.5", "--output_dir", str(tmp_path)])
    assert out.returncode == 0, out.stderr[-3000:]
    logged = read_metrics(tmp_path)
    assert [m["step"] for m in logged] == [1, 2]
    for m in logged:
        for name in ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                     "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                     "sampling/importance_sampling_ratio/max", "sampling/importance_sampling_ratio/masked_fraction",
                     "sampling/off_policy_masked_fraction"):
            assert name in m, (name, m)
        assert m["sampling/importance_sampling_ratio/min"] <= m["sampling/importance_sampling_ratio/mean"] \
            <= m["sampling/importance_sampling_ratio/max"] <= 3.0
        assert 0 <= m["sampling/sampling_logp_difference/mean"] <= m["sampling/sampling_logp_difference/max"]
