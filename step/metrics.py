"""What a run reports: the generation metrics of a gathered batch (TRL's names; docs/reference.md
'Metrics'), the names the trainer owns, a timer for the time/* and memory/* phases, the completions
table and the start-up line. The Logger that averages a window of steps and writes them is
plumbing/logs.py.

The collectives that bring every rank's numbers together are in plumbing/distributed.py; this file
only does arithmetic and printing.
"""

import math
import os
import time
from contextlib import contextmanager

import torch
from tqdm import tqdm

from plumbing import distributed
from plumbing.config import generation_steps
from step.prompting import repeat_each, row_images


# The names the trainer owns (docs/reference.md 'Metrics' lists them; what a reward function logs
# is checked against them, rewards.RewardFunctions): the completions table's own columns, a reward
# function or a log_extra column of one of these names would be a second column of that name...
TABLE_COLUMNS = ("step", "prompt", "completion", "advantage", "image")
# ... and the metrics it logs, whole names and groups (group/...): a log_metric of one of them, or
# of evaluation's eval_..., would overwrite it or pose as it. A new metric adds its name here.
TRAINER_METRICS = ("step", "epoch", "reward", "reward_std", "frac_reward_zero_std", "kl",
                   "entropy", "loss", "grad_norm", "learning_rate", "num_tokens", "step_time",
                   "aux_loss", "nonfinite_skipped", "train_seconds")
TRAINER_GROUPS = ("rewards", "completions", "clip_ratio", "sampling", "dynamic_sampling", "time",
                  "memory", "tokens_per_second", "turns", "tools", "environment")


def trainer_metric(name):
    """Whether a metric name is the trainer's: one it logs, one of its groups, or evaluation's."""
    group, slash, _ = name.partition("/")
    in_group = bool(slash) and group in TRAINER_GROUPS
    return name in TRAINER_METRICS or in_group or name.startswith("eval_")


@contextmanager
def timed(timings, name):
    """Add the seconds the block takes to timings[name], and the most memory in use during it, in
    MiB, to memory/<phase> (the largest over the step's calls). On a GPU each end of the block is
    a CUDA event on the current stream, so the kernels it queued count in it, not in the phase
    after; the seconds are Spans until settle() reads them, once a step (one synchronization, none
    per phase or micro-batch). Memory is read at the block's ends and where note_memory() is called
    inside it, no thread and nothing polled (a decode loop on a GPU is bound by kernel launches,
    and the GIL a polling thread takes stalls it). Nothing here resets a process-wide peak:
    memory/run_peak and any outside reading of the process's peak stay true."""
    if not MEASURE[0]:  # bench.py's run without measuring, for the cost of measuring: NaN
        yield
        merge_timings(timings, {name: math.nan})
        return
    start, phase = mark(), {"peak": 0.0, "high": memory()[1]}
    OPEN_PHASES.append(phase)
    try:
        yield
    finally:
        now, high = memory()
        for frame in OPEN_PHASES:  # a phase that raised the high-water mark had it as its peak
            frame["peak"] = max(frame["peak"], high if high > frame["high"] else now)
        OPEN_PHASES.pop()  # this one: phases nest
        merge_timings(timings, {name: Spans([(start, mark())]),
                                "memory/" + name.split("/", 1)[-1]: phase["peak"]})


OPEN_PHASES = []  # the timed() blocks running, innermost last: {"peak": MiB, "high": at start}
MEASURE = [True]  # False: timed() measures nothing (bench.py's cost of measuring)


def note_memory():
    """Read the memory in use into every open phase's peak where a phase holds the most (a training
    forward's activations before backward, step/forward.py; the full KV cache, rollout.py). A
    phase's ends are read too, and one during which the process's high-water mark rose gets that
    mark, its exact peak; otherwise its largest reading, a lower bound. A few microseconds each."""
    if OPEN_PHASES:
        now = in_use()
        for frame in OPEN_PHASES:
            frame["peak"] = max(frame["peak"], now)


