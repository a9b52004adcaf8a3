"""Parity with Hugging Face TRL's RLOOTrainer (trl 1.16) on one identical batch.

TRL is the oracle: the same policy and reference weights, the same prompts and fixed completion ids, the same reward
function, fp32, beta > 0, num_iterations = 1, G = 4, 16 completions. Both sides run one optimizer step and we compare
  1. the KL-shaped rewards r_i = R_i - beta * kl_i (and kl_i itself),
  2. the leave-one-out advantages,
  3. the loss,
  4. the gradient of every parameter before clipping (and its global norm),
  5. every parameter after one AdamW step (same lr, betas, eps, weight decay, max_grad_norm; constant schedule).

TRL runs its own `train()` for max_steps=1, so its RepeatSampler, `_generate_and_score_completions`, `_compute_loss`,
the HF Trainer's gradient accumulation, clipping and AdamW (with its parameter groups) all run as in a real job. The
one seam is `_generate_single_turn` (prompt ids -> completion ids), which returns our fixed completions. Ours: the
Rollout as rollout.finish builds it, then train.score and train.policy_step.

On the step (5): Adam's first update is -lr * g / (|g| + eps) per element, whose derivative lr * eps / (|g| + eps)^2
is lr/eps where g ~ 0. An fp32 rounding difference of 1e-10 in a gradient element near eps = 1e-8 therefore moves
that weight by up to ~1e-2 * lr. So the step is checked twice: (5a) end to end, every weight's difference must be
explained by its measured gradient difference through that derivative; (5b) our optimizer path (clip, AdamW, schedule)
fed TRL's exact gradients must land on TRL's weights to float rounding.

Weight decay: the HF Trainer exempts biases and norm weights (Trainer.get_decay_parameter_names), and so does
models.make_optimizer; test_weight_decay_skips_bias_and_norm_weights_as_trl_does checks the step with decay on.
"""

import copy

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("accelerate")

import rollout  # noqa: E402
import train  # noqa: E402
from plumbing import models, schedule  # noqa: E402
from step import forward, prompting  # noqa: E402
from rewards import RewardFunctions  # noqa: E402

G = 4
B = 16
MAX_LEN = 8  # max_completion_length: a completion of MAX_LEN tokens without EOS is truncated
BETA = 0.05
LR = 1e-3
ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which ours uses; TRL's adam_epsilon default is the same
PROMPTS = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "abc def"}],
           [{"role": "user", "content": "copy 1234 please"}], [{"role": "user", "content": "x"}]]
# G completions per prompt (group members adjacent). Texts of MAX_LEN characters get no EOS: truncated.
COMPLETIONS = [("aab", "b", "aaaa", ""),
               ("abababab", "ca", "aaa", "cc"),  # the first is truncated
               ("1234", "a1", "ab", "a"),
               ("b", "qq", "c", "qqqqqqqq")]  # every R = 0: only the KL moves these advantages; the last truncated
TRUNCATED = [4, 15]
UNSCORABLE = [5, 7, 13, 14, 15]  # with unscorable=True: 2 scorable members left in group 2, 1 in group 4 (A = 0)


def count_a(text):
    return float(text.count("a"))


def make_reward(unscorable):
    """R = number of 'a' in the completion text: deterministic, the same function for both trainers. With
    `unscorable`, None (the reward interface's "cannot score") for texts with a 'c' or a 'q'."""
    def count_a_reward(completions, **kwargs):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [None if unscorable and ("c" in t or "q" in t) else count_a(t) for t in texts]
    return count_a_reward


def completion_id_lists(tokenizer, max_len):
    """Token ids as both samplers hand them on: cut after the first EOS (kept); a truncated one has max_len ids."""
    out = []
    for group in COMPLETIONS:
        for text in group:
            ids = tokenizer(text, add_special_tokens=False).input_ids
            out.append(ids[:max_len] if len(ids) >= max_len else ids + [tokenizer.eos_token_id])
    return out


