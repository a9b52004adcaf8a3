"""Evaluation: G completions for every prompt of each eval set (--eval_split, --eval_dataset),
scored like training's, with TRL's metric names prefixed eval_ (one set) or eval_<name>_; and the
training clock (--max_train_minutes), which evaluation does not advance.

The generator is our decode loop over the policy's live weights, with num_generations_eval
completions per prompt (one, greedy, at --eval_temperature 0); nothing here changes the model.
"""

import dataclasses
import time
from contextlib import contextmanager

import torch

from plumbing import distributed, models
from step import forward, prompting
from plumbing.config import generation_steps
from step.metrics import generation_metrics, logged_metrics
from rloo import estimate_advantages, rloo_loss


@dataclasses.dataclass
class Clock:
    """Training's wall time: since the loop started, less what evaluation took (paused)."""
    limit: float | None  # seconds (--max_train_minutes), None: no limit
    start: float = dataclasses.field(default_factory=time.perf_counter)
    paused_for: float = 0.0

    def seconds(self):
        return time.perf_counter() - self.start - self.paused_for

    def out_of_time(self):
        return self.limit is not None and self.seconds() >= self.limit

    @contextmanager
    def paused(self):
        began = time.perf_counter()
        try:
            yield
        finally:
            self.paused_for += time.perf_counter() - began


def eval_config(cfg):
    """Evaluation's settings: num_generations_eval completions per prompt (default
    num_generations) at eval_temperature (default temperature; 0: greedy, one per prompt)."""
    temperature = cfg.temperature if cfg.eval_temperature is None else cfg.eval_temperature
    G = 1 if temperature == 0 else cfg.num_generations_eval or cfg.num_generations
    return dataclasses.replace(cfg, num_generations=G, temperature=temperature)


@torch.no_grad()
def evaluate(cfg, generator, eval_sets, rewards, model, step):
    """Every eval set (docs/models.md 'Datasets'): metrics prefixed eval_ when there is one,
    eval_<name>_ for each of several."""
    metrics = {}
    for name, dataset in eval_sets.items():
        prefix = "eval_" if len(eval_sets) == 1 else f"eval_{name}_"
        measured = evaluate_set(cfg, generator, dataset, rewards, model, step)
        metrics.update({prefix + k: v for k, v in measured.items()})
    return metrics


def evaluate_set(cfg, generator, dataset, rewards, model, step):
    """Sample G completions for every prompt of one eval set and score them: the generation
    metrics, what reward functions logged, and TRL's eval_loss (the loss at rho = 1, the weights
    not having moved: -mean A, ~0 since leave-one-out advantages sum to 0 in a group, plus coef *
    aux_loss for a MoE model). Each rank takes its share of every chunk of prompts; indices wrap so
    all ranks call generate equally often (FSDP2 all-gathers in lockstep), and the wrapped
    duplicates are dropped before the metrics."""
    cfg = eval_config(cfg)
    G, n, chunks, logged = cfg.num_generations, len(dataset), [], {}
    P, rank = eval_prompts_per_rank(cfg), distributed.rank()
    aux_coef = models.router_aux_coef(cfg, model)
    for start in range(0, n, P * distributed.world_size()):
        index = [start + rank * P + j for j in range(P)]
        batch = generator.generate(dataset[[i % n for i in index]])
        rewards_per_func = rewards(batch, G, step)  # [B, K]
        for k, values in batch.logged_metrics.items():
            logged.setdefault(k, []).extend(values)
        valid = torch.tensor(prompting.repeat_each([i < n for i in index], G)).float()
        chunks.append({"rewards_per_func": rewards_per_func.T,
                       "lengths": batch.model_tokens().sum(-1).float(),
                       "truncated": batch.truncated.float(), "valid": valid,
                       **(unmoved_loss(cfg, batch, rewards_per_func, rewards, valid, model)
                          if G > 1 else {})})
    columns = distributed.gather({k: torch.cat([c[k] for c in chunks], -1).to(valid.device)
                                  for k in chunks[0]})
    keep = columns.pop("valid") > 0  # drop the wrapped duplicates (whole groups)
    loss, aux = columns.pop("loss", None), columns.pop("aux_loss", None)
    columns = {k: v[..., keep] for k, v in columns.items()}
    columns["rewards_per_func"] = columns["rewards_per_func"].T  # [completions, K]
    columns["rewards"] = rewards.combine(columns["rewards_per_func"])
    metrics = generation_metrics(columns, rewards, G)
    if G == 1:  # greedy: no group, so no zero-std groups and no leave-one-out loss
        del metrics["frac_reward_zero_std"]
        return {**metrics, **logged_metrics(logged)}
    metrics["loss"] = (loss.sum() / keep.sum() + aux_coef * aux.mean()).item()
    if aux_coef:
        metrics["aux_loss"] = aux.mean().item()
    return {**metrics, **logged_metrics(logged)}


def unmoved_loss(cfg, batch, rewards_per_func, rewards, valid, model):
    """TRL's eval_loss of one chunk: the loss at rho = 1 (s = s_old) of its leave-one-out
    advantages, and a MoE model's auxiliary loss, the mean over training-sized micro-batches."""
    G, aux_coef = cfg.num_generations, models.router_aux_coef(cfg, model)
    shaped = rewards.combine(rewards_per_func)
    advantages = estimate_advantages(shaped, G, cfg.advantage_estimator,  # [B]
                                     cfg.advantage_estimator_kwargs)
    advantages = advantages * valid.to(shaped.device)
    unmoved = torch.zeros_like(advantages)  # s = s_old
    loss = rloo_loss(unmoved, unmoved, advantages, cfg.epsilon, cfg.epsilon, 1)[0]
    aux = torch.tensor(0.0)
    if aux_coef:
        mbs = forward.micro_batches(len(advantages), cfg.per_device_train_batch_size)
        aux = sum(forward.forward_logps(model, batch, mb, cfg.temperature, router_aux=True)[3]
                  for mb in mbs) / len(mbs)
        forward.released(model)
    return {"loss": loss.reshape(1), "aux_loss": aux.reshape(1).float().cpu()}


def eval_prompts_per_rank(cfg):
    """Prompts per rank in one eval generate call (cfg: eval_config's)."""
    completions = cfg.per_device_eval_batch_size or (
        cfg.per_device_train_batch_size * generation_steps(cfg, distributed.world_size()))
    return max(1, completions // cfg.num_generations)
