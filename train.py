"""RLOO fine-tuning of a causal language model: setup, the algorithm's step functions, the training loop.

Run the embedded default (a tiny model learns a toy task on CPU in a few minutes, no network):
    python train.py
    torchrun --standalone --nproc_per_node=2 train.py
A real model and dataset (one node, 8 GPUs; FSDP2 shards policy and reference):
    torchrun --standalone --nproc_per_node=8 train.py --model Qwen/Qwen2-0.5B-Instruct \
        --dataset trl-lib/DeepMath-103K --reward_funcs accuracy_reward --output_dir runs/deepmath
Every flag: python train.py --help (config.py). Export a checkpoint: python train.py export CHECKPOINT [OUT_DIR].

One step (Ahmadian et al. 2024, §3): sample G completions for each of P prompts per rank -> score them -> shape the
reward with the sequence KL to the reference, r = R - beta * kl -> leave-one-out advantages A_i = r_i - mean_{j != i}
r_j -> mu optimizer steps on L = -mean_i min(rho_i A_i, clip(rho_i) A_i), rho_i = exp(s_i - s_i_old).
The math is rloo.py; this file says when it runs and on what. Everything else lives where its concept does: config.py,
data.py, models.py, rollout.py (and vllm_rollout.py), rewards.py, metrics.py, checkpoint.py, distributed.py.
"""

import dataclasses
import logging
import math
import os
import sys

# bitsandbytes (imported by peft, imported by transformers' schedulers) notes at import that its fast CPU 4-bit
# kernel is missing, in every run; it matters only to --load_in_4bit (models.loading says it there)
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

import torch
from torch.distributed.fsdp import FSDPModule
from transformers import get_scheduler

import checkpoint
import data
import distributed
import lora
import models
import rewards as rewards_lib
import rollout
from batches import batch_source
from config import EMBEDDED_PRESET, Config, check_config, fail, parse_config  # noqa: F401 (tests use them)
from metrics import Logger, generation_metrics, show_samples, timed
from models import load_model, loading, make_optimizer, prepare_model
from rloo import combine_rewards, has_baseline, normalize_advantages, rloo_advantages, rloo_loss, sequence_kl


# ---------------------------------------------------------------------------------------------------------------
# Setup: models, rewards, the generator, the number of steps
# ---------------------------------------------------------------------------------------------------------------

def load_models(cfg, dataset, eval_dataset, vision, device):
    """Policy (with --use_peft: with a LoRA adapter), frozen reference (only when beta > 0, and not with LoRA, whose
    reference is the policy with its adapter off), tokenizer and, for a vision-language run, the processor (it owns
    the chat template and the image processor). Without --model the embedded task supplies the model and, unless
    --dataset is given, the dataset. -> (model, ref, tokenizer, processor or None, dataset)"""
    separate_ref = cfg.beta > 0 and not cfg.use_peft
    if cfg.model is None:
        model, tokenizer, embedded_dataset = data.embedded_task(cfg.seed)
        ref_model = data.embedded_task(cfg.seed)[0] if separate_ref else None
        dataset = embedded_dataset if dataset is None else dataset
    else:
        model, tokenizer = load_model(cfg.model, vision, **loading(cfg))
        ref_model = load_model(cfg.model, vision, **loading(cfg))[0] if separate_ref else None
    processor = tokenizer if vision else None
    tokenizer = processor.tokenizer if vision else tokenizer
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    data.check_data(dataset, tokenizer, processor, model, cfg)
    if eval_dataset is not None:
        data.check_data(eval_dataset, tokenizer, processor, model, cfg, "eval split")
    if cfg.use_peft:
        model = lora.add_adapter(model, lora.settings(cfg))
    model = prepare_model(model, cfg, trainable=True, device=device)
    if ref_model is not None:
        ref_model = prepare_model(ref_model, cfg, trainable=False, device=device)
    return model, ref_model, tokenizer, processor, dataset


