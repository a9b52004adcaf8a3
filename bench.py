"""Benchmark: run train.py on a fixed config and print median per-phase seconds, throughput and peak memory.

    python bench.py                      # the embedded tiny model, 30 steps, beta=0.05 (reference forward included)
    python bench.py --max_steps 50 ...   # any train.py flag overrides the benchmark config
    python bench.py --model DIR --dataset data.jsonl --reward_funcs accuracy_reward --use_vllm [--vllm_mode server]
    torchrun --standalone --nproc_per_node=2 bench.py

Numbers come from the metrics train.py logs every step (logging_steps=1); the first 3 steps are warm-up and dropped.
"""

import json
import os
import resource
import statistics
import sys
import tempfile

import torch

import train

BENCH = ["--max_steps", "30", "--logging_steps", "1", "--beta", "0.05", "--per_device_train_batch_size", "64",
         "--num_generations", "8", "--max_completion_length", "16"]


def main():
    output_dir = tempfile.mkdtemp(prefix="rloo-bench-")
    train.main(BENCH + ["--output_dir", output_dir] + sys.argv[1:])
    if int(os.environ.get("RANK", 0)) != 0:
        return
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f][3:]
    rows = ["step_time", "time/weight_sync", "time/generation", "time/scoring", "time/training",
            "tokens_per_second/generation",
            "tokens_per_second/training", "completions/mean_length", "sampling/sampling_logp_difference/mean"]
    print(f"\nbench: median over {len(steps)} steps (after 3 warm-up steps)")
    for key in rows:
        values = [s[key] for s in steps if s.get(key) is not None]
        if values:  # time/weight_sync only with vLLM (time/generation includes it)
            print(f"  {key:32s} {statistics.median(values):10.4f}")
    print(f"  {'steps_per_second':32s} {1 / statistics.median(s['step_time'] for s in steps):10.4f}")
    print(f"  {'peak_rss_mib':32s} {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:10.1f}")
    if torch.cuda.is_available():
        print(f"  {'peak_cuda_mib':32s} {torch.cuda.max_memory_allocated() / 2**20:10.1f}")


if __name__ == "__main__":
    main()