class Spans(list):
    """A phase's (start mark, end mark) pairs, one per call, until settle() reads their seconds."""

    def seconds(self):
        return sum(end - start if isinstance(end, float) else start.elapsed_time(end) / 1000
                   for start, end in self)


def mark():
    """A phase boundary: a CUDA event recorded on the current stream where CUDA runs (it completes
    when the kernels queued before it have), else the host's clock."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def merge_timings(into, timings):
    """Phases of one step gathered in one dict: seconds (Spans) add up, memory/ peaks take the
    larger, other numbers add."""
    for key, value in timings.items():
        old = into.get(key)
        if old is None:
            into[key] = Spans(value) if isinstance(value, Spans) else value
        elif key.startswith("memory/"):
            into[key] = max(old, value)
        elif isinstance(old, Spans) or isinstance(value, Spans):
            into[key] = Spans([*as_spans(old), *as_spans(value)])
        else:
            into[key] = old + value


def as_spans(value):
    return value if isinstance(value, Spans) else [(0.0, float(value))]


def settle(metrics):
    """Every phase's Spans in metrics -> its seconds, after one synchronization on the latest end
    event (CUDA events complete in order). Once a step, before its metrics are used."""
    events = [end for spans in metrics.values() if isinstance(spans, Spans)
              for _, end in spans if not isinstance(end, float)]
    if events:
        events[-1].synchronize()
        SYNCS[0] += 1
    for key, value in metrics.items():
        if isinstance(value, Spans):
            metrics[key] = value.seconds()
    return metrics


SYNCS = [0]  # settle()'s synchronizations: one a step (a test counts them)


def memory():
    """(MiB in use now, MiB at most in use since the process started): the trainer's in the GPU
    allocator (a colocated vLLM engine's weights and KV cache left out: ENGINE_BYTES), else this
    process's resident set and its high-water mark (Linux's VmRSS and VmHWM: its own, unlike
    getrusage's ru_maxrss, which carries a parent's over exec); 0 where unknown. Nothing in rloo
    resets either peak."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        allocated = torch.cuda.memory_stats_as_nested_dict()["allocated_bytes"]["all"]  # one call
        engine = ENGINE_BYTES[0]
        return (allocated["current"] - engine) / 2**20, (allocated["peak"] - engine) / 2**20
    status = proc_self("status")
    return kib(status, b"VmRSS:") / 1024, kib(status, b"VmHWM:") / 1024


# Bytes of the GPU allocator a colocated vLLM engine holds for good, counted across its start
# (engine_start). With sleep mode vLLM unmaps its weights and KV cache between samplings, yet their
# tensors stay allocated in torch's pool: counted, every memory/* figure would carry them.
ENGINE_BYTES = [0]


@contextmanager
def engine_start():
    """A colocated vLLM engine starting in the block: the GPU memory it allocates and keeps is left
    out of memory/* (which are then the trainer's) until the engine closes (ENGINE_BYTES[0] = 0).
    -> [its MiB], filled as the block ends"""
    gpu = torch.cuda.is_available()
    before, held = torch.cuda.memory_allocated() if gpu else 0, [0.0]
    yield held
    if gpu:
        ENGINE_BYTES[0] = torch.cuda.memory_allocated() - before
        held[0] = ENGINE_BYTES[0] / 2**20


def kib(status, field):
    """The kB figure of one field of /proc/self/status (0 where it is missing)."""
    at = status.find(field)
    return int(status[at + len(field):status.index(b"kB", at)]) if at >= 0 else 0


def proc_self(name):
    """/proc/self/<name>'s bytes (b"" off Linux): no Python file object, a few microseconds."""
    try:
        fd = os.open(f"/proc/self/{name}", os.O_RDONLY)
    except OSError:
        return b""
    try:
        return os.read(fd, 8192)
    finally:
        os.close(fd)


