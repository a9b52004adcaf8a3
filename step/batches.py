"""What a step's batch is (`Rollout`, the same for every generator), where it comes from (the
next prompts of the data, generated, and optionally filtered) and what scoring makes of it
(`Scores`).

- Synchronous (default): the step's prompts, sampled with the newest weights.
- --async_generation (a vLLM server): while the trainer updates on batch t, the server already
  samples batch t + lag with the weights of step t, so a batch is `lag` optimizer steps stale. The
  trainer keeps clipping against its own first-pass log-probs and corrects the staleness with the
  truncated importance weight min(exp(s_trainer - s_sampler), C) per sequence (rloo_loss's
  is_weights; Yao et al. 2025, truncated importance sampling).
- --dynamic_sampling (DAPO, Yu et al. 2025, §3.2): a group whose raw rewards (before the KL term)
  all agree has no learning signal; drop it and sample more prompts, at most
  --max_dynamic_sampling_rounds extra rounds, then train on what there is (topped up with dropped
  groups: the batch keeps its shape on every rank).

The data position (prompt batches drawn) is the source's state, not the step's: state() returns it,
what identifies the data at it (data.identity; a resumed run's data is checked against it) and,
with async generation, the batches in flight (sampled by weights no checkpoint holds); the
checkpoint saves them.
"""

import collections
import dataclasses
import functools
import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from plumbing import distributed
from step import data
from plumbing.config import fail
from step.metrics import timed
from step.prompting import pad, repeat_each