def load_rewards(cfg, device):
    """--reward_funcs -> functions; reward models are placed and sharded like the reference model."""
    funcs = []
    for spec in cfg.reward_funcs:
        try:
            funcs.append(rewards_lib.load_reward_func(spec, lambda m: prepare_model(m, cfg, False, device), device))
        except ValueError as e:
            fail(str(e))
    return funcs


def start_generator(cfg, model, tokenizer, processor, dataset, device):
    """The generator, chosen once: (generate(rows, seed) -> batch, stop(), push_weights()). Our decode loop over the
    policy, or vLLM colocated or as a server (it pushes the new weights, and wakes and sleeps, inside each call,
    except with --async_generation: batches.py pushes)."""
    if cfg.use_vllm:
        import vllm_rollout

        max_images = data.max_images_per_row(dataset) if processor else 0
        longest = None if processor else data.longest_prompt(dataset, tokenizer, cfg)  # images add tokens
        max_model_len = longest and longest + cfg.max_completion_length
        generate, stop, push = vllm_rollout.start(cfg, model, tokenizer, processor, device, max_images, max_model_len)
    else:
        generate, stop, push = rollout.hf_generator(cfg, model, tokenizer, processor, device), None, None
    torch.manual_seed(cfg.seed + distributed.rank())  # each rank samples different completions for its prompts
    return rows_generator(generate, tokenizer, processor), stop or (lambda: None), push


def rows_generator(generate, tokenizer, processor):
    """generate(prompts, images, seed) -> generate(rows, seed): this step's rows (prompts, and images for a
    vision-language run) to the batch dict of rollout.generate, with the completions decoded as batch["texts"]."""
    def generate_rows(rows, seed=None):
        batch = generate(rows["prompt"], data.row_images(rows) if processor else None, seed)
        batch["texts"] = tokenizer.batch_decode(batch["completion_lists"], skip_special_tokens=True)
        return batch
    return generate_rows


def eval_config(cfg):
    """Evaluation's settings: num_generations_eval completions per prompt (default num_generations)."""
    return dataclasses.replace(cfg, num_generations=cfg.num_generations_eval or cfg.num_generations)


def eval_generator(cfg, model, tokenizer, processor, device):
    """Evaluation samples with our decode loop, whatever generates for training."""
    return rows_generator(rollout.hf_generator(eval_config(cfg), model, tokenizer, processor, device), tokenizer,
                          processor)


def count_steps(cfg, dataset):
    """Optimizer steps of the run: max_steps, or num_train_epochs passes over the prompts, mu steps per batch."""
    if cfg.max_steps > 0:
        return cfg.max_steps
    return math.ceil(cfg.num_train_epochs * data.steps_per_epoch(dataset, cfg)) * cfg.num_iterations


def make_optimization(cfg, model, dataset):
    """AdamW over the trainable parameters, the learning-rate schedule, and the run's number of optimizer steps."""
    total_steps, optimizer = count_steps(cfg, dataset), make_optimizer(model, cfg)
    scheduler = get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=int(cfg.warmup_ratio * total_steps),
                              num_training_steps=total_steps)
    return optimizer, scheduler, total_steps


# ---------------------------------------------------------------------------------------------------------------
# The algorithm: score a generated batch, then update the policy on it
# ---------------------------------------------------------------------------------------------------------------

def old_logps_from_sampler(cfg, vision=False):
    """The KL's log pi_old: the sampler's own log-probs where they are exactly the trainer's, i.e. log pi_T computed
    in fp32 (rollout.sampler_logps_exact); in bf16 the sampler's and the trainer's kernels differ (0.03-0.05 nats per
    token on SmolLM2-135M), so, as with vLLM's penalised or filtered log-probs, a no-grad forward of the policy
    computes them (TRL's scoring pass, one more forward per step). So it does with --async_generation: the sampler's
    are of older weights."""
    return rollout.sampler_logps_exact(cfg, vision) and not models.low_precision(cfg) and not cfg.async_generation


