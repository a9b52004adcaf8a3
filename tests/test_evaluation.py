"""options/evaluation.py: greedy held-out evaluation (--eval_temperature 0), evaluation at the start and after the last step,
the training clock (--max_train_minutes); and recipes/arithmetic.py's task: a held-out split disjoint from training,
scored by an exact check."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import rewards
import rollout
import train
from options import evaluation
from step import data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "recipes"))
import arithmetic  # noqa: E402

CPU = torch.device("cpu")


def cfg_for(*flags, **overrides):
    cfg = train.parse_config(list(flags))
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def greedy_batch(model, tokenizer, rows, **overrides):
    cfg = evaluation.eval_config(cfg_for(eval_temperature=0.0, max_completion_length=5, **overrides))
    return rollout.DecodeLoop(cfg, model, tokenizer, None, CPU).generate(rows)


def test_greedy_decoding_takes_the_most_likely_token_at_every_position():
    """Brute force: one teacher-forced forward over each greedy completion; every token is the argmax of the logits
    that produced it (to a tolerance: a near-tie may go either way in another kernel). A sample at temperature 1 of this
    random model's near-uniform logits is the argmax about one time in ten."""
    model, tokenizer, dataset = data.embedded_task(seed=0)
    rows = dataset[:32]
    batch = greedy_batch(model, tokenizer, rows, temperature=1.0)
    assert len(batch.completion_lists) == 32  # one completion per prompt
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    L = batch.prompt_ids.shape[1]
    before = logits[:, L - 1:-1]  # [B, T] the logits each completion token was chosen from
    chosen = before.gather(-1, batch.completion_ids[..., None])[..., 0]
    gap = (before.max(-1).values - chosen)[batch.completion_mask.bool()]
    assert gap.max() < 1e-4, gap.max()


def test_greedy_evaluation_is_deterministic_and_has_no_loss():
    """Two evaluations of the same weights give the same completions, whatever torch's RNG did in between; with one
    completion per prompt there is no leave-one-out loss and no zero-std groups to count."""
    model, tokenizer, dataset = data.embedded_task(seed=0)
    cfg = cfg_for(eval_temperature=0.0, max_completion_length=5, per_device_train_batch_size=16)
    generator = rollout.DecodeLoop(evaluation.eval_config(cfg), model, tokenizer, None, CPU)
    funcs = rewards.load_rewards(cfg, CPU)
    first = evaluation.evaluate(cfg, generator, {"test": dataset.select(range(40))}, funcs, model, step=0)
    torch.rand(100)
    again = evaluation.evaluate(cfg, generator, {"test": dataset.select(range(40))}, funcs, model, step=0)
    assert json.dumps(first, sort_keys=True) == json.dumps(again, sort_keys=True)  # NaN where none terminated
    assert "eval_reward" in first and "eval_loss" not in first and "eval_frac_reward_zero_std" not in first
    sampled = evaluation.evaluate(cfg_for(max_completion_length=5, per_device_train_batch_size=16),
                                  rollout.DecodeLoop(cfg_for(max_completion_length=5), model, tokenizer, None, CPU),
                                  {"test": dataset.select(range(40))}, funcs, model, step=0)
    assert "eval_loss" in sampled and sampled["eval_reward"] != first["eval_reward"]