@dataclass
class Rollout:
    """One generated batch: B = P * G completions, a prompt's G adjacent, in the order the fields
    are produced. Optional fields are None where a backend or a run has none."""
    rows: dict  # the P prompts' dataset columns, {name: [P values]}
    prompt_ids: torch.Tensor  # [B, L] left-padded
    prompt_mask: torch.Tensor  # [B, L]
    completion_ids: torch.Tensor  # [B, T] right-padded after the first EOS
    completion_mask: torch.Tensor  # [B, T] 1 up to and including the first EOS
    truncated: torch.Tensor  # [B] bool: no EOS within max_completion_length
    completion_lists: list  # B unpadded id lists, EOS kept: what reward functions get
    texts: list  # B decoded completions
    # [B, T] log pi_T of each token, where the sampler reports exactly that (sampler_logps_exact)
    sampler_logps: torch.Tensor | None = None
    # vision-language: rows (a slice) -> the processor's tensors of those rows, for the forward
    pixel_inputs: Callable | None = None
    suppressed_ids: torch.Tensor | None = None  # image placeholders the sampler never emits
    # {filter: value} the sampler truncated to, the forward replays (--replay_sampling_mask)
    sampling_filter: dict | None = None
    rewards_per_func: torch.Tensor | None = None  # [B, K] when dynamic sampling scored it already
    # passes over the prompts (TRL's epoch) before and after its prompts were read; None: a stream
    epochs: tuple | None = None
    timings: dict = field(default_factory=dict)  # seconds spent inside generation, e.g. the push
    # what reward functions logged (TRL's log_extra, log_metric): column -> B values, name -> values
    logged_columns: dict = field(default_factory=dict)
    logged_metrics: dict = field(default_factory=dict)
    # multi-turn (options/environments.py): [B, T] 1 where the model sampled the token, 0 where the
    # environment wrote it; B turn lists (the reward functions' completions); {name: [B]} counts;
    generated_mask: torch.Tensor | None = None
    turns: list | None = None
    turn_stats: dict | None = None
    environments: list | None = None  # B environment objects, TRL's `environments` argument
    prompts: list | None = None  # B prompts as environments' reset() gave them (None: the rows')

    def shown_prompts(self):
        """The B prompts the model was given, for the samples printed and the completions table."""
        G = len(self.completion_lists) // len(next(iter(self.rows.values())))
        return self.prompts or repeat_each(self.rows["prompt"], G)

    def model_tokens(self):
        """[B, T] the completion tokens the model sampled: the only ones in s_i, the KL, the
        entropy and the lengths (environment tokens are context)."""
        if self.generated_mask is None:
            return self.completion_mask
        return self.completion_mask * self.generated_mask

    def take(self, index):
        """The completions at index (a list of row numbers) as a Rollout of their own; rows keeps
        the prompts they belong to, in order (index holds whole groups)."""
        picked = torch.tensor(index)
        G = len(self.completion_lists) // len(next(iter(self.rows.values())))
        prompts = index[::G]
        values = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and f.name != "suppressed_ids":
                value = value[picked.to(value.device)]
            elif isinstance(value, list):
                value = [value[i] for i in index]
            values[f.name] = value
        values["rows"] = {k: [v[i // G] for i in prompts] for k, v in self.rows.items()}
        values["logged_columns"] = {k: [v[i] for i in index]
                                    for k, v in self.logged_columns.items()}
        if self.turn_stats is not None:
            values["turn_stats"] = {k: v[picked.to(v.device)] for k, v in self.turn_stats.items()}
        values["timings"] = {}
        return Rollout(**values)


def concat(rollouts, pad_id):
    """One Rollout of several, prompts re-padded on the left and completions on the right."""
    first, values = rollouts[0], {}
    for f in dataclasses.fields(first):
        parts = [getattr(r, f.name) for r in rollouts]
        if f.name == "rows":
            values[f.name] = {k: [v for p in parts for v in p[k]] for k in parts[0]}
        elif f.name in ("logged_columns", "logged_metrics"):  # a column some parts lack: None
            sizes = [len(r.completion_lists) if f.name == "logged_columns" else 0
                     for r in rollouts]
            keys = dict.fromkeys(k for p in parts for k in p)
            values[f.name] = {k: [v for p, n in zip(parts, sizes) for v in p.get(k, [None] * n)]
                              for k in keys}
        elif isinstance(parts[0], list):
            values[f.name] = [v for p in parts for v in p]
        elif f.name == "turn_stats" and parts[0] is not None:
            values[f.name] = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        elif isinstance(parts[0], torch.Tensor) and parts[0].dim() == 2:
            value = pad_id if f.name.endswith("_ids") else 0
            values[f.name] = pad(parts, value, left=f.name.startswith("prompt"))
        elif isinstance(parts[0], torch.Tensor) and f.name != "suppressed_ids":
            values[f.name] = torch.cat(parts)
        else:
            values[f.name] = parts[0]
    values["timings"] = {}
    return Rollout(**values)


class BatchSource:
    """next(step) -> (Rollout, metrics) for each step; state() -> what a checkpoint keeps; close().
    generator: rollout.DecodeLoop or vllm_rollout.VLLMGenerator; saved: state() of the checkpoint
    resumed from ({} at the start)."""

    def __init__(self, cfg, generator, dataset, rewards, tokenizer, saved):
        self.cfg, self.generator, self.rewards = cfg, generator, rewards
        self.pad_id = tokenizer.pad_token_id
        self.position = saved.get("position", 0)
        self.per_epoch = data.steps_per_epoch(dataset, cfg)  # prompt batches; None: a stream
        self.read = hashlib.sha256()  # a stream's prompts this rank has read (data.prompt_batches)
        self.prompts = data.prompt_batches(dataset, cfg, self.position, self.read)
        self.identity = data.identity(dataset)  # a dataset's rows; None for a stream
        self.seen = data.seen(dataset, tokenizer, cfg)  # its first prompts' token ids
        if cfg.resume_from_checkpoint:
            data.check_same_data(cfg, saved.get("data"), self.data(), self.position)
        # (rollout or its future, the step whose weights sampled it) of async generation
        self.in_flight = collections.deque(saved.get("in_flight", []))
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rloo-generate") \
            if cfg.async_generation else None

    def epoch(self):
        """Passes over the prompts read so far, from the data position (None for a stream)."""
        return self.position / self.per_epoch if self.per_epoch else None

    def generate_next(self):
        """The next prompts, generated (under async generation: a future of it)."""
        rows, seed, before = next(self.prompts), request_seed(self.cfg, self.position), self.epoch()
        self.position += 1
        read = functools.partial(generated, self.generator, rows, seed,
                                 self.per_epoch and (before, self.epoch()))
        return self.pool.submit(read) if self.pool else read()

    def next(self, step):
        if not self.pool:
            rollout, metrics = self.generate_next(), {}
            if self.cfg.dynamic_sampling:  # its extra rounds read further into the data
                first = rollout.epochs
                rollout, metrics = fill_with_informative(self.cfg, rollout, self.generate_next,
                                                         self.rewards, step, self.pad_id)
                rollout.epochs = first and (first[0], self.epoch())
            return rollout, metrics
        metrics = {}
        self.wait_for_in_flight()  # the server is idle before it gets new weights
        with timed(metrics, "time/weight_sync"):
            self.generator.push_weights()
        while len(self.in_flight) <= self.cfg.async_generation_lag:
            self.in_flight.append((self.generate_next(), step))
        rollout, version = self.in_flight.popleft()
        return finished(rollout), {**metrics, "sampling/staleness": float(step - version)}

    def wait_for_in_flight(self):
        """Wait for every generation in flight; a failed one raises here, in the trainer's
        thread."""
        for i, (rollout, version) in enumerate(self.in_flight):
            self.in_flight[i] = (finished(rollout), version)

    def data(self):
        """What identifies the data at this position (data.identity; a stream: the hash of the rows
        each rank has read, every rank's)."""
        read = self.identity or {"stream": distributed.gather_objects(self.read.hexdigest()[:16])}
        return {**read, "seen": self.seen}

    def state(self):
        self.wait_for_in_flight()
        return {"position": self.position, "in_flight": list(self.in_flight), "data": self.data()}

    def close(self):
        """The generation thread, joined before the process group goes, then the generator: once,
        at the end of the run or on its way out (process.borrowed)."""
        if self.pool:
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self.generator is not None:
            self.generator.close()
            self.generator = None


def generated(generator, rows, seed, epochs):
    """The Rollout of these prompts, with the passes over the data before and after them."""
    rollout = generator.generate(rows, seed)
    rollout.epochs = epochs
    return rollout


def finished(rollout):
    """A Rollout, or the future of one waited for."""
    return rollout.result() if hasattr(rollout, "result") else rollout


def request_seed(cfg, position):
    """The sampling seed of one prompt batch on this rank: a function of the run's seed, the data
    position and the rank, so the samples are the same in a resumed run (whichever generator)."""
    entropy = [cfg.seed, position, distributed.rank()]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def fill_with_informative(cfg, rollout, generate_next, rewards, step, pad_id):
    """Dynamic sampling: keep the groups whose raw rewards differ, drawing more prompts until there
    are P of them on every rank or the rounds run out (all ranks draw the same number of rounds, so
    collectives stay in lockstep). -> (Rollout, metrics); its rewards_per_func holds the raw rewards
    it was filtered on."""
    G, P = cfg.num_generations, data.prompts_per_rank(cfg)
    if rollout.pixel_inputs is not None:
        fail("--dynamic_sampling does not support datasets with images yet; drop the flag")
    parts, rounds = [], 0
    while True:
        rollout.rewards_per_func = rewards(rollout, G, step)  # [B, K]
        raw = rewards.combine(rollout.rewards_per_func, clipped=False)  # [B]
        parts.append((rollout, informative_groups(raw, G)))
        found = sum(int(informative.sum()) for _, informative in parts)
        # informative groups still wanted, on all ranks
        wanted = torch.tensor(float(max(P - found, 0)))
        missing = distributed.reduce_sums({"missing": wanted})["missing"]
        if not missing or rounds == cfg.max_dynamic_sampling_rounds:
            break
        rollout = generate_next()
        rounds += 1
    # the informative groups first, in the order drawn; after the bound, dropped ones fill up to P
    chosen = [(part, g) for keep in (True, False) for part, informative in parts
              for g in (informative == keep).nonzero().flatten().tolist()][:P]
    groups = [part.take(list(range(g * G, (g + 1) * G))) for part, g in chosen]
    metrics = {"dynamic_sampling/rounds": float(rounds),
               "dynamic_sampling/shortfall": missing / (P * distributed.world_size())}
    return concat(groups, pad_id), metrics


def informative_groups(raw, G):
    """[B] raw rewards -> [B / G] bool: the group's scored rewards do not all agree (NaN =
    unscored, ignored)."""
    r = raw.view(-1, G)
    return r.nan_to_num(float("inf")).amin(1) < r.nan_to_num(float("-inf")).amax(1)


@dataclasses.dataclass
class Scores:
    """What scoring gives a Rollout of B completions (paper §3)."""
    rewards_per_func: torch.Tensor  # [B, K] raw rewards, NaN where a function returned None
    rewards: torch.Tensor  # [B] R after clipping, minus beta * kl
    loss_mask: torch.Tensor  # [B, T] completion tokens the loss and the KL see
    advantages: torch.Tensor  # [B] leave-one-out (normalised with --normalize_advantages)
    kl_sums: torch.Tensor | None = None  # [B] sum_t (log pi_old - log pi_ref), when beta > 0
    old_logps: torch.Tensor | None = None  # [B, T] the KL's log pi_old, when beta > 0
    ref_logps: torch.Tensor | None = None  # [B, T] log pi_ref, when beta > 0
    timings: dict = dataclasses.field(default_factory=dict)
