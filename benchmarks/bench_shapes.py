"""bench.py's benchmarks of one phase on batch shapes its named configs lack: long-tailed lengths
(--long_tail, the training passes) and multi-turn trajectories (--multi_turn, the decode loop).

--long_tail [--multi_turn]: a step's training passes, padded, --padding_free, and --padding_free
with --max_tokens_per_microbatch 4096, side by side, on one synthetic batch: 64 prompts of 16..32
tokens; completions of 8..512 tokens (cubed uniform: mean ~128, a few near 512), or with
--multi_turn 1..4 model turns of 8..128 tokens (cubed uniform) with a 31-token environment reply
between turns (context, outside s_i). Micro-batches of 16, fp32. A step is train.py's after
generation (unchanged by these flags): the reference's no-grad forward (batch_logps, as beta > 0
runs it) and policy_step (forward+backward, optimizer). Each variant runs in a fresh process, since
peak memory is a process's high-water mark (metrics.run_peak: the peak RSS on a CPU, the
allocator's max_memory_allocated on a GPU), reported above what was in use before the first step."""
import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the trainer's files, one folder up

import torch  # noqa: E402

import rollout  # noqa: E402
import train  # noqa: E402
from options import environments  # noqa: E402
from step import forward, metrics, prompting  # noqa: E402
from step.batches import Rollout  # noqa: E402

VARIANTS = {"padded": ["--padding_free", "false"], "padding_free": ["--padding_free", "true"],
            "padding_free, 4096 tokens": ["--padding_free", "true",
                                          "--max_tokens_per_microbatch", "4096"]}
B, L, MICRO, REPLY = 64, 32, 16, 31


def synthetic_batch(multi_turn, seed=0):
    """The benchmark's Rollout (random tokens), its generated_mask set under multi_turn."""
    g = torch.Generator().manual_seed(seed)
    generated = None
    if multi_turn:
        rows = []
        for _ in range(B):
            row = []
            for turn in range(int(torch.randint(1, 5, (1,), generator=g))):
                row += [0] * REPLY if turn else []
                row += [1] * int(8 + 120 * torch.rand(1, generator=g) ** 3)
            rows.append(row)
        generated = prompting.pad(rows, 0)  # [B, T]
        lengths = torch.tensor([len(row) for row in rows])
    else:
        lengths = (8 + 504 * torch.rand(B, generator=g) ** 3).long()  # [B]
    T = int(lengths.max())
    prompt_mask = (torch.arange(L) >= L - torch.randint(16, L + 1, (B,), generator=g)[:, None])
    return Rollout(rows={}, prompt_ids=torch.randint(12, 256, (B, L), generator=g),
                   prompt_mask=prompt_mask.long(),
                   completion_ids=torch.randint(12, 256, (B, T), generator=g),
                   completion_mask=(torch.arange(T) < lengths[:, None]).long(),
                   truncated=torch.zeros(B, dtype=torch.bool), completion_lists=[], texts=[],
                   generated_mask=generated)


def padding_share(batch):
    """The share of the padded forward's tokens that are padding (micro-batches of MICRO rows)."""
    lengths = batch.prompt_mask.sum(-1) + batch.completion_mask.sum(-1)  # [B]
    padded = sum(MICRO * (int(batch.prompt_mask[i:i + MICRO].sum(-1).max())
                          + int(batch.completion_mask[i:i + MICRO].sum(-1).max()))
                 for i in range(0, B, MICRO))
    return 1 - int(lengths.sum()) / padded


