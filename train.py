"""RLOO fine-tuning of a causal language model: setup, the algorithm's step functions, the loop.

Run the embedded default (a tiny model learns a toy task on CPU in under a minute, no network):
    python train.py
    torchrun --standalone --nproc_per_node=2 train.py
A real model and dataset (one node, 8 GPUs; FSDP2 shards policy and reference):
    torchrun --standalone --nproc_per_node=8 train.py --model Qwen/Qwen2-0.5B-Instruct \\
        --dataset trl-lib/DeepMath-103K --reward_funcs accuracy_reward --output_dir runs/deepmath
Every flag: python train.py --help (plumbing/config.py). Export a checkpoint: python train.py export
CKPT [OUT].

One step (Ahmadian et al. 2024, §3): sample G completions for each of P prompts per rank -> score
them -> shape the reward with the sequence KL to the reference, r = R - beta * kl -> leave-one-out
advantages A_i = r_i - mean_{j != i} r_j -> mu optimizer steps on L = -mean_i min(rho_i A_i,
clip(rho_i) A_i), rho_i = exp(s_i - s_i_old).

The math is rloo.py; this file says when it runs and on what. Everything else lives where its
concept does (README 'Files'): plumbing/config.py (flags), step/data.py (prompts),
plumbing/models.py (loading, FSDP2), options/lora.py, rollout.py (our decode loop) and
options/vllm_rollout.py, step/batches.py (the Rollout batch and where a step's batch comes from),
step/forward.py (the training forward), rewards.py, step/metrics.py, plumbing/logs.py,
plumbing/checkpoint.py, plumbing/process.py (what a run borrows from its process), plumbing/stack.py
(the versions and device). From Python: train.main([...flags]) -> Result (README 'Sweeps').
"""

import dataclasses
import logging
import sys
from collections import defaultdict
from contextlib import closing

# bitsandbytes (imported by peft, imported by transformers' schedulers) notes at import that its
# fast CPU 4-bit kernel is missing, in every run; it matters only to --load_in_4bit (models says so)
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

import torch  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402

import rollout  # noqa: E402
from options import environments, lora, packing, vllm_rollout  # noqa: E402
from plumbing import (checkpoint, directories, distributed, models, process, schedule,  # noqa: E402
                      stack)
from step import data, forward, prompting, sampler, sampler_rules  # noqa: E402
from step.batches import BatchSource, Scores  # noqa: E402
from plumbing.checks import check_config  # noqa: E402
from plumbing.config import EMBEDDED_PRESET, Config, Failed, fail, parse_config  # noqa: E402, F401
from options.evaluation import Clock, eval_config, evaluate  # noqa: E402
from plumbing.health import RunHealth  # noqa: E402
from plumbing.logs import Logger  # noqa: E402
from step.metrics import (batch_metrics, completions_table, loss_sums,  # noqa: E402
                          sampling_sums, show_samples, step_metrics, timed)
from rewards import load_rewards  # noqa: E402
from rloo import (estimate_advantages, has_baseline,  # noqa: E402
                  normalize_advantages, rloo_loss, sequence_kl)


# ---------------------------------------------------------------------------------------------
# Setup: models, the generator, the number of steps
# ---------------------------------------------------------------------------------------------