def score(cfg, batch, rows, reward_funcs, model, ref_model, step):
    """Rewards, KL-shaped rewards and leave-one-out advantages of one generated batch (paper §3).

    Returns a dict: rewards_per_func [B, K] (NaN = None), rewards [B] (after clip and KL), kl_sums [B] or None,
    loss_mask [B, T], advantages [B], timings, and with beta > 0 the KL's old_logps and ref_logps [B, T].
    """
    G, timings = cfg.num_generations, {}
    loss_mask = batch["completion_mask"].float()  # [B, T]
    if cfg.mask_truncated_completions:  # no gradient and no KL; they still count in the mean and the baselines
        loss_mask = loss_mask * (~batch["truncated"]).float()[:, None]
    with timed(timings, "time/rewards"):  # R = sum_k w_k R_k over the functions that scored, then clipped
        rewards_per_func = batch.get("rewards_per_func")  # dynamic sampling scored them already
        if rewards_per_func is None:
            rewards_per_func = rewards_lib.call_rewards(reward_funcs, rows, batch, G, step, cfg.reward_timeout)
        weights = rewards_lib.reward_weights(cfg, reward_funcs).to(loss_mask.device)
        rewards = combine_rewards(rewards_per_func, weights, cfg.reward_clip_range)  # [B]
    kl_sums, logps = None, {}
    with timed(timings, "time/reference"):
        if cfg.beta > 0:  # r = R - beta * kl, k1 with log pi_old the sampler's where exact (paper §3)
            logps["old_logps"] = (batch["sampler_logps"] if old_logps_from_sampler(cfg, "pixel_inputs" in batch)
                                  else rollout.batch_logps(model, batch, cfg))  # [B, T]
            with lora.reference(model, ref_model) as reference:
                logps["ref_logps"] = rollout.batch_logps(reference, batch, cfg)  # [B, T]
            kl_sums = sequence_kl(logps["old_logps"], logps["ref_logps"], loss_mask)  # [B]
            rewards = rewards - cfg.beta * kl_sums
        advantages = rloo_advantages(rewards, G)  # [B]  A_i = r_i - mean_{j != i} r_j
        if cfg.normalize_advantages:  # over the global batch: every rank normalizes the same gathered vector
            everyone = distributed.gather({"advantages": advantages, "scored": has_baseline(rewards, G).float()})
            advantages = normalize_advantages(everyone["advantages"], everyone["scored"].bool())
            advantages = advantages.view(distributed.world_size(), -1)[distributed.rank()]
    return dict(rewards_per_func=rewards_per_func, rewards=rewards, kl_sums=kl_sums, loss_mask=loss_mask,
                advantages=advantages, timings=timings, **logps)