def in_use():
    """MiB in use now (memory's first figure, cheaper on a CPU: /proc/self/statm)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return memory()[0]
    resident = proc_self("statm").split()[1:2]
    return int(resident[0]) * PAGE / 2**20 if resident else 0.0


PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def run_peak():
    """MiB at most in use since the process started, exact (memory/run_peak; memory)."""
    return memory()[1]


def nanstd(x):
    x = x[~torch.isnan(x)]
    return x.std().item() if x.numel() > 1 else float("nan")


def group_nanstd(rewards, G):
    """Std of each group's scorable (non-NaN) rewards, NaN below two of them (TRL's nanstd).  [B] ->
    [P]"""
    grouped = rewards.view(-1, G)
    n = (~torch.isnan(grouped)).sum(-1)
    deviation = torch.nan_to_num(grouped - grouped.nanmean(-1, keepdim=True))
    return ((deviation ** 2).sum(-1) / (n - 1)).sqrt().where(n > 1, torch.nan)


def generation_metrics(columns, rewards, G):
    """Step metrics on the gathered global batch (TRL's names). columns: rewards_per_func [B, K]
    (NaN = None), rewards [B] (KL-shaped, for frac_reward_zero_std), lengths [B], truncated [B],
    and, when beta > 0, kl_sums [B] with loss_tokens [B] (the tokens the KL was summed over)."""
    rewards_per_func, lengths = columns["rewards_per_func"], columns["lengths"]
    truncated = columns["truncated"]
    # before KL and clipping; float64: a mean of +-3e38 rewards is finite (NaN: nothing scored)
    reward = rewards.combine(rewards_per_func, clipped=False).double()
    terminated = lengths[~truncated.bool()]
    m = {"reward": reward.nanmean().item(), "reward_std": nanstd(reward),
         # groups with fewer than two scored members have a NaN std: they do not count as 0
         "frac_reward_zero_std": group_nanstd(columns["rewards"], G).eq(0).float().mean().item(),
         "completions/mean_length": lengths.mean().item(),
         "completions/min_length": lengths.min().item(),
         "completions/max_length": lengths.max().item(),
         "completions/clipped_ratio": truncated.float().mean().item()}
    for stat in ("mean", "min", "max"):
        value = getattr(terminated, stat)().item() if len(terminated) else float("nan")
        m[f"completions/{stat}_terminated_length"] = value
    for k, name in enumerate(rewards.names):
        m[f"rewards/{name}/mean"] = rewards_per_func[:, k].nanmean().item()
        m[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, k])
    if columns.get("kl_sums") is not None:  # token-weighted k1
        m["kl"] = (columns["kl_sums"].sum() / columns["loss_tokens"].sum().clamp(min=1)).item()
    return m


def turn_metrics(columns):
    """Multi-turn trajectories over the gathered batch (TRL's tools/ names): model turns, tool
    calls per trajectory and the failed share of them, environment failures per trajectory, the
    share of completion tokens the environment wrote, and the model's tokens per turn."""
    calls = columns["tool_calls"].sum()
    return {"turns/mean": columns["turns"].mean().item(),
            "turns/max": columns["turns"].max().item(),
            "turns/mean_length": (columns["lengths"].sum() / columns["turns"].sum()).item(),
            "tools/call_frequency": columns["tool_calls"].mean().item(),
            "tools/failure_frequency": (columns["tool_failures"].sum() / calls).item()
            if calls > 0 else 0.0,
            "environment/failure_frequency": columns["env_failures"].mean().item(),
            "completions/environment_token_fraction":
                (1 - columns["lengths"].sum() / columns["all_tokens"].sum()).item()}


def batch_metrics(cfg, batch, scores, rewards, timings):
    """A generated batch's metrics over all ranks (docs/reference.md 'Metrics'), and its prompt +
    completion tokens. batch: a Rollout; scores: batches.Scores; rewards:
    rewards.RewardFunctions."""
    lengths = batch.model_tokens().sum(-1).float()  # multi-turn: the model's tokens only
    columns = distributed.gather({  # [world * B] each
        "rewards_per_func": scores.rewards_per_func.T, "rewards": scores.rewards,
        "lengths": lengths, "truncated": batch.truncated.float(),
        "kl_sums": scores.kl_sums, "loss_tokens": scores.loss_mask.sum(-1),
        "tokens": batch.prompt_mask.sum(-1).float() + lengths,
        "all_tokens": batch.completion_mask.sum(-1).float(), **(batch.turn_stats or {})})
    columns["rewards_per_func"] = columns["rewards_per_func"].T  # [world * B, K]
    metrics = generation_metrics(columns, rewards, cfg.num_generations)
    if batch.turn_stats is not None:
        metrics.update(turn_metrics(columns))
    for timings_part in (timings, batch.timings, scores.timings):
        merge_timings(metrics, timings_part)
    settle(metrics)  # the phases' seconds, read once a step
    metrics.update(logged_metrics(batch.logged_metrics))
    generated = columns["lengths"].sum().item()
    metrics["tokens_per_second/generation"] = generated / metrics["time/generation"]
    return metrics, columns["tokens"].sum().item()


def logged_metrics(logged):
    """What reward functions logged with log_metric on one batch ({name: [values]} on each rank):
    for each name, the mean over every call on every rank (TRL's). Every rank takes part, whether
    or not its functions logged."""
    totals = {}
    for rank_logged in distributed.gather_objects({k: (sum(v), len(v)) for k, v in logged.items()}):
        for name, (total, count) in rank_logged.items():
            previous = totals.get(name, (0.0, 0))
            totals[name] = (previous[0] + total, previous[1] + count)
    return {name: total / count for name, (total, count) in sorted(totals.items())}


def step_metrics(sums, grad_norm, scheduler, timings, batch_tokens):
    """One optimizer step's metrics from the sums over all ranks (TRL's names)."""
    tokens, sequences = max(sums["tokens"], 1), sums["sequences"]
    clipped = sums["clipped_low"] + sums["clipped_high"]
    metrics = {"loss": sums["loss"] / distributed.world_size(), "grad_norm": grad_norm.item(),
               "learning_rate": scheduler.get_last_lr()[0], "entropy": sums["entropy"] / tokens,
               "clip_ratio/low_mean": sums["clipped_low"] / sequences,
               "clip_ratio/high_mean": sums["clipped_high"] / sequences,
               "clip_ratio/region_mean": clipped / sequences,
               # TRL's min / max over the step's per-sequence 0/1 clip flags
               "clip_ratio/low_min": float(sums["clipped_low"] == sequences),
               "clip_ratio/high_max": float(sums["clipped_high"] > 0),
               "nonfinite_skipped": float(not torch.isfinite(grad_norm)),
               **settle(dict(timings)), "memory/run_peak": run_peak()}
    metrics["tokens_per_second/training"] = batch_tokens / metrics["time/training"]
    if "aux_loss" in sums:  # MoE: the router's load-balancing loss, before its coefficient
        metrics["aux_loss"] = sums["aux_loss"] / sequences
    if "sampler_drift" in sums:
        metrics["sampling/sampling_logp_difference/mean"] = sums["sampler_drift"] / tokens
    if "max/sampler_drift" in sums:
        metrics["sampling/sampling_logp_difference/max"] = sums["max/sampler_drift"]
    if "replay_flips" in sums:  # share of loss tokens outside the trainer's recomputed kept set
        metrics["sampling/replay_boundary_flips"] = sums["replay_flips"] / tokens
    if "is_weight" in sums:  # sequence-level importance sampling (TRL's names)
        metrics["sampling/importance_sampling_ratio/mean"] = sums["is_weight"] / sequences
    for stat in ("min", "max"):
        if f"{stat}/is_weight" in sums:
            metrics[f"sampling/importance_sampling_ratio/{stat}"] = sums[f"{stat}/is_weight"]
    for name, metric in (("is_truncated", "importance_sampling_ratio/truncated_fraction"),
                         ("is_masked", "importance_sampling_ratio/masked_fraction"),
                         ("off_policy_masked", "off_policy_masked_fraction")):
        if name in sums:  # shares of the step's sequences
            metrics["sampling/" + metric] = sums[name] / sequences
    return metrics


def loss_sums(sums, loss, low, high, entropy, mask):
    """A micro-batch's loss, clip indicators [b], entropy [b, T] into this rank's step sums."""
    sums["loss"] += loss.detach()
    sums["clipped_low"] += low.sum()
    sums["clipped_high"] += high.sum()
    sums["entropy"] += (entropy * mask).sum()
    sums["tokens"] += mask.sum()
    sums["sequences"] += len(mask)


def sampling_sums(sampling):
    """A step's tensors of the sampler/trainer mismatch, each a list over its micro-batches
    (is_weight [b], is_truncated / is_masked / off_policy_masked [b] bool, sampler_drift [b, T]
    |log pi_sampler - log pi_old| times the loss mask) -> this rank's sums, and the maxima ("max/")
    and minima ("min/") of the weights and the drift, for step_metrics once reduce_sums has them."""
    sums = {}
    for name, parts in sampling.items():
        values = torch.cat([part.flatten().float() for part in parts])
        sums[name] = values.sum()
        if name in ("is_weight", "sampler_drift"):
            sums["max/" + name] = values.max()
        if name == "is_weight":
            sums["min/" + name] = values.min()
    return sums


def completions_table(step, batch, scores, rewards, log_multimodal=True):
    """--log_completions: (columns, rows) of (step, prompt, completion, each reward, the columns
    reward functions added with log_extra, advantage, and with images the row's first image)."""
    G = len(batch.completion_lists) // len(batch.rows["prompt"])
    prompts = batch.shown_prompts()
    extra = batch.logged_columns
    images = [None] * len(prompts)
    if log_multimodal and batch.pixel_inputs is not None:
        images = [row[0] if row else None for row in repeat_each(row_images(batch.rows), G)]
    with_images = any(image is not None for image in images)
    table = [[step, p, c, *r, *(extra[k][i] for k in extra), a, *([im] if with_images else [])]
             for i, (p, c, r, a, im) in enumerate(zip(prompts, batch.texts,
                                                       scores.rewards_per_func.tolist(),
                                                       scores.advantages.tolist(), images))]
    columns = ["step", "prompt", "completion", *rewards.names, *extra, "advantage"]
    return columns + (["image"] if with_images else []), table


def announce(cfg, model, device, total_steps, steps_per_batch):
    """The start-up line: processes, device (and CPU threads), parameters, the batch geometry, the
    run's optimizer steps and where it writes."""
    if distributed.is_main():
        world = distributed.world_size()
        per_batch = cfg.per_device_train_batch_size * generation_steps(cfg, world) * world
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        threads = f" ({distributed.CPU_THREADS[0]})" if distributed.CPU_THREADS else ""
        print(f"rloo: {world} process(es) on {device}{threads}, "
              f"{sum(p.numel() for p in model.parameters()):,} params per rank ({trainable:,} "
              f"trainable), {per_batch} completions per generated batch, {steps_per_batch} "
              f"optimizer step(s) on each, {total_steps} steps -> {cfg.output_dir}")


def show_samples(title, batch, scores, G, n=3):
    """The first few (prompt, completion, reward) of a batch, on rank 0."""
    if not distributed.is_main():
        return
    tqdm.write(f"--- {title} ---")  # tqdm.write keeps the progress bar intact
    rewards = scores.rewards_per_func.nansum(-1).tolist()
    for p, c, r in list(zip(batch.shown_prompts(), batch.texts, rewards))[:n]:
        tqdm.write(f"  {p!r} -> {c!r}  reward={r:.2f}")