def load_models(cfg, dataset, eval_sets, vision, device):
    """Policy (with --use_peft: with a LoRA adapter), frozen reference (only when beta > 0, and not
    with LoRA, whose reference is the policy with its adapter off), tokenizer and, for a
    vision-language run, the processor (it owns the chat template and the image processor). Without
    --model the embedded task supplies the model and, unless --dataset is given, the dataset.
    -> (model, ref_model, tokenizer, processor or None, dataset)"""
    separate_ref = cfg.beta > 0 and not cfg.use_peft
    if cfg.model is None:
        model, tokenizer, embedded_dataset = data.embedded_task(cfg.seed)
        ref_model = data.embedded_task(cfg.seed)[0] if separate_ref else None
        dataset = embedded_dataset if dataset is None else dataset
    else:
        model, tokenizer = models.load_pretrained(cfg, vision)
        ref_model = models.load_pretrained(cfg, vision)[0] if separate_ref else None
    processor = tokenizer if vision else None
    tokenizer = processor.tokenizer if vision else tokenizer
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    data.check_data(dataset, tokenizer, processor, model, cfg)
    for name, eval_set in eval_sets.items():
        data.check_data(eval_set, tokenizer, processor, model, cfg, data.eval_where(cfg, name))
    sampler.check_token_ids(cfg, model, tokenizer)
    models.router_aux_coef(cfg, model)  # a coefficient for a model without a router loss fails
    packing.choose_padding_free(cfg, model, vision, device)  # unset: packed where exact
    if cfg.use_peft:
        model = lora.add_adapter(model, lora.settings(cfg))
    model = models.prepare_model(model, cfg, trainable=True, device=device)
    if ref_model is not None:
        ref_model = models.prepare_model(ref_model, cfg, trainable=False, device=device)
    return model, ref_model, tokenizer, processor, dataset


def start_generator(cfg, model, tokenizer, processor, dataset, device):
    """The generator, chosen once: our decode loop over the policy, or vLLM colocated or as a
    server (it pushes the new weights, and wakes and sleeps, inside each call). Each has
    generate(rows, seed) -> Rollout, push_weights() and close()."""
    turns, context = cfg.environment or cfg.tools, environments.context_length(cfg, model)
    if cfg.use_vllm:
        max_images = data.max_images_per_row(dataset) if processor else 0
        longest = None if processor else data.longest_prompt(dataset, tokenizer, cfg)  # images add
        max_model_len = context if turns else longest and longest + cfg.max_completion_length
        generator = vllm_rollout.make_generator(cfg, model, tokenizer, processor, device,
                                                max_images, max_model_len)
    else:
        generator = rollout.DecodeLoop(cfg, model, tokenizer, processor, device)
    generator = with_turns(cfg, generator, tokenizer, processor, model)
    torch.manual_seed(cfg.seed + distributed.rank())  # each rank samples its own completions
    return generator


def start_eval_generator(cfg, model, tokenizer, processor, device):
    """Evaluation samples with our decode loop (num_generations_eval per prompt), multi-turn
    like training."""
    eval_cfg = eval_config(cfg)
    generator = rollout.DecodeLoop(eval_cfg, model, tokenizer, processor, device)
    return with_turns(eval_cfg, generator, tokenizer, processor, model)


def with_turns(cfg, generator, tokenizer, processor, model):
    """With --environment or --tools the generator samples each turn of multi-turn trajectories."""
    if not (cfg.environment or cfg.tools):
        return generator
    eos_ids = prompting.eos_token_ids(tokenizer, model, cfg)
    return environments.multi_turn(cfg, generator, tokenizer, processor, eos_ids,
                                   environments.context_length(cfg, model))


# ---------------------------------------------------------------------------------------------
# The algorithm: score a generated batch, then update the policy on it
# ---------------------------------------------------------------------------------------------

def score(cfg, batch, rewards, model, ref_model, step):
    """Rewards, KL-shaped rewards and leave-one-out advantages of one Rollout -> Scores."""
    G, timings = cfg.num_generations, {}
    loss_mask = batch.model_tokens().float()  # [B, T]; multi-turn: not the environment's
    if cfg.mask_truncated_completions:  # no gradient and no KL; they still count in the baselines
        loss_mask = loss_mask * (~batch.truncated).float()[:, None]
    with timed(timings, "time/rewards"):  # R = sum_k w_k R_k over the functions that scored
        rewards_per_func = batch.rewards_per_func  # dynamic sampling scored them already
        if rewards_per_func is None:
            rewards_per_func = rewards(batch, G, step)  # [B, K]
        shaped = rewards.combine(rewards_per_func)  # [B]
    scores = Scores(rewards_per_func, shaped, loss_mask, None, timings=timings)
    with timed(timings, "time/reference"):
        if cfg.beta > 0:  # r = R - beta * kl, log pi_old the sampler's where exact (§3)
            exact = sampler_rules.old_logps_from_sampler(cfg, batch.pixel_inputs is not None)
            old = batch.sampler_logps if exact else forward.batch_logps(model, batch, cfg)
            with lora.reference(model, ref_model) as reference:
                scores.ref_logps = forward.batch_logps(reference, batch, cfg)  # [B, T]
            scores.old_logps = old
            scores.kl_sums = sequence_kl(old, scores.ref_logps, loss_mask, cfg.kl_estimator)
            scores.rewards = shaped - cfg.beta * scores.kl_sums
        # [B], e.g. leave-one-out A_i = r_i - mean_{j != i} r_j (rloo_advantages)
        advantages = estimate_advantages(scores.rewards, G, cfg.advantage_estimator,
                                         cfg.advantage_estimator_kwargs)
        if cfg.normalize_advantages:  # over the global batch: every rank normalises the same vector
            with_baseline = has_baseline(scores.rewards, G).float()
            gathered = distributed.gather({"advantages": advantages, "baseline": with_baseline})
            advantages = normalize_advantages(gathered["advantages"], gathered["baseline"] > 0)
            advantages = advantages.view(distributed.world_size(), -1)[distributed.rank()]
    scores.advantages = advantages
    return scores