def policy_step(cfg, model, optimizer, scheduler, batch, scored, old_logps=None):
    """One optimizer step on the clipped sequence loss over the batch, in micro-batches of per_device_train_batch_size
    (gradient accumulation: the loss is the mean over all of the step's sequences, on every rank; paper §3).

    old_logps None: on-policy pass, s_old = s.detach() so rho == 1 (README 'Where we differ from TRL').
    Returns the sequence log-probs s [B] (the s_old of later passes), this rank's sums for the metrics (named
    scalars), the global gradient norm (non-finite: the optimizer step was skipped) and the phase timings.
    """
    loss_mask, advantages = scored["loss_mask"], scored["advantages"]
    eps_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    mbs = micro_batches_of(cfg, len(advantages))
    sums = {name: advantages.new_zeros(()) for name in ("loss", "clipped_low", "clipped_high", "entropy", "tokens",
                                                         "sequences")}
    if old_logps is None and "sampler_logps" in batch:
        sums["sampler_drift"] = advantages.new_zeros(())  # |log pi_sampler - log pi_trainer| per token
    if cfg.vllm_importance_sampling_cap:
        sums.update(is_weight=advantages.new_zeros(()), is_truncated=advantages.new_zeros(()))
    seq_logps_all, timings = [], {}
    with timed(timings, "time/forward_backward"):
        for i, mb in enumerate(mbs):
            if isinstance(model, FSDPModule):  # reduce-scatter gradients once, on the last micro-step
                model.set_requires_gradient_sync(i == len(mbs) - 1)
            logps, entropy, T = rollout.forward_logps(model, batch, mb, cfg.temperature)  # [b, T]
            mask = loss_mask[mb, :T]
            seq_logps = (logps * mask).sum(-1)  # [b]  s_i = sum_t log pi(o_t)
            seq_old = seq_logps.detach() if old_logps is None else old_logps[mb]
            # the generator's log-probs (the trainer's own where it reports none)
            sampler_logps = batch["sampler_logps"][mb, :T] if "sampler_logps" in batch else logps.detach()
            is_weights = None
            if cfg.vllm_importance_sampling_cap:  # truncated IS: the batch came from the generator, not this policy
                ratio = torch.exp(seq_old - (sampler_logps * mask).sum(-1))  # [b]  pi_trainer / pi_sampler
                is_weights = ratio.clamp(max=cfg.vllm_importance_sampling_cap)
                sums["is_weight"] += is_weights.sum()
                sums["is_truncated"] += (ratio > cfg.vllm_importance_sampling_cap).float().sum()
            loss, low, high = rloo_loss(seq_logps, seq_old, advantages[mb], cfg.epsilon, eps_high, len(advantages),
                                        is_weights)
            loss.backward()
            seq_logps_all.append(seq_logps.detach())
            for name, value in [("loss", loss.detach()), ("clipped_low", low.sum()), ("clipped_high", high.sum()),
                                ("entropy", (entropy * mask).sum()), ("tokens", mask.sum()),
                                ("sequences", mask.new_tensor(float(len(mask))))]:
                sums[name] += value.float()
            if "sampler_drift" in sums:
                sums["sampler_drift"] += ((sampler_logps - logps.detach()).abs() * mask).sum()
    with timed(timings, "time/optimizer"):
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
            grad_norm = grad_norm.full_tensor()
        if torch.isfinite(grad_norm):  # the global norm, so every rank takes the same branch; NaN/inf: skip
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return torch.cat(seq_logps_all), sums, grad_norm, timings


def micro_batches_of(cfg, batch_size):
    return rollout.micro_batches(batch_size, cfg.per_device_train_batch_size)


def update(cfg, model, optimizer, scheduler, batch, scored):
    """mu = num_iterations optimizer steps on one generated batch; yields each step's (sums over all ranks, grad norm,
    timings). s_old is stored by the first pass (the sampler's weights) and reused, so for mu > 1 the clipped
    surrogate matters; for mu == 1 this is REINFORCE with the leave-one-out baseline (rho == 1)."""
    old_logps = None
    for _ in range(cfg.num_iterations):
        timings = {}
        with timed(timings, "time/training"):
            seq_logps, sums, grad_norm, step_timings = policy_step(cfg, model, optimizer, scheduler, batch, scored,
                                                                   old_logps)
        old_logps = seq_logps if old_logps is None else old_logps
        yield distributed.reduce_sums(sums), grad_norm, {**step_timings, **timings}


# ---------------------------------------------------------------------------------------------------------------
# Metrics of a step, and evaluation
# ---------------------------------------------------------------------------------------------------------------