def perturbed(model, scale, seed=1):
    """A policy that has moved away from its reference (so kl_i != 0): every weight plus seeded Gaussian noise."""
    model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return model


def patch_clipping(monkeypatch, inject=None, accelerator=None):
    """Record the gradients that reach clip_grad_norm_ (before clipping) on both sides: ours calls
    torch.nn.utils.clip_grad_norm_, the HF Trainer calls it through accelerator.clip_grad_norm_ (accelerate >= 1.16:
    through its own _clip_grad_norm_dtensor_aware). With `inject` (a list of tensors in parameter order), overwrite
    the gradients with those first. accelerator: the Trainer's, whose own clipping is patched too."""
    seen = []

    def record(parameters):
        parameters = list(parameters)
        seen.append([p.grad.detach().clone() for p in parameters])
        if inject is not None:
            for p, g in zip(parameters, inject, strict=True):
                p.grad.copy_(g)
        return parameters

    original = torch.nn.utils.clip_grad_norm_
    aware = getattr(type(accelerator), "_clip_grad_norm_dtensor_aware", None)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, *a, **k: original(record(params), *a, **k))
    if aware is not None:
        monkeypatch.setattr(type(accelerator), "_clip_grad_norm_dtensor_aware",
                            lambda self, params, *a, **k: aware(self, record(params), *a, **k))
    return seen


def run_ours(policy, ref, tokenizer, completions, opts, monkeypatch, inject=None):
    """Our step on the fixed batch. The optimizer and scheduler are built as train.main builds them."""
    model = copy.deepcopy(policy)
    cfg = train.parse_config([
        "--num_generations", str(G), "--max_completion_length", str(opts["max_len"]), "--beta", str(BETA),
        "--learning_rate", str(LR), "--lr_scheduler_type", "constant", "--weight_decay", str(opts["weight_decay"]),
        "--max_grad_norm", str(opts["max_grad_norm"]), "--per_device_train_batch_size", str(opts["micro"]),
        "--gradient_accumulation_steps", str(B // opts["micro"]), "--bf16", "false",
        "--gradient_checkpointing", "false", "--mask_truncated_completions", str(opts["mask_truncated"]).lower(),
        "--normalize_advantages", str(opts["normalize"]).lower()])
    # prompts: as rollout.generate tokenizes and pads them
    prompt_ids, prompt_mask = prompting.prompt_tensors(prompting.tokenize_prompts(tokenizer, PROMPTS),
                                                     tokenizer.pad_token_id, G, torch.device("cpu"))
    T = max(len(c) for c in completions)
    completion_ids = prompting.pad(completions, tokenizer.pad_token_id)
    batch = rollout.finish({"prompt": PROMPTS}, prompt_ids, prompt_mask, completion_ids,
                           torch.zeros(completion_ids.shape), prompting.eos_token_ids(tokenizer, model), tokenizer)
    assert batch.completion_lists == completions
    with torch.no_grad():  # the sampler's log-probs: at the first step, the policy's own (no-grad forward)
        logps, _, T_used, *_ = forward.forward_logps(model, batch, slice(None), cfg.temperature)
    assert T_used == T
    batch.sampler_logps = logps * batch.completion_mask
    out = train.score(cfg, batch, RewardFunctions([make_reward(opts["unscorable"])]), model=model, ref_model=ref,
                      step=0)

    optimizer = models.make_optimizer(model, cfg)
    scheduler = schedule.get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=0, num_training_steps=1)
    grads = patch_clipping(monkeypatch, inject)
    _, stats, grad_norm, _ = train.policy_step(cfg, model, optimizer, scheduler, batch, out)
    monkeypatch.undo()
    names = [n for n, _ in model.named_parameters()]
    return dict(prompt_ids=[ids[m == 1].tolist() for ids, m in zip(batch.prompt_ids, batch.prompt_mask)],
                truncated=batch.truncated, R=out.rewards_per_func[:, 0], kl=out.kl_sums,
                rewards=out.rewards, advantages=out.advantages,
                old_logps=(batch.sampler_logps * out.loss_mask).sum(-1), loss=stats["loss"], grad_norm=grad_norm,
                grads=dict(zip(names, grads[0])), params={n: p.detach().clone() for n, p in model.named_parameters()})