def policy_step(cfg, model, optimizer, scheduler, batch, scores, old_logps=None, rows=None):
    """One optimizer step on the clipped sequence loss over the completions `rows` of the batch (a
    slice; the whole batch unless steps_per_generation makes mini-batches), in micro-batches of
    per_device_train_batch_size (gradient accumulation: the loss is the mean over all of the step's
    sequences, on every rank; paper §3). old_logps [B, T]: log pi_old of the ratio (old_logps);
    None: on-policy, pi_old = pi.detach() so rho == 1. A MoE model adds coef * its router's
    load-balancing loss. -> (per-token log-probs [B, T] of these rows; this rank's sums for the
    metrics; the global gradient norm, non-finite: the step was skipped; the phase timings)"""
    advantages, sampling = scores.advantages, defaultdict(list)  # sampler mismatch, per micro-batch
    rows = slice(0, len(advantages)) if rows is None else rows
    eps_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    aux_coef, timings, counts = models.router_aux_coef(cfg, model), {}, step_counts(scores, rows)
    logps_all = torch.zeros_like(scores.loss_mask)  # [B, T] filled at the step's rows
    mbs = forward.training_micro_batches(batch, rows, cfg.per_device_train_batch_size,
                                         cfg.max_tokens_per_microbatch)
    sums = defaultdict(float)  # this rank's totals for the metrics
    with timed(timings, "time/forward_backward"):
        for i, mb in enumerate(mbs):
            if isinstance(model, FSDPModule):  # reduce-scatter gradients once, at the last one
                model.set_requires_gradient_sync(i == len(mbs) - 1)
            logps, entropy, T, aux, flips = forward.forward_logps(  # [b, T]
                model, batch, mb, cfg.temperature, router_aux=aux_coef > 0,
                pad_to=cfg.pad_to_multiple_of, padding_free=cfg.padding_free)
            mask = scores.loss_mask[mb, :T]
            old = logps.detach() if old_logps is None else old_logps[mb, :T]  # [b, T]
            seq_logps, seq_old = (logps * mask).sum(-1), (old * mask).sum(-1)  # s = sum_t log pi
            # the generator's log-probs (the trainer's own where it reports none)
            reported = batch.sampler_logps is not None
            sampled = batch.sampler_logps[mb, :T] if reported else logps.detach()
            is_weights = sampler_rules.sampler_weights(cfg, seq_old, sampled, logps.detach(), mask,
                                                       advantages[mb], sampling)  # [b] or None
            loss, low, high = rloo_loss(seq_logps, seq_old, advantages[mb], cfg.epsilon, eps_high,
                                        counts.sequences, is_weights)
            if aux is not None:  # weighted by the micro-batch's share of the step
                loss = loss + aux_coef * aux * len(mask) / counts.sequences
                sums["aux_loss"] += aux.detach() * len(mask)
            loss.backward()
            logps_all[mb, :T] = logps.detach()
            loss_sums(sums, loss, low, high, entropy, mask)
            if flips is not None:  # --replay_sampling_mask: sampled tokens this kept set dropped
                sampling["replay_flips"].append(flips * mask)
            if reported and old_logps is not batch.sampler_logps:  # |log pi_sampler - log pi_old|
                sampling["sampler_drift"].append((sampled - old).abs() * mask)
    with timed(timings, "time/optimizer"):
        grad_norm = optimizer_step(cfg, model, optimizer, scheduler)
    sums.update(sampling_sums(sampling))
    sums = {k: torch.as_tensor(v, device=advantages.device).float() for k, v in sums.items()}
    return logps_all, sums, grad_norm, timings