def run_variant(model_dir, flags, steps, multi_turn):
    """One variant in this process: median seconds of each phase over steps (after one warm-up),
    the training phase's tokens/s (prompt and completion tokens) and the peak memory in MiB."""
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device)
    reference = AutoModelForCausalLM.from_pretrained(model_dir).to(device).requires_grad_(False)
    batch = synthetic_batch(multi_turn)
    batch = dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device)
                                          for f in dataclasses.fields(batch)
                                          if isinstance(getattr(batch, f.name), torch.Tensor)})
    cfg = train.parse_config(["--per_device_train_batch_size", str(MICRO), "--bf16", "false",
                              *flags])
    scores = train.Scores(None, None, batch.model_tokens().float(), torch.randn(B, device=device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    before = metrics.in_use()
    rows = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        forward.batch_logps(reference, batch, cfg)
        row = {"time/reference": time.perf_counter() - start}
        row.update(metrics.settle(train.policy_step(cfg, model, optimizer, scheduler, batch,
                                                    scores)[3]))
        row["step_time"] = time.perf_counter() - start
        rows.append(row)
    med = {key: statistics.median(row[key] for row in rows[1:]) for key in rows[0]}
    training = med["time/forward_backward"] + med["time/optimizer"]
    tokens = int(batch.prompt_mask.sum() + batch.completion_mask.sum())
    med["tokens_per_second/training"] = tokens / training
    med["peak_mib"] = metrics.run_peak() - before  # the process's peak above the models and batch
    return med


def long_tail(model_dir, steps, multi_turn):
    """Each variant in its own process on model_dir; prints the batch and one table."""
    batch = synthetic_batch(multi_turn)
    lengths = batch.completion_mask.sum(-1).float()
    print(f"{B} completions{' (multi-turn)' if multi_turn else ''}, mean length "
          f"{lengths.mean():.0f}, max {int(lengths.max())}; "
          f"{int(batch.prompt_mask.sum() + lengths.sum())} real tokens, padding "
          f"{padding_share(batch):.0%} of the padded forward's; medians of {steps} steps")
    keys = ["tokens_per_second/training", "time/forward_backward", "time/optimizer",
            "time/reference", "step_time", "peak_mib"]
    print("| variant | " + " | ".join(keys) + " |\n" + "|---" * (len(keys) + 1) + "|")
    results = {}
    for name, flags in VARIANTS.items():
        cmd = [sys.executable, __file__, model_dir, json.dumps(flags), str(steps),
               str(int(multi_turn))]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results[name] = json.loads(out.splitlines()[-1])
        print(f"| {name} | " + " | ".join(f"{results[name][k]:.4g}" for k in keys) + " |",
              flush=True)
    return results


class Replies:
    """--multi_turn's environment: the same 31-token reply to each of three model turns."""
    def __init__(self):
        self.turns = 0

    def step(self, text):
        self.turns += 1
        return "1234567890" * 3 + "=", self.turns == 4


def multi_turn(path, c, num_steps):
    """Our decode loop alone over 4-turn trajectories of the model (random; prompts of 256
    tokens, replies of 31, turns ending at one of 16 stop tokens, so about 16 tokens each): each
    trajectory's KV cache kept from turn to turn (DecodeSession) against every turn decoded afresh
    from the whole trajectory. Median seconds per batch of the config's size. path: the model's
    directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    cfg = train.parse_config(["--num_generations", str(c["num_generations"]), "--bf16", "false",
                              "--max_completion_length", "64", "--generation_kwargs",
                              json.dumps({"stop_token_ids": list(range(12, 28))})])
    loop = rollout.DecodeLoop(cfg, model, tokenizer, None, torch.device("cpu"))
    eos_ids = prompting.eos_token_ids(tokenizer, model, cfg)
    g = torch.Generator().manual_seed(0)
    rows = {"prompt": torch.randint(12, 256, (c["batch"] // c["num_generations"], 256),
                                    generator=g).tolist()}
    for name, generator in [("kept", loop), ("afresh", argparse.Namespace(
            generate=loop.generate, device=loop.device))]:
        turn_loop = environments.MultiTurn(cfg, generator, lambda row: Replies(), tokenizer,
                                           eos_ids, 512)
        times = []
        for step in range(num_steps):
            start = time.perf_counter()
            batch = turn_loop.generate(rows, seed=step)
            times.append(time.perf_counter() - start)
        print(f"{name:7s} {statistics.median(times[3:]):.3f} s per batch of {c['batch']} "
              f"(turns {batch.turn_stats['turns'].mean():.2f}, model tokens "
              f"{batch.model_tokens().sum(-1).float().mean():.1f} a trajectory)", flush=True)


def run(model_dir, c, args, steps):
    """bench.py --long_tail [--multi_turn] (default 5 steps) or --multi_turn on model_dir, which
    is removed after."""
    try:
        if args.long_tail:
            long_tail(model_dir, args.steps or 5, args.multi_turn)
        else:
            multi_turn(model_dir, c, steps)
    finally:
        shutil.rmtree(model_dir)


if __name__ == "__main__":  # one variant: model_dir, flags (JSON), steps, multi_turn (0/1)
    print(json.dumps(run_variant(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]),
                                 sys.argv[4] == "1")))