def sample_metrics(cfg, batch, scored, reward_funcs, timings):
    """The generated batch's metrics over all ranks (README 'Metrics'), and its prompt + completion tokens."""
    columns = distributed.gather({
        "rewards_per_func": scored["rewards_per_func"].T, "rewards": scored["rewards"],
        "lengths": batch["completion_mask"].sum(-1).float(), "truncated": batch["truncated"].float(),
        "kl_sums": scored["kl_sums"], "loss_tokens": scored["loss_mask"].sum(-1),
        "tokens": (batch["prompt_mask"].sum(-1) + batch["completion_mask"].sum(-1)).float()})  # [world * B] each
    columns["rewards_per_func"] = columns["rewards_per_func"].T  # [world * B, K]
    names = [rewards_lib.reward_name(f) for f in reward_funcs]
    weights = rewards_lib.reward_weights(cfg, reward_funcs).to(columns["rewards"].device)
    metrics = generation_metrics(columns, names, weights, cfg.num_generations)
    metrics.update({**timings, **batch.get("timings", {}), **scored["timings"]})
    metrics["tokens_per_second/generation"] = columns["lengths"].sum().item() / timings["time/generation"]
    return metrics, columns["tokens"].sum().item()


def train_metrics(sums, grad_norm, scheduler, timings, batch_tokens):
    """One optimizer step's metrics from the sums over all ranks (TRL's names)."""
    tokens, sequences = max(sums["tokens"], 1), sums["sequences"]
    metrics = {"loss": sums["loss"] / distributed.world_size(), "grad_norm": grad_norm.item(),
               "learning_rate": scheduler.get_last_lr()[0], "entropy": sums["entropy"] / tokens,
               "clip_ratio/low_mean": sums["clipped_low"] / sequences,
               "clip_ratio/high_mean": sums["clipped_high"] / sequences,
               "clip_ratio/region_mean": (sums["clipped_low"] + sums["clipped_high"]) / sequences,
               "nonfinite_skipped": float(not torch.isfinite(grad_norm)), **timings,
               "tokens_per_second/training": batch_tokens / timings["time/training"]}
    if "sampler_drift" in sums:
        metrics["sampling/sampling_logp_difference/mean"] = sums["sampler_drift"] / tokens
    if "is_weight" in sums:  # truncated importance sampling (TRL's names)
        metrics["sampling/importance_sampling_ratio/mean"] = sums["is_weight"] / sequences
        metrics["sampling/importance_sampling_ratio/truncated_fraction"] = sums["is_truncated"] / sequences
    return metrics


def completions_table(cfg, step, rows, batch, scored, reward_funcs):
    """--log_completions: (columns, rows) of (step, prompt, completion, each reward, advantage)."""
    names, G = [rewards_lib.reward_name(f) for f in reward_funcs], cfg.num_generations
    table = [[step, p, c, *r, a] for p, c, r, a in zip([p for p in rows["prompt"] for _ in range(G)], batch["texts"],
                                                       scored["rewards_per_func"].tolist(),
                                                       scored["advantages"].tolist())]
    return ["step", "prompt", "completion", *names, "advantage"], table


@torch.no_grad()
def evaluate(cfg, generate, dataset, reward_funcs, step):
    """Sample G completions for every eval prompt and score them: the generation metrics, prefixed eval_.

    Each rank takes its share of every chunk of prompts; indices wrap so all ranks call generate equally often
    (FSDP2 all-gathers in lockstep), and the wrapped duplicates are dropped before the metrics.
    """
    cfg = eval_config(cfg)
    G, n, chunks = cfg.num_generations, len(dataset), []
    P, rank, world_size = max(1, data.prompts_per_rank(cfg)), distributed.rank(), distributed.world_size()
    for start in range(0, n, P * world_size):
        index = [start + rank * P + j for j in range(P)]
        rows = dataset[[i % n for i in index]]
        batch = generate(rows)
        rewards_per_func = batch.get("rewards_per_func")  # dynamic sampling scored them already
        if rewards_per_func is None:
            rewards_per_func = rewards_lib.call_rewards(reward_funcs, rows, batch, G, step, cfg.reward_timeout)
        valid = torch.tensor([i < n for i in index for _ in range(G)], device=rewards_per_func.device)
        chunks.append({"rewards_per_func": rewards_per_func.T, "lengths": batch["completion_mask"].sum(-1).float(),
                       "truncated": batch["truncated"].float(), "valid": valid.float()})
    columns = distributed.gather({k: torch.cat([c[k] for c in chunks], -1) for k in chunks[0]})  # [..., all]
    keep = columns.pop("valid") > 0  # drop the wrapped duplicates (whole groups: a group shares its prompt index)
    columns = {k: v[..., keep] for k, v in columns.items()}
    columns["rewards_per_func"] = columns["rewards_per_func"].T  # [completions, K]
    weights = rewards_lib.reward_weights(cfg, reward_funcs).to(keep.device)
    columns["rewards"] = combine_rewards(columns["rewards_per_func"], weights, cfg.reward_clip_range)
    names = [rewards_lib.reward_name(f) for f in reward_funcs]
    return {f"eval_{k}": v for k, v in generation_metrics(columns, names, weights, G).items()}