@dataclasses.dataclass
class Counts:
    """What one optimizer step's loss divides by, on this rank (paper §3: a mean over the step)."""
    sequences: int  # its completions: the sequence loss's mean, the MoE auxiliary loss's weight
    tokens: torch.Tensor  # their loss tokens (at least 1): a per-token loss's mean


def step_counts(scores, rows):
    return Counts(rows.stop - rows.start, scores.loss_mask[rows].sum().clamp(min=1))


def optimizer_step(cfg, model, optimizer, scheduler):
    """Clip the global gradient norm and step, or skip a step whose norm is NaN/inf. -> the norm"""
    max_norm = cfg.max_grad_norm or float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
        grad_norm = grad_norm.full_tensor()
    if torch.isfinite(grad_norm):  # the global norm: every rank takes the same branch
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def old_logps(cfg, model, batch, scores, steps):
    """log pi_old [B, T] of the ratio rho = pi / pi_old, the sampling weights' per-token
    log-probs, decided here alone: None where the step's own forward gives them (one optimizer
    step per pass: on-policy, rho == 1; its log-probs then serve the later passes); else scoring's
    (the KL's), or a no-grad forward before the first step moves the weights."""
    if steps == 1:
        return None
    return scores.old_logps if scores.old_logps is not None else \
        forward.batch_logps(model, batch, cfg)


def update(cfg, model, optimizer, scheduler, batch, scores):
    """The optimizer steps on one generated batch: mu = num_iterations passes over it, each in
    steps_per_generation / gradient_accumulation_steps mini-batches (whole groups in order; the
    prompts are already shuffled), one optimizer step each; yields each step's (sums over all
    ranks, grad norm, timings). For mu == 1 and one step per batch this is REINFORCE with the
    leave-one-out baseline (rho == 1); from the second step on the clipped surrogate matters."""
    per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    minibatches = forward.micro_batches(len(scores.advantages), per_step)
    old = old_logps(cfg, model, batch, scores, len(minibatches))
    for _ in range(cfg.num_iterations):
        for rows in minibatches:
            timings = {}
            with timed(timings, "time/training"):
                logps, sums, grad_norm, step_timings = policy_step(
                    cfg, model, optimizer, scheduler, batch, scores, old, rows)
            old = logps if old is None else old
            yield distributed.reduce_sums(sums), grad_norm, {**step_timings, **timings}


def finish(r, stopped, step):
    """After the loop: the logs closed, then how to resume a stopped run, or the final model in
    Hugging Face format; the generation thread and the generator closed. -> Result"""
    cfg = r.cfg
    r.logger.close()
    if stopped and distributed.is_main():
        print(f"rloo: stopped by a signal: saved checkpoint-{step} in {cfg.output_dir}; resume "
              "with --resume_from_checkpoint latest" if cfg.save_strategy == "steps" else
              f"rloo: stopped by a signal at step {step}; --save_strategy no: nothing saved")
    elif cfg.load_in_4bit:  # merged into the full-precision base, from the final checkpoint
        if distributed.is_main():
            last = checkpoint.checkpoint_dirs(cfg.output_dir)[-1]
            checkpoint.export_checkpoint(last, cfg.output_dir)
    elif not stopped:
        checkpoint.save_hf(r.model, r.saver, cfg.output_dir)
    if not stopped and distributed.is_main():
        spent = f"--max_train_minutes {cfg.max_train_minutes:g} spent at step {step} of " \
            f"{r.total_steps}; " if step < r.total_steps else ""  # the clock, as signals say so
        print(f"rloo: {spent}metrics in {r.logger.where()}, final model in {cfg.output_dir}")
    r.source.close()  # the generation thread, then the generator (a colocated engine: the group)
    return Result(cfg.output_dir, step, r.logger.last, stopped, dict(stack.PATHS))


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def setup(argv, opened):
    """Flags -> (cfg, device): the process group, the precision, and every check that needs no
    data and no model. The output directory's lock goes with `opened`, last."""
    cfg = environments.with_tools(parse_config(argv))  # --tools: their schemas in the template
    device = distributed.setup_distributed(cfg.ddp_timeout)
    stack.took("versions", stack.versions())
    stack.choose_precision(cfg, device)  # --bf16 unset: what the device computes natively
    check_config(cfg, distributed.world_size())
    release = directories.check_output_dir(cfg)
    if release is not None:
        opened.callback(release)
    directories.resolve_paths(cfg)  # user code may change the working directory
    return cfg, device


