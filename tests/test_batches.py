"""step/batches.py: dynamic sampling on hand-built batches and in runs, and async generation against a real vLLM server
(lag 0 equals the synchronous run, lag 1 trains on the previous step's samples, a killed run resumes exactly)."""

import copy
import json
import os

import pytest
import torch
from datasets import Dataset

import rollout
import train
from plumbing import models
from step import batches, data, forward
from rewards import RewardFunctions
from conftest import length_reward_task, requires_vllm
from test_rollout import vllm_server  # noqa: F401 (a fixture: vLLM's server on the tiny chat model)
from test_train import cfg_for, read_metrics, run

CPU = torch.device("cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def first_digit_reward(completions, prompts, **kwargs):
    """Constant within a group when the prompt starts with 1 (uninformative), the completion's length otherwise."""
    return [1.0 if p.startswith("1") else float(len(c)) for p, c in zip(prompts, completions)]


def test_informative_groups_ignore_unscored_members():
    raw = torch.tensor([1.0, 1.0, 0.0, 1.0, float("nan"), 2.0, float("nan"), 2.0, float("nan"), float("nan")])
    assert batches.informative_groups(raw, 2).tolist() == [False, True, False, False, False]


def dynamic_cfg(**overrides):
    return cfg_for(num_generations=4, per_device_train_batch_size=16, max_completion_length=6, dynamic_sampling=True,
                   **overrides)


def test_dynamic_sampling_keeps_informative_groups_and_draws_more():
    """Rounds of 4 prompts, half of them uninformative: 2 rounds give the 4 informative groups the batch needs; the
    joined batch holds exactly those groups, re-padded, with tokens, masks, log-probs and lists that still agree."""
    model, tokenizer, _ = data.embedded_task(seed=0)
    cfg = dynamic_cfg()
    rounds = iter([["12=", "345=", "1=", "6789="], ["10=", "22=", "1234=", "9876543="], ["1=", "1=", "1=", "1="]])

    def draw():
        return rollout.generate(model, tokenizer, {"prompt": next(rounds)}, cfg, CPU, seed=len(drawn))

    drawn = []

    def keep_draw():
        drawn.append(draw())
        return drawn[-1]

    first = keep_draw()
    rewards = RewardFunctions([first_digit_reward])
    joined, metrics = batches.fill_with_informative(cfg, first, keep_draw, rewards, 0, 0)
    assert joined.rows["prompt"] == ["345=", "6789=", "22=", "9876543="]  # prompts starting with 1 dropped
    assert metrics == {"dynamic_sampling/rounds": 1.0, "dynamic_sampling/shortfall": 0.0}
    assert len(drawn) == 2  # stopped as soon as 4 informative groups were there
    sources = [(drawn[0], 1), (drawn[0], 3), (drawn[1], 1), (drawn[1], 3)]
    for k, (source, group) in enumerate(sources):
        for j in range(4):
            i, s = k * 4 + j, group * 4 + j
            assert joined.completion_lists[i] == source.completion_lists[s]
            n = int(source.completion_mask[s].sum())
            assert joined.completion_ids[i, :n].tolist() == source.completion_ids[s, :n].tolist()
            assert joined.completion_mask[i].sum() == n and not joined.completion_mask[i, n:].any()
            torch.testing.assert_close(joined.sampler_logps[i, :n], source.sampler_logps[s, :n])
            real = source.prompt_ids[s][source.prompt_mask[s].bool()]
            assert joined.prompt_ids[i][joined.prompt_mask[i].bool()].tolist() == real.tolist()
            assert joined.prompt_mask[i, -len(real):].all()  # still left-padded
    raw = joined.rewards_per_func[:, 0].view(-1, 4)
    assert (raw.amax(1) > raw.amin(1)).all()  # no group whose raw rewards all agree


def test_dynamic_sampling_trains_on_what_it_has_after_the_bound():
    """Only uninformative prompts: after max_dynamic_sampling_rounds extra rounds the batch is filled with them and
    the shortfall is the metric, not an error."""
    model, tokenizer, _ = data.embedded_task(seed=0)
    cfg = dynamic_cfg(max_dynamic_sampling_rounds=2)
    drawn = []

    def draw():
        drawn.append(rollout.generate(model, tokenizer, {"prompt": ["1=", "12=", "13=", "14="]}, cfg, CPU))
        return drawn[-1]

    rewards = RewardFunctions([first_digit_reward])
    joined, metrics = batches.fill_with_informative(cfg, draw(), draw, rewards, 0, 0)
    assert len(drawn) == 3 and metrics == {"dynamic_sampling/rounds": 2.0, "dynamic_sampling/shortfall": 1.0}
    assert len(joined.rows["prompt"]) == 4 and joined.completion_ids.shape[0] == 16


@pytest.mark.slow
def test_embedded_task_learns_with_dynamic_sampling(tmp_path):
    """200 steps of the embedded default with dynamic sampling: measured 0.08 -> 0.65 (0.08 -> 0.42 without), with
    extra rounds drawn when early groups all score 0."""
    out = run(["--dynamic_sampling", "--max_steps", "200", "--logging_steps", "5", "--output_dir", str(tmp_path)],
              timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_metrics(tmp_path)
    first, last = metrics[0]["reward"], sum(m["reward"] for m in metrics[-4:]) / 4
    assert last >= 0.4 and last >= 3 * first, (first, last)
    assert sum(m["dynamic_sampling/rounds"] for m in metrics) > 0


def test_dynamic_sampling_run_logs_its_metrics_and_checkpoints_the_data_position(tmp_path):
    out = run(["--dynamic_sampling", "--max_steps", "4", "--logging_steps", "1", "--save_steps", "2",
               "--output_dir", str(tmp_path)])
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_metrics(tmp_path)
    assert all("dynamic_sampling/rounds" in m for m in metrics)
    rounds = sum(m["dynamic_sampling/rounds"] for m in metrics)
    state = json.load(open(tmp_path / "checkpoint-4" / "trainer_state.json"))
    assert state["position"] == 4 + rounds  # one prompt batch per step plus every extra round
    # epoch: passes over the prompts read (16 a batch of the task's 4096), extra rounds included
    read = [sum(1 + m["dynamic_sampling/rounds"] for m in metrics[:k + 1]) for k in range(4)]
    assert [m["epoch"] for m in metrics] == pytest.approx([r / 256 for r in read])


COUNT_PUSHES = """
import sys, train
from options import vllm_server
from vllm.v1.worker.gpu_worker import Worker
pushes = [0]
def counted(push):
    def push_and_count(*args, **kwargs):
        pushes[0] += 1
        return push(*args, **kwargs)
    return push_and_count
Worker.reload_weights = counted(Worker.reload_weights)  # colocated: through vLLM's worker, not its runner
vllm_server.push_weights_server = counted(vllm_server.push_weights_server)
train.main(sys.argv[1:])
print("PUSHES", pushes[0])
"""


@requires_vllm
@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_one_weight_push_per_step_with_dynamic_sampling(tmp_path, chat_model_dir, vllm_server, mode):
    """Extra dynamic-sampling rounds sample from the weights already pushed: a push per optimizer step, not per
    generation round (with every reward 0, each step uses all its extra rounds). A colocated push goes through the
    worker's reload_weights, which sets vLLM's current config and, in 0.34, lends the KV cache's memory and lifts
    its cap for the reload (the model runner's, called directly, skips both)."""
    import subprocess
    import sys

    data_file = tmp_path / "data.jsonl"
    data_file.write_text("".join(json.dumps({"prompt": f"{i} + {i} ="}) + "\n" for i in range(64)))
    out = subprocess.run([sys.executable, "-c", COUNT_PUSHES, "--model", str(chat_model_dir), "--dataset",
                          str(data_file), "--reward_funcs", "think_format_reward", "--use_vllm", "--vllm_mode", mode,
                          *(["--vllm_server_port", str(vllm_server)] if mode == "server" else []), "--dynamic_sampling",
                          "--max_dynamic_sampling_rounds", "2", "--bf16", "false", "--num_generations", "4",
                          "--per_device_train_batch_size", "8", "--max_completion_length", "4", "--max_steps", "3",
                          "--logging_steps", "1", "--output_dir", str(tmp_path / "run")],
                         capture_output=True, text=True, cwd=ROOT, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert sum(m["dynamic_sampling/rounds"] for m in metrics) == 6  # 3 generations a step
    assert "PUSHES 3" in out.stdout, out.stdout[-500:]


@requires_vllm
def test_async_lag_1_trains_on_the_previous_steps_samples(chat_model_dir, vllm_server):
    """Through the recorded log-probs: at step t the batch's sampler log-probs are those of step t-1's weights (the
    trainer's forward with a copy of them), not of the current ones; step 0's batch is of the initial weights."""
    cfg = train.parse_config(["--model", str(chat_model_dir), "--dataset", "x", "--reward_funcs", "think_format_reward",
                              "--use_vllm", "--vllm_mode", "server", "--vllm_server_port", str(vllm_server),
                              "--async_generation", "--bf16", "false", "--num_generations", "4",
                              "--per_device_train_batch_size", "8", "--max_completion_length", "8",
                              "--output_dir", "/tmp/unused-async"])
    train.check_config(cfg)
    model, tokenizer = models.load_model(cfg.model)
    model = models.prepare_model(model, cfg, trainable=True)
    generator = train.start_generator(cfg, model, tokenizer, None, None, CPU)
    dataset = Dataset.from_dict({"prompt": [f"Count to {i}:" for i in range(40)]})
    source = batches.BatchSource(cfg, generator, dataset, None, tokenizer, {})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # large steps: each step's weights are distinct
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    previous = copy.deepcopy(model)
    for step in range(3):
        batch, metrics = source.next(step)
        assert metrics["sampling/staleness"] == (1.0 if step else 0.0)
        with torch.no_grad():
            now = forward.forward_logps(model, batch, slice(None), 1.0)[0]
            then = forward.forward_logps(previous, batch, slice(None), 1.0)[0]
        mask = batch.completion_mask[:, :now.shape[1]]
        sampled = batch.sampler_logps[:, :now.shape[1]]
        assert ((sampled - then).abs() * mask).max() < 1e-4, step  # step t-1's weights sampled it
        if step:
            assert ((sampled - now).abs() * mask).max() > 1e-3, step  # not step t's
        previous = copy.deepcopy(model)
        train.policy_step(cfg, model, optimizer, scheduler, batch,
                          train.Scores(None, None, mask.float(), torch.randn(len(batch.completion_lists))))
    source.close()
    generator.close()


def server_args(tmp_path, chat_model_dir, port, *flags):
    """train.py on the tiny chat model against the server: 8 conversational prompts per step, a length reward."""
    rows, reward = length_reward_task(tmp_path)
    return ["--model", str(chat_model_dir), "--dataset", rows, "--reward_funcs", reward,
            "--use_vllm", "--vllm_mode", "server", "--vllm_server_port", str(port), "--bf16", "false",
            "--num_generations", "4", "--per_device_train_batch_size", "8", "--max_completion_length", "8",
            "--learning_rate", "1e-3", "--logging_steps", "1", *flags]


@requires_vllm
def test_async_lag_0_reproduces_the_synchronous_run(tmp_path, chat_model_dir, vllm_server):
    """Seeded requests make a server's samples a function of the weights and the data position, so the overlapped
    path with no lag (push, sample, train) gives the synchronous run's metrics."""
    args = server_args(tmp_path, chat_model_dir, vllm_server, "--max_steps", "4", "--vllm_importance_sampling_cap", "2")
    sync = run(args + ["--output_dir", str(tmp_path / "sync")])
    assert sync.returncode == 0, sync.stderr[-3000:]
    lag0 = run(args + ["--async_generation", "--async_generation_lag", "0", "--output_dir", str(tmp_path / "lag0")])
    assert lag0.returncode == 0, lag0.stderr[-3000:]
    expected, got = read_metrics(tmp_path / "sync"), read_metrics(tmp_path / "lag0")
    assert len(got) == 4 and all(m["sampling/staleness"] == 0 for m in got)
    for e, g in zip(expected, got):
        for key in ("reward", "loss", "grad_norm", "kl", "completions/mean_length",
                    "sampling/importance_sampling_ratio/mean"):
            assert g[key] == pytest.approx(e[key], rel=1e-5, abs=1e-6), (e["step"], key)


@requires_vllm
def test_async_run_resumes_after_sigkill_like_one_that_never_stopped(tmp_path, chat_model_dir, vllm_server):
    """Killed after a checkpoint, the batch in flight (sampled by weights no checkpoint holds) comes back from the
    checkpoint; every later step equals the uninterrupted run's, staleness 1 and the importance weights logged."""
    from test_train import kill_after_checkpoint

    args = server_args(tmp_path, chat_model_dir, vllm_server, "--async_generation", "--max_steps", "10", "--save_steps",
                       "2")
    whole = run(args + ["--output_dir", str(tmp_path / "whole")])
    assert whole.returncode == 0, whole.stderr[-3000:]
    kill_after_checkpoint(args, tmp_path / "killed", torchrun=False)
    assert os.path.exists(tmp_path / "killed" / "checkpoint-4" / "in_flight_rank0.pt")
    resumed = run(args + ["--output_dir", str(tmp_path / "killed"), "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, got = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "killed")
    assert [m["step"] for m in got] == list(range(1, 11))
    assert all(m["sampling/staleness"] == (1 if m["step"] > 1 else 0) for m in expected)
    assert 0 < expected[-1]["sampling/importance_sampling_ratio/mean"] <= 2
    for e, g in zip(expected, got):
        for key in ("reward", "loss", "grad_norm", "kl", "completions/mean_length"):
            assert g[key] == pytest.approx(e[key], rel=1e-5, abs=1e-6), (e["step"], key)


@requires_vllm
def test_async_under_torchrun_overlaps_on_every_rank_and_exits_cleanly(tmp_path, chat_model_dir, vllm_server):
    out = run(server_args(tmp_path, chat_model_dir, vllm_server, "--async_generation", "--max_steps", "3",
                          "--output_dir", str(tmp_path / "run")), torchrun=True)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert [m["sampling/staleness"] for m in metrics] == [0, 1, 1]