class RunHealth:
    """What makes a run meaningless, each stopped with one line: optimizer steps in a row with a NaN/inf gradient
    (each was skipped), generated batches in a row that no reward function scored (all None: no signal, a warning
    the first time), and at the end a run in which no step updated the weights (nothing is saved as trained)."""

    def __init__(self, cfg):
        self.cfg, self.nonfinite, self.unscored, self.updated = cfg, 0, 0, 0

    def scored(self, reward, step):
        """reward: the global batch's mean reward, NaN when every function returned None for every completion."""
        self.unscored = self.unscored + 1 if math.isnan(reward) else 0
        if self.unscored == 1 and distributed.is_main():
            print(f"rloo: WARNING: step {step}: every reward function returned None for every completion: this batch "
                  "has no learning signal", file=sys.stderr)
        if self.unscored >= self.cfg.max_nonfinite_steps:
            fail(f"{self.unscored} batches in a row were scored by no reward function (all None): check that the "
                 "reward functions apply to this dataset (their columns, their answer format)")

    def stepped(self, grad_norm):
        finite = bool(torch.isfinite(grad_norm))
        self.updated += finite
        self.nonfinite = 0 if finite else self.nonfinite + 1
        if self.nonfinite >= self.cfg.max_nonfinite_steps:
            fail(f"{self.nonfinite} optimizer steps in a row had a NaN/inf gradient (all skipped); stopping. The last "
                 f"checkpoint in {self.cfg.output_dir!r} is intact. Check rewards and learning rate.")

    def check_trained(self, steps):
        if steps and not self.updated:
            fail(f"none of the {steps} optimizer steps updated the weights (every gradient was NaN/inf, so each was "
                 "skipped): nothing is saved as a trained model. Check the rewards' scale, --beta and "
                 "--learning_rate")


def announce(cfg, model, device, total_steps):
    if distributed.is_main():
        completions = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * distributed.world_size()
        print(f"rloo: {distributed.world_size()} process(es) on {device}, "
              f"{sum(p.numel() for p in model.parameters()):,} params per rank "
              f"({sum(p.numel() for p in model.parameters() if p.requires_grad):,} trainable), "
              f"{completions} completions/step, {total_steps} steps -> {cfg.output_dir}")


