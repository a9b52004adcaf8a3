"""What a run reports: the generation metrics of a gathered batch (TRL's names, README 'Metrics'), a timer for the
time/* phases, and the Logger that averages a window of steps and writes metrics.jsonl, the progress bar and wandb.

The collectives that bring every rank's numbers together are in distributed.py; this file only does arithmetic and
writing. Non-zero ranks get a Logger whose calls do nothing, so the loop has no `if rank == 0`.
"""

import json
import math
import os
import time
from contextlib import contextmanager
from dataclasses import asdict

import torch

import distributed
from rloo import combine_rewards


@contextmanager
def timed(timings, name):
    """Add the wall-clock seconds the block takes to timings[name] (on a GPU, queued work finishes later)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def nanstd(x):
    x = x[~torch.isnan(x)]
    return x.std().item() if x.numel() > 1 else float("nan")


def group_nanstd(rewards, G):
    """Std of each group's scorable (non-NaN) rewards, NaN below two of them (TRL's nanstd).  [B] -> [P]"""
    grouped = rewards.view(-1, G)
    n = (~torch.isnan(grouped)).sum(-1)
    deviation = torch.nan_to_num(grouped - grouped.nanmean(-1, keepdim=True))
    return ((deviation ** 2).sum(-1) / (n - 1)).sqrt().where(n > 1, torch.nan)


def generation_metrics(columns, names, weights, G):
    """Step metrics on the gathered global batch (TRL's names). columns: rewards_per_func [B, K] (NaN = None),
    rewards [B] (KL-shaped, for frac_reward_zero_std), lengths [B], truncated [B], and, when beta > 0, kl_sums [B]
    with loss_tokens [B] (the tokens the KL was summed over)."""
    rewards_per_func, lengths, truncated = columns["rewards_per_func"], columns["lengths"], columns["truncated"]
    reward = combine_rewards(rewards_per_func, weights)  # before KL and clipping
    terminated = lengths[~truncated.bool()]
    reward = reward.double()  # a mean of +-3e38 rewards is finite (and NaN only when nothing was scored)
    m = {"reward": reward.nanmean().item(), "reward_std": nanstd(reward),
         "frac_reward_zero_std": group_nanstd(columns["rewards"], G).eq(0).float().mean().item(),  # NaN: not 0
         "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
         "completions/max_length": lengths.max().item(), "completions/clipped_ratio": truncated.float().mean().item(),
         "completions/mean_terminated_length": terminated.mean().item() if len(terminated) else float("nan"),
         "completions/min_terminated_length": terminated.min().item() if len(terminated) else float("nan"),
         "completions/max_terminated_length": terminated.max().item() if len(terminated) else float("nan")}
    for k, name in enumerate(names):
        m[f"rewards/{name}/mean"] = rewards_per_func[:, k].nanmean().item()
        m[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, k])
    if columns.get("kl_sums") is not None:
        m["kl"] = (columns["kl_sums"].sum() / columns["loss_tokens"].sum().clamp(min=1)).item()  # token-weighted k1
    return m


class Logger:
    """Rank 0 writes metrics.jsonl, a progress bar and wandb; other ranks get the same calls as no-ops."""

    def __init__(self, cfg, total_steps, state):
        """state: where the run starts (checkpoint.start); resuming restores its metric window and keeps the lines
        of metrics.jsonl up to its step, dropping those an interrupted run wrote after it."""
        self.is_main, self.window, self.wandb, self.reward = distributed.is_main(), state["window"], None, math.nan
        self.logging_steps, self.total_steps = cfg.logging_steps, total_steps
        self.step_end = time.perf_counter()  # step_time: wall time between optimizer-step ends
        if not self.is_main:
            return
        from tqdm import tqdm
        resumed_step = state["step"] if cfg.resume_from_checkpoint else None
        os.makedirs(cfg.output_dir, exist_ok=True)
        path = os.path.join(cfg.output_dir, "metrics.jsonl")
        kept = []
        if resumed_step is not None and os.path.exists(path):
            with open(path) as f:
                kept = [line for line in f if json.loads(line)["step"] <= resumed_step]
        self.jsonl = open(path, "w")
        self.jsonl.writelines(kept)
        self.bar = tqdm(total=total_steps, initial=resumed_step or 0, desc="rloo", dynamic_ncols=True)
        if cfg.report_to == "wandb":
            import wandb
            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "rloo"), name=cfg.run_name,
                                    config=asdict(cfg), dir=cfg.output_dir)

    def add_step(self, metrics):
        """One optimizer step's metrics into the window, with step_time, and the progress bar one step on."""
        now = time.perf_counter()
        metrics = {**metrics, "step_time": now - self.step_end}
        self.step_end, self.reward = now, metrics.get("reward", self.reward)  # later passes: the batch's reward
        if self.is_main:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{self.reward:.3f}")
        for key, value in metrics.items():
            self.window.setdefault(key, []).append(value)

    def log_if_due(self, step, **totals):
        """Every logging_steps steps and at the last: log the window (see log). Returns whether it did."""
        if step % self.logging_steps and step != self.total_steps:
            return False
        self.log(step, **totals)
        return True

    def log(self, step, **totals):
        """Average the window (skipping NaN), add running totals such as num_tokens as they are, write everywhere."""
        means = {k: (sum(v) / len(v) if v else None) for k, v in
                 ((k, [x for x in vs if not math.isnan(x)]) for k, vs in self.window.items())}
        means.update(totals)
        self.window = {}
        self.write(step, means)
        return means

    def write(self, step, metrics):
        if not self.is_main:
            return
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        shown = ["reward", "reward_std", "kl", "entropy", "completions/mean_length", "loss", "grad_norm", "step_time"]
        prefix = "eval_" if any(k.startswith("eval_") for k in metrics) else ""
        self.bar.write(f"step {step}: " + " ".join(f"{prefix}{k.split('/')[-1]}={metrics[prefix + k]:.4g}"
                                                   for k in shown if metrics.get(prefix + k) is not None))
        if self.wandb:
            self.wandb.log({k: v for k, v in metrics.items() if v is not None}, step=step)

    def completions(self, step, columns, rows):
        """--log_completions: a few rows to stdout, and the table to wandb."""
        if not self.is_main:
            return
        self.bar.write(f"step {step} completions:")
        for row in rows[:4]:
            self.bar.write("  " + " | ".join(f"{c}={v:.3g}" if isinstance(v, float) else f"{c}={v!r}"
                                             for c, v in zip(columns, row)))
        if self.wandb:
            import wandb
            self.wandb.log({"completions": wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self):
        if self.is_main:
            self.bar.close()
            self.jsonl.close()
            if self.wandb:
                self.wandb.finish()


def show_samples(title, rows, batch, scored, G, n=3):
    """The first few (prompt, completion, reward) of a batch, on rank 0."""
    if not distributed.is_main():
        return
    from tqdm import tqdm  # tqdm.write keeps the progress bar intact
    tqdm.write(f"--- {title} ---")
    rewards = scored["rewards_per_func"].nansum(-1).tolist()
    for p, c, r in list(zip([p for p in rows["prompt"] for _ in range(G)], batch["texts"], rewards))[:n]:
        tqdm.write(f"  {p!r} -> {c!r}  reward={r:.2f}")