@dataclasses.dataclass
class Run:
    """What start makes for the loop, in the order it is made."""
    cfg: Config
    model: torch.nn.Module  # the policy (FSDP2-sharded under torchrun and --bf16; LoRA: adapted)
    ref_model: torch.nn.Module | None  # the frozen reference, when beta > 0 (not with LoRA)
    saver: object  # the tokenizer, or a vision-language model's processor: saved with the model
    vision: bool  # the dataset has images
    rewards: object  # rewards.RewardFunctions
    eval_sets: dict  # name -> dataset
    eval_generator: object  # our decode loop, num_generations_eval samples per prompt
    optimizer: torch.optim.Optimizer
    scheduler: object
    total_steps: int
    state: checkpoint.TrainerState  # where the run starts: step 0, or the checkpoint resumed from
    stop_signal: torch.Tensor  # set by SIGTERM or Ctrl-C
    health: RunHealth
    logger: Logger
    source: BatchSource  # each step's batch


def start(cfg, device, opened):
    """Data, models, rewards, generators, optimizer, the state resumed from, logs and the batch
    source -> Run. opened: what closes however the run ends (process.borrowed)."""
    dataset, eval_sets, vision = data.load_datasets(cfg)  # data first: cheaper to find it wrong
    vllm_rollout.before_models(cfg)  # a vLLM server sizes its KV cache before our models load
    model, ref_model, tokenizer, processor, dataset = load_models(
        cfg, dataset, eval_sets, vision, device)
    rewards = load_rewards(cfg, device, environments.environment_rewards(cfg, dataset))
    generator = start_generator(cfg, model, tokenizer, processor, dataset, device)
    eval_generator = start_eval_generator(cfg, model, tokenizer, processor, device)
    optimizer, scheduler, total_steps = schedule.make_optimization(cfg, model, dataset, device)
    rewards.max_steps = total_steps
    state = checkpoint.resume_or_start(cfg, model, optimizer, scheduler, ref_model)
    checkpoint.check_steps_left(cfg, state, total_steps)
    source = opened.enter_context(closing(BatchSource(cfg, generator, dataset, rewards, tokenizer,
                                                      vars(state))))
    logger = opened.enter_context(closing(Logger(cfg, total_steps, state)))
    return Run(cfg, model, ref_model, processor or tokenizer, vision, rewards, eval_sets,
               eval_generator, optimizer, scheduler, total_steps, state,
               checkpoint.watch_signals(device, cfg.output_dir), RunHealth(cfg), logger, source)


@dataclasses.dataclass
class Result:
    """What main returns, on every rank."""
    output_dir: str
    step: int  # the last optimizer step
    metrics: dict  # the last logged step's, as metrics.jsonl has it
    stopped: bool  # by SIGTERM or Ctrl-C: resume from the checkpoint it saved
    paths: dict  # what each version- or device-dependent choice took (stack.PATHS)