def test_greedy_evaluation_with_several_completions_per_prompt_is_one_line():
    out = subprocess.run([sys.executable, "train.py", "--dataset", "x.jsonl", "--eval_split", "test",
                          "--eval_temperature", "0", "--num_generations_eval", "4"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "--eval_temperature 0 decodes greedily" in out.stderr and "drop --num_generations_eval" in out.stderr


def test_the_clock_does_not_count_what_it_was_paused_for():
    clock = evaluation.Clock(limit=0.3)
    with clock.paused():
        time.sleep(0.4)
    assert clock.seconds() < 0.3 and not clock.out_of_time()
    time.sleep(0.35)
    assert clock.out_of_time()
    assert not evaluation.Clock(limit=None).out_of_time()


@pytest.fixture(scope="module")
def copy_task_splits(tmp_path_factory):
    """The embedded copy task as a dataset directory with train and test splits."""
    from datasets import DatasetDict
    dataset = data.embedded_task(seed=0)[2]
    path = tmp_path_factory.mktemp("copy") / "splits"
    DatasetDict(train=dataset.select(range(512)), test=dataset.select(range(512, 544))).save_to_disk(path)
    return path


def run(args):
    return subprocess.run([sys.executable, "train.py", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_held_out_accuracy_before_during_and_after_a_run_cut_by_its_time_budget(tmp_path, copy_task_splits):
    """--eval_on_start evaluates the starting model at step 0, then every eval_steps and after the last step; a
    --max_train_minutes budget ends the run early as at its last step: the window logged, the checkpoint and the
    final model saved, and the held-out score of the weights it ended with."""
    out = tmp_path / "run"
    result = run(["--dataset", str(copy_task_splits), "--eval_split", "test", "--eval_temperature", "0",
                  "--eval_on_start", "--eval_steps", "4", "--max_steps", "100000", "--max_train_minutes", "0.1",
                  "--logging_steps", "1000", "--save_steps", "100000", "--output_dir", str(out)])
    assert result.returncode == 0, result.stderr[-2000:]
    rows = read_metrics(out)
    evals = [r for r in rows if "eval_reward" in r]
    last = rows[-1]["step"]
    assert 4 < last < 100000  # the budget, not max_steps, ended it
    assert [r["step"] for r in evals] == [0, *range(4, last + 1, 4)] + ([last] if last % 4 else [])
    assert any("reward" in r and r["step"] == last for r in rows)  # the last window is logged
    assert os.path.isdir(out / f"checkpoint-{last}") and os.path.exists(out / "model.safetensors")
    assert "step 0: eval_reward=" in result.stdout


def test_the_arithmetic_splits_are_disjoint_seeded_and_correct():
    splits = arithmetic.arithmetic_splits(num_train=3000, num_test=300)
    assert len(splits["train"]) == 3000 and len(splits["test"]) == 300
    assert splits == arithmetic.arithmetic_splits(num_train=3000, num_test=300)
    assert splits != arithmetic.arithmetic_splits(num_train=3000, num_test=300, seed=1)

    def problem(row):
        return row["prompt"][0]["content"].split("What is ")[1].split("?")[0]

    def swapped(text):
        a, op, b = text.split(" ")
        return f"{b} {op} {a}"
    train_problems = {problem(r) for r in splits["train"]}
    for row in splits["test"]:
        assert problem(row) not in train_problems and swapped(problem(row)) not in train_problems or \
            problem(row).split(" ")[1] == "-" and problem(row) not in train_problems
    for row in splits["train"] + splits["test"]:
        a, op, b = problem(row).split(" ")
        want = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert row["solution"] == str(want)
    ops = {problem(r).split(" ")[1] for r in splits["test"]}
    assert ops == {"+", "-", "*"}


def test_the_arithmetic_verifier_reads_the_answer():
    score = rewards.BUILTINS["last_number_reward"]
    completions = ["42", "17 + 25 = 42", "The answer is 42.", "42, or maybe 41", "forty-two", "-42"]
    assert score(completions, solution=["42"] * 6) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert score(["3 - 5 = -2"], solution=["-2"]) == [1.0]


FORMAT_REWARD = '''
import rewards


def brevity_reward(completions, **kwargs):
    """The answer's form alone: 1 for an empty completion, falling to 0 at 48 characters."""
    return [max(0.0, 1 - len(rewards._text(c).strip()) / 48) for c in completions]
'''


@pytest.mark.slow
def test_the_arithmetic_recipe_on_the_real_model(tmp_path, smollm2_dir):
    """recipes/arithmetic.py's pieces on SmolLM2: rloo's greedy evaluation of the starting model scores what
    transformers' generate scores (bench_learning.greedy_accuracy: the chat template, EOS and the verifier read
    alike), and the first steps raise a reward that is easy to raise, the answer's brevity (the accuracy reward
    weighted 0: measured, not trained on). Brevity scores every sample, so each group has a signal in fp32 and bf16
    alike; a bare-number reward did not: SmolLM2 in fp32 (a CPU without AVX512-BF16) sampled no bare number in 8
    steps of 256, where bf16 sampled a few."""
    import bench_learning
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data_dir = arithmetic.write_data(str(tmp_path / "data"), num_train=256, num_test=32)
    (tmp_path / "format.py").write_text(FORMAT_REWARD)
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "recipes/arithmetic.py", "--model", str(smollm2_dir), "--dataset", data_dir,
         "--reward_funcs", "last_number_reward", f"{tmp_path / 'format.py'}:brevity_reward",
         "--reward_weights", "0", "1", "--num_generations", "8", "--per_device_train_batch_size", "32",
         "--max_completion_length", "12", "--learning_rate", "3e-5", "--max_steps", "8", "--logging_steps", "1",
         "--eval_steps", "100", "--output_dir", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(out)
    evals = [r for r in rows if "eval_reward" in r]
    assert [r["step"] for r in evals] == [0, 8]
    test = list(load_from_disk(data_dir)["test"])
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    accuracy = bench_learning.greedy_accuracy(model, AutoTokenizer.from_pretrained(smollm2_dir), test,
                                              bench_learning.native_bf16(), 12)
    # one problem may flip where two tokens tie in bf16; a sampled or differently prompted evaluation moves more
    assert abs(evals[0]["eval_rewards/last_number_reward/mean"] - accuracy) <= 1 / 32 + 1e-6, (evals[0], accuracy)
    # The guard is the training reward, 256 samples a step: measured on 32 greedy problems after 8 steps the gain is
    # seed noise in bf16 (an AMX CPU: +0.10, +0.22, +0.09 over seeds 0-2; fp32 +0.23), in training brevity first step
    # -> last two +0.24, +0.44, +0.39 (fp32 +0.32). A flipped sign lengthens the completions: both fall.
    train = [r["rewards/brevity_reward/mean"] for r in rows if "loss" in r]
    assert len(train) == 8 and (train[-1] + train[-2]) / 2 >= train[0] + 0.15, train
    before, after = (e["eval_rewards/brevity_reward/mean"] for e in evals)
    assert after > before, (before, after)