def finish(cfg, model, saver, stopped, step, logger):
    """After the loop: the logs closed, then how to resume a stopped run, or the final model in Hugging Face format."""
    logger.close()
    if stopped:
        if distributed.is_main():
            print(f"rloo: stopped by a signal: saved checkpoint-{step} in {cfg.output_dir}; resume with "
                  "--resume_from_checkpoint latest")
        return
    if cfg.load_in_4bit:  # merged into the full-precision base, from the final checkpoint, as export does
        if distributed.is_main():
            checkpoint.export_checkpoint(checkpoint.checkpoint_dirs(cfg.output_dir)[-1], cfg.output_dir)
    else:
        checkpoint.save_hf(model, saver, cfg.output_dir)
    if distributed.is_main():
        print(f"rloo: metrics in {os.path.join(cfg.output_dir, 'metrics.jsonl')}, final model in {cfg.output_dir}")


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:
        return checkpoint.export_checkpoint(argv[1], argv[2] if len(argv) > 2 else argv[1] + "-hf")
    cfg = parse_config(argv)
    device = distributed.setup_distributed(cfg.ddp_timeout)
    check_config(cfg)
    dataset, eval_dataset, vision = data.load_datasets(cfg)  # the data first: cheaper to find out it is wrong
    model, ref_model, tokenizer, processor, dataset = load_models(cfg, dataset, eval_dataset, vision, device)
    reward_funcs = load_rewards(cfg, device)
    generate, stop_generator, push_weights = start_generator(cfg, model, tokenizer, processor, dataset, device)
    generate_eval = eval_generator(cfg, model, tokenizer, processor, device)
    optimizer, scheduler, total_steps = make_optimization(cfg, model, dataset)
    state = checkpoint.start(cfg, model, optimizer, scheduler, ref_model)  # step, num_tokens, window, data position
    stop_signal, health = checkpoint.watch_signals(device), RunHealth(cfg)  # a flag set by SIGTERM or Ctrl-C
    announce(cfg, model, device, total_steps)
    logger = Logger(cfg, total_steps, state)
    next_batch, source_state, stop_source = batch_source(cfg, generate, push_weights, dataset, reward_funcs,
                                                        tokenizer.pad_token_id, state)
    step, num_tokens, saved_step, stopped = state["step"], state["num_tokens"], state["step"], False

    while step < total_steps and not stopped:
        timings = {}
        # ======== 1. Sample: G completions for each of this rank's P prompts (rows: their dataset columns) ========
        with timed(timings, "time/generation"):
            rows, batch, source_metrics = next_batch(step)
        # ======== 2. Score: R, the KL-shaped r = R - beta * kl, leave-one-out advantages A ========
        scored = score(cfg, batch, rows, reward_funcs, model, ref_model, step)
        sampled, batch_tokens = sample_metrics(cfg, batch, scored, reward_funcs, {**timings, **source_metrics})
        num_tokens += batch_tokens  # once per generated batch, however many passes train on it
        health.scored(sampled["reward"], step)
        if step == 0:
            show_samples("before training", rows, batch, scored, cfg.num_generations)
        # ======== 3. Update: mu passes over the batch, one optimizer step each ========
        for iteration, (sums, grad_norm, timings) in enumerate(update(cfg, model, optimizer, scheduler, batch, scored)):
            step += 1
            models.sync_reference(cfg, model, ref_model, step)  # TR-DPO, with --sync_ref_model
            logger.add_step({**(sampled if iteration == 0 else {}),
                             **train_metrics(sums, grad_norm, scheduler, timings, batch_tokens)})
            if logger.log_if_due(step, num_tokens=num_tokens) and cfg.log_completions:
                logger.completions(step, *completions_table(cfg, step, rows, batch, scored, reward_funcs))
            if eval_dataset is not None and step % cfg.eval_steps == 0:
                logger.write(step, evaluate(cfg, generate_eval, eval_dataset, reward_funcs, step))
            health.stepped(grad_norm)
            if step >= total_steps:
                break
        # ======== checkpoint: every save_steps, at the end, and on SIGTERM or Ctrl-C (between generations) ========
        stopped = checkpoint.stop_requested(stop_signal)
        if stopped or checkpoint.save_due(cfg, step, saved_step, total_steps):
            checkpoint.save_checkpoint(cfg, model, optimizer, scheduler, dict(
                step=step, num_tokens=num_tokens, window=logger.window, **source_state()), vision, ref_model)
            saved_step = step

    if not stopped and step > state["step"]:
        health.check_trained(step - state["step"])
        show_samples("after training", rows, batch, scored, cfg.num_generations)
    finish(cfg, model, processor or tokenizer, stopped, step, logger)
    stop_source()  # joins the generation thread of async generation
    stop_generator()  # a colocated engine tears down torch.distributed's group itself: it goes first
    distributed.shutdown()


if __name__ == "__main__":
    main()