def run_trl(policy, tokenizer, completions, opts, tmp_path, monkeypatch):
    """TRL's own train() for one step, its sampler replaced by one that returns our completions. The reference is
    the one TRL builds itself: the model at policy.config._name_or_path, loaded again from disk."""
    from datasets import Dataset
    from trl import RLOOConfig, RLOOTrainer
    import trl.trainer.rloo_trainer as rloo_trainer

    args = RLOOConfig(
        output_dir=str(tmp_path / "trl"), num_generations=G, max_completion_length=opts["max_len"], beta=BETA,
        num_iterations=1, learning_rate=LR, lr_scheduler_type="constant", weight_decay=opts["weight_decay"],
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=ADAM_EPS, max_grad_norm=opts["max_grad_norm"],
        per_device_train_batch_size=opts["micro"], gradient_accumulation_steps=B // opts["micro"], max_steps=1,
        bf16=False, fp16=False, gradient_checkpointing=False, shuffle_dataset=False, use_cpu=True,
        mask_truncated_completions=opts["mask_truncated"], normalize_advantages=opts["normalize"],
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    trainer = RLOOTrainer(model=copy.deepcopy(policy), reward_funcs=[make_reward(opts["unscorable"])], args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer)
    seen = {}

    def fixed_generation(prompt_ids, images, multimodal_fields):
        seen["prompt_ids"] = [list(p) for p in prompt_ids]
        return [list(c) for c in completions]

    def recording_generate_and_score(inputs, original=trainer._generate_and_score_completions):
        seen["output"] = out = original(inputs)  # before TRL shuffles and splits it into micro-batches
        return out

    trainer._generate_single_turn = fixed_generation
    trainer._generate_and_score_completions = recording_generate_and_score
    # TRL keeps kl and the KL-shaped rewards local: catch kl at `kl = gather(kl)` (the only 1-D gather) and the
    # shaped rewards at `std_rewards = nanstd(grouped_rewards, dim=1)` (the only nanstd call with dim=1)
    gathered, grouped = [], []
    nanstd = rloo_trainer.nanstd
    monkeypatch.setattr(rloo_trainer, "gather", lambda t: gathered.append(t.clone()) or t)
    monkeypatch.setattr(rloo_trainer, "nanstd", lambda t, dim=None, **kw: (
        grouped.append(t.clone()) if dim == 1 else None) or nanstd(t, dim, **kw))
    grads = patch_clipping(monkeypatch, accelerator=trainer.accelerator)
    result = trainer.train()
    monkeypatch.undo()
    names = [n for n, _ in trainer.model.named_parameters()]
    (kl,) = [t for t in gathered if t.dim() == 1]
    (shaped,) = grouped
    out = seen["output"]
    return dict(prompt_ids=seen["prompt_ids"], kl=kl, rewards=shaped.reshape(-1), advantages=out["advantages"],
                old_logps=out["old_logps"], loss=torch.tensor(result.training_loss),
                grad_norm=torch.tensor(trainer.state.log_history[0]["grad_norm"]), grads=dict(zip(names, grads[0])),
                params={n: p.detach().clone() for n, p in trainer.model.named_parameters()},
                no_decay=[n for n in names if n not in trainer.get_decay_parameter_names(trainer.model)])


def diff(a, b):
    """(max |a - b|, max |a - b| / max |b|): the error relative to the quantity's scale. NaN (unscorable) must be
    NaN on both sides and is left out."""
    a, b = a.double(), b.double()
    assert torch.equal(a.isnan(), b.isnan())
    a, b = a[~a.isnan()], b[~b.isnan()]
    err = (a - b).abs().max().item()
    return err, err / max(b.abs().max().item(), 1e-30)


def flat(tensors, names):
    return torch.cat([tensors[n].flatten() for n in names])


def adam_excess(ours, theirs, before, max_grad_norm):
    """(5a): max over weights of |u_ours - u_trl| / bound, where u = p - p0 and bound is what the measured gradient
    difference allows through Adam's first step u = -lr * g / (|g| + eps), g the clipped gradient: by the mean value
    theorem |du| <= lr * eps * |dg| / (m + eps)^2, m = min |g| on the segment (0 where the signs differ), plus 2 ulp
    of the weight for rounding. <= 1: every parameter difference is explained by the gradients' difference."""
    clip = [min(1.0, max_grad_norm / (float(x["grad_norm"]) + 1e-6)) for x in (ours, theirs)]
    worst = 0.0
    for n in before:  # one parameter at a time: a 135M-parameter model in float64 would need ~10 GB at once
        g_o, g_t = ours["grads"][n].double() * clip[0], theirs["grads"][n].double() * clip[1]
        m = torch.where(g_o.sign() == g_t.sign(), torch.minimum(g_o.abs(), g_t.abs()), 0.0)
        p_o, p_t, p_0 = ours["params"][n].double(), theirs["params"][n].double(), before[n].double()
        rounding = 2 * torch.finfo(torch.float32).eps * (torch.maximum(p_0.abs(), p_t.abs()) + LR)  # 2 ulp, p0 + u
        bound = LR * ADAM_EPS * (g_o - g_t).abs() / (m + ADAM_EPS) ** 2 + rounding
        worst = max(worst, ((p_o - p_t).abs() / bound).max().item())
    return worst


def compare(ours, theirs, before, injected):
    names = list(before)
    update = {k: {n: x["params"][n] - before[n] for n in names} for k, x in (("o", ours), ("t", theirs))}
    # on-policy (rho = 1) the loss is -mean_i A_i, and leave-one-out advantages sum to 0 in every group: the loss is
    # 0 up to rounding on both sides, so its error is measured on the scale of the terms it averages, max |A_i|
    loss_err = (ours["loss"].double() - theirs["loss"].double()).abs().item()
    return {"kl": diff(ours["kl"], theirs["kl"]), "rewards": diff(ours["rewards"], theirs["rewards"]),
            "advantages": diff(ours["advantages"], theirs["advantages"]),
            "old_logps": diff(ours["old_logps"], theirs["old_logps"]),
            "loss": (loss_err, loss_err / theirs["advantages"].abs().max().item()),
            "grad_norm": diff(ours["grad_norm"], theirs["grad_norm"]),
            "grads": diff(flat(ours["grads"], names), flat(theirs["grads"], names)),
            "params": diff(flat(ours["params"], names), flat(theirs["params"], names)),
            "update": diff(flat(update["o"], names), flat(update["t"], names)),
            "update_same_grads": diff(flat(injected["params"], names) - flat(before, names),
                                      flat(update["t"], names))}


def setup(model_dir, opts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = perturbed(ref, opts["noise"]) if opts["noise"] else copy.deepcopy(ref)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    return tokenizer, ref, policy, before, completion_id_lists(tokenizer, opts["max_len"])


def parity(model_dir, tmp_path, monkeypatch, opts):
    """Both steps on the same batch -> (ours, TRL's, weights before, ours fed TRL's gradients, differences)."""
    tokenizer, ref, policy, before, completions = setup(model_dir, opts)
    theirs = run_trl(policy, tokenizer, completions, opts, tmp_path, monkeypatch)
    ours = run_ours(policy, ref, tokenizer, completions, opts, monkeypatch)
    injected = run_ours(policy, ref, tokenizer, completions, opts, monkeypatch,
                        inject=[theirs["grads"][n] for n in before])
    assert theirs["prompt_ids"] == ours["prompt_ids"]  # TRL's apply_chat_template(tokenize=True) == ours
    return ours, theirs, before, injected, compare(ours, theirs, before, injected)


BASE = dict(max_len=MAX_LEN, weight_decay=0.0, max_grad_norm=1.0, micro=16, mask_truncated=False, normalize=False,
            noise=0.0, unscorable=False)
CASES = {
    # reference = the initial policy, as at the first step of training: kl_i = 0 exactly on both sides
    "ref_is_policy": BASE,
    # the policy has drifted from the reference, so kl_i != 0 shapes the rewards; 2 micro-steps of 8 (gradient
    # accumulation), truncated completions masked, advantages normalized over the batch, unscorable completions
    "drifted_ga2_masked_normalized_unscorable": {**BASE, "noise": 0.02, "micro": 8, "mask_truncated": True,
                                                 "normalize": True, "unscorable": True},
}


def report(case, d):
    print(f"\n{case}: " + ", ".join(f"{k} {a:.1e} ({r:.1e})" for k, (a, r) in d.items()))


@pytest.mark.parametrize("case", list(CASES))
def test_one_step_matches_trl_rloo_trainer(chat_model_dir, tmp_path, monkeypatch, case):
    opts = CASES[case]
    ours, theirs, before, injected, d = parity(chat_model_dir, tmp_path, monkeypatch, opts)
    report(case, d)
    # the batch is what it was meant to be: rewards that vary, truncated rows, (drifted) a real KL, binding clip
    R = torch.tensor([count_a(t) for g in COMPLETIONS for t in g])
    if opts["unscorable"]:
        R[UNSCORABLE] = torch.nan
        assert theirs["advantages"][12:].eq(0).all()  # group 4: a single scorable member has no baseline
    assert torch.equal(ours["R"].isnan(), R.isnan()) and torch.equal(ours["R"].nan_to_num(), R.nan_to_num())
    assert ours["truncated"].nonzero().view(-1).tolist() == TRUNCATED
    assert (ours["kl"].abs().max() > 0.1) if opts["noise"] else (ours["kl"].abs().max() == 0)
    if opts["mask_truncated"]:  # no KL for them (their reward still enters the baselines)
        assert ours["kl"][TRUNCATED].eq(0).all() and theirs["kl"][TRUNCATED].eq(0).all()
    assert ours["grad_norm"] > 10 * opts["max_grad_norm"]
    for name in ("kl", "rewards", "advantages", "old_logps", "loss", "grad_norm", "grads"):
        assert d[name][1] < 1e-5 or d[name][0] == 0, (name, d[name])
    assert adam_excess(ours, theirs, before, opts["max_grad_norm"]) <= 1.0  # (5a)
    assert d["update_same_grads"][0] < 1e-6 * LR, d["update_same_grads"]  # (5b)


def test_weight_decay_skips_bias_and_norm_weights_as_trl_does(chat_model_dir, tmp_path, monkeypatch):
    """The HF Trainer builds AdamW with two groups: weight_decay for most weights, 0 for biases and norm weights
    (Trainer.get_decay_parameter_names: names matching bias, layernorm, rmsnorm, norm); so does make_optimizer.
    From the same gradients, with weight decay 0.1, ours lands on TRL's weights to rounding, every parameter."""
    opts = {**BASE, "weight_decay": 0.1}
    tokenizer, ref, policy, before, completions = setup(chat_model_dir, opts)
    theirs = run_trl(policy, tokenizer, completions, opts, tmp_path, monkeypatch)
    injected = run_ours(policy, ref, tokenizer, completions, opts, monkeypatch,
                        inject=[theirs["grads"][n] for n in before])
    no_decay = theirs["no_decay"]
    assert any("bias" in n for n in no_decay) and any("norm" in n for n in no_decay)
    for n in before:
        gap = injected["params"][n] - theirs["params"][n]
        rounding = 2 * torch.finfo(torch.float32).eps * (before[n].abs() + LR)  # 2 ulp of p0 + u
        assert (gap.abs() <= rounding).all(), n
