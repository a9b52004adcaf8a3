"""Where each step's batch comes from: the next prompts of the data, generated, and optionally filtered.

- Synchronous (default): the step's prompts, sampled with the newest weights.
- --async_generation (a vLLM server): while the trainer updates on batch t, the server already samples batch t + lag
  with the weights of step t, so a batch is `lag` optimizer steps stale. The trainer keeps clipping against its own
  first-pass log-probs and corrects the staleness with the truncated importance weight min(exp(s_trainer - s_sampler),
  C) per sequence (rloo_loss's is_weights; Yao et al. 2025, truncated importance sampling).
- --dynamic_sampling (DAPO, Yu et al. 2025, §3.2): a group whose raw rewards (before the KL term) all agree has no
  learning signal; drop it and sample more prompts, at most --max_dynamic_sampling_rounds extra rounds, then train on
  what there is (topped up with dropped groups: the batch keeps its shape on every rank).

The data position (prompt batches drawn) no longer follows from the step: state() returns it and, with async
generation, the batches in flight (sampled by weights that no checkpoint holds), and the checkpoint saves both.
"""

import collections
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

import data
import distributed
import rewards as rewards_lib
from config import fail
from metrics import timed
from rloo import combine_rewards


def batch_source(cfg, generate, push_weights, dataset, reward_funcs, pad_id, saved):
    """-> (next_batch(step) -> (rows, batch, metrics), state() -> what a checkpoint keeps, stop()).
    generate(rows, seed) -> batch; push_weights(): the policy's weights to the generator (async only: otherwise
    generate pushes them itself); saved: state() of the checkpoint resumed from ({} at the start)."""
    prompts = data.prompt_batches(dataset, cfg, start=saved.get("position", 0))
    position = saved.get("position", 0)
    in_flight = collections.deque(saved.get("in_flight", []))  # (rows, batch or future, version) of async generation
    pool = ThreadPoolExecutor(1, thread_name_prefix="rloo-generate") if cfg.async_generation else None

    def draw(version):
        """The next prompts and their generation (a future under async generation) -> (rows, batch, version)."""
        nonlocal position
        rows, seed = next(prompts), request_seed(cfg, position)
        position += 1
        return rows, pool.submit(generate, rows, seed) if pool else generate(rows, seed), version

    def next_batch(step):
        metrics = {}
        if not pool:
            rows, batch, _ = draw(step)
            if cfg.dynamic_sampling:
                rows, batch, metrics = fill_with_informative(cfg, rows, batch, lambda: draw(step)[:2], reward_funcs,
                                                             step, pad_id)
            return rows, batch, metrics
        settle(in_flight)  # the server is idle before it gets new weights
        with timed(metrics, "time/weight_sync"):
            push_weights()
        while len(in_flight) <= cfg.async_generation_lag:
            in_flight.append(draw(step))
        rows, batch, version = in_flight.popleft()
        return rows, finished(batch), {**metrics, "sampling/staleness": float(step - version)}

    def state():
        settle(in_flight)
        return {"position": position, "in_flight": list(in_flight)}

    def stop():
        if pool:
            pool.shutdown(wait=True, cancel_futures=True)  # joined before the process group goes

    return next_batch, state, stop


def settle(in_flight):
    """Wait for every generation in flight; a failed one raises here, in the trainer's thread."""
    for i, (rows, batch, version) in enumerate(in_flight):
        in_flight[i] = (rows, finished(batch), version)


def finished(batch):
    """A generated batch, or the future of one waited for."""
    return batch.result() if hasattr(batch, "result") else batch


def request_seed(cfg, position):
    """The sampling seed of one prompt batch on this rank: a function of the run's seed, the data position and the
    rank, so a server's samples are the same in a resumed run (vLLM gives each prompt's G samples seed + j)."""
    return int(np.random.SeedSequence([cfg.seed, position, distributed.rank()]).generate_state(1)[0])


def fill_with_informative(cfg, rows, batch, draw, reward_funcs, step, pad_id):
    """Dynamic sampling: keep the groups whose raw rewards differ, drawing more prompts until there are P of them on
    every rank or the rounds run out (all ranks draw the same number of rounds, so collectives stay in lockstep).
    -> (rows, batch, metrics); batch["rewards_per_func"] holds the raw rewards it was filtered on."""
    G, P = cfg.num_generations, data.prompts_per_rank(cfg)
    if "pixel_inputs" in batch:
        fail("--dynamic_sampling does not support datasets with images yet; drop the flag")
    weights = rewards_lib.reward_weights(cfg, reward_funcs)
    parts, rounds = [], 0
    while True:
        batch["rewards_per_func"] = rewards_lib.call_rewards(reward_funcs, rows, batch, G, step, cfg.reward_timeout)
        raw = combine_rewards(batch["rewards_per_func"], weights.to(batch["rewards_per_func"].device))  # [B]
        parts.append((rows, batch, informative_groups(raw, G)))
        missing = max(P - sum(int(good.sum()) for _, _, good in parts), 0)  # informative groups still wanted
        missing = distributed.reduce_sums({"missing": torch.tensor(float(missing))})["missing"]  # all ranks
        if not missing or rounds == cfg.max_dynamic_sampling_rounds:
            break
        rows, batch = draw()
        rounds += 1
    # the informative groups first, in the order drawn; after the bound, dropped ones fill the batch to P groups
    picks = ([(i, g) for i, (_, _, good) in enumerate(parts) for g in good.nonzero().flatten().tolist()] +
             [(i, g) for i, (_, _, good) in enumerate(parts) for g in (~good).nonzero().flatten().tolist()])[:P]
    metrics = {"dynamic_sampling/rounds": float(rounds),
               "dynamic_sampling/shortfall": missing / (P * distributed.world_size())}
    return select_rows(parts, picks), join_groups(parts, picks, G, pad_id), metrics


def informative_groups(raw, G):
    """[B] raw rewards -> [B / G] bool: the group's scored rewards do not all agree (NaN = unscored, ignored)."""
    r = raw.view(-1, G)
    return r.nan_to_num(float("inf")).amin(1) < r.nan_to_num(float("-inf")).amax(1)


def select_rows(parts, picks):
    """The dataset rows (dict of column lists) of the picked groups, in order."""
    return {key: [parts[i][0][key][g] for i, g in picks] for key in parts[0][0]}


def join_groups(parts, picks, G, pad_id):
    """One batch of the picked groups: prompts re-padded on the left, completions on the right, lists concatenated."""
    batches = [parts[i][1] for i, _ in picks]
    rows = [torch.arange(g * G, (g + 1) * G) for _, g in picks]
    joined = {"timings": {}}
    for key, value in batches[0].items():
        if isinstance(value, torch.Tensor):
            pieces = [b[key][r.to(b[key].device)] for b, r in zip(batches, rows)]
            joined[key] = torch.cat(pad_to_common_width(key, pieces, pad_id))
        elif isinstance(value, list):
            joined[key] = [b[key][i] for b, r in zip(batches, rows) for i in r.tolist()]
    return joined


def pad_to_common_width(key, pieces, pad_id):
    """Pad [b, T] pieces to the widest: prompts (left-padded) on the left, completions on the right; ids with
    pad_id, masks and log-probs with 0."""
    if pieces[0].dim() == 1:
        return pieces
    width, value = max(p.shape[1] for p in pieces), pad_id if key.endswith("_ids") else 0
    pads = [p.new_full((p.shape[0], width - p.shape[1]), value) for p in pieces]
    return [torch.cat([pad, p] if key.startswith("prompt") else [p, pad], 1) for p, pad in zip(pieces, pads)]