def main(argv=None):
    """One run, from the command line or from Python: train.main(["--learning_rate", "3e-4"]), as
    often as wanted in one process, each run as from a fresh one, the process left as found
    (process.borrowed; README 'Sweeps'). -> Result. Bad input, or a run that cannot go on, raises
    domains.Failed (also importable from config): its one line (error: ...) is what the command
    line prints."""
    with process.borrowed() as opened:
        cfg, device = setup(argv, opened)
        try:
            return train(start(cfg, device, opened))
        except Exception as error:  # a lost peer's failed collective: one line naming the peer
            checkpoint.stop_if_a_peer_is_lost(cfg.output_dir, error)
            raise


def evaluate_now(r, step, clock):
    """Every eval set, logged at this step with the training time so far (train_seconds), off the
    training clock."""
    with clock.paused():
        evaluated = evaluate(r.cfg, r.eval_generator, r.eval_sets, r.rewards, r.model, step)
    r.logger.write(step, {**evaluated, "train_seconds": clock.seconds()})


def train(r):
    """The loop: sample -> score -> update, then log and checkpoint; the end. -> Result"""
    cfg, model, rewards, logger = r.cfg, r.model, r.rewards, r.logger
    step, num_tokens, saved_step, stopped = r.state.step, r.state.num_tokens, r.state.step, False
    clock, last = Clock(cfg.max_train_minutes and 60 * cfg.max_train_minutes), False
    if r.eval_sets and cfg.eval_on_start:
        evaluate_now(r, step, clock)
    while step < r.total_steps and not (stopped or last):
        timings = {}
        # ======== 1. Sample: G completions for each of this rank's P prompts ========
        with timed(timings, "time/generation"):
            batch, source_metrics = r.source.next(step)
        # ======== 2. Score: R, the KL-shaped r = R - beta * kl, leave-one-out advantages A ========
        scores = score(cfg, batch, rewards, model, r.ref_model, step)
        sampled, batch_tokens = batch_metrics(cfg, batch, scores, rewards, timings | source_metrics)
        num_tokens += batch_tokens  # once per generated batch, however many passes train on it
        r.health.scored(sampled["reward"], step)
        if step == 0:
            show_samples("before training", batch, scores, cfg.num_generations)
        # ======== 3. Update: mu passes over the batch, an optimizer step per mini-batch ========
        for i, (sums, grad_norm, timings) in enumerate(update(cfg, model, r.optimizer, r.scheduler,
                                                              batch, scores)):
            step += 1
            last = step >= r.total_steps or clock.out_of_time()  # --max_train_minutes
            models.sync_reference(cfg, model, r.ref_model, step)  # TR-DPO, with --sync_ref_model
            logger.add_step({**(sampled if i == 0 else {}),
                             **step_metrics(sums, grad_norm, r.scheduler, timings, batch_tokens)})
            # epoch: passes over the prompts read, as the Trainer logs it (None: a stream)
            due = logger.log_if_due(step, last, num_tokens=num_tokens,
                                    epoch=batch.epochs and batch.epochs[1])
            if due and cfg.log_completions:
                logger.completions(step, *completions_table(step, batch, scores, rewards,
                                                            cfg.log_multimodal))
            if r.eval_sets and (step % cfg.eval_steps == 0 or last):
                evaluate_now(r, step, clock)
            r.health.stepped(grad_norm)
            if last:
                break
        # ======== checkpoint: every save_steps, at the end, on SIGTERM or Ctrl-C ========
        stopped = checkpoint.stop_requested(r.stop_signal)
        if checkpoint.save_due(cfg, step, saved_step, last, stopped):
            saved = checkpoint.TrainerState(step, num_tokens, logger.window, **r.source.state())
            checkpoint.save_checkpoint(cfg, model, r.optimizer, r.scheduler, saved, r.vision,
                                       r.ref_model)
            saved_step = step
    if not stopped and step > r.state.step:
        r.health.check_trained(step - r.state.step)
        show_samples("after training", batch, scores, cfg.num_generations)
    return finish(r, stopped, step)


if __name__ == "__main__":
    with process.command_line():  # its end waits on no thread user code left running
        if sys.argv[1:2] == ["export"]:  # python train.py export CHECKPOINT [OUT_DIR]
            checkpoint.export_checkpoint(*sys.argv[2:4])
        else:
            main()
