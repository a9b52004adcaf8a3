"""Bad input, one row per case: each kind of input (flags, dataset rows, reward functions and their outputs,
checkpoints, signals, the disk) is checked where it enters, and each case ends in one clear line naming the flag,
row, function or checkpoint at fault, with no traceback and nothing lost (docs/troubleshooting.md 'When something goes wrong').

Cheap cases run in this process through the checkers themselves; the rest run train.py end to end."""

import dataclasses
import importlib.util
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
import train
from plumbing import checks, config, directories
from step import batches, data
from conftest import drained, in_process, read_only_mount, start_drained
from test_train import FAST, read_metrics, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def startup_error(args):
    """The one line check_config stops with for these flags (parsing included), or None."""
    try:
        cfg = train.parse_config(args)
        train.check_config(cfg)
        directories.check_output_dir(cfg)
    except SystemExit as e:
        return str(e)
    return None


# ------------------------------------------------------------------------------------------------ flags

FLAG_CASES = [  # (flags, what the line must say); marked "ours" where the issue did not list the case
    (["--save_total_limit", "-1"], "--save_total_limit -1: must be >= 1"),  # deleted every checkpoint
    (["--max_grad_norm", "-1"], "--max_grad_norm -1.0: must be >= 0"),  # gradient ascent
    (["--top_p", "2"], "--top_p 2.0: must be in (0, 1]"),
    (["--top_p", "nan"], "--top_p nan: must be in (0, 1]"),
    (["--max_steps", "-5"], "--max_steps -5: must be -1 (run num_train_epochs) or >= 1"),
    (["--max_steps", "3", "false"], "false: not a flag nor a flag's value"),  # a flag lost, its value left
    (["--num_train_epochs", "0"], "--num_train_epochs 0.0: must be > 0"),
    (["--beta", "nan"], "--beta nan: must be >= 0"),
    (["--reward_weights", "nan"], "--reward_weights nan: must be finite"),
    (["--learning_rate", "-1"], "--learning_rate -1.0: must be >= 0"),
    (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size 0: must be >= 1"),
    (["--logging_steps", "0"], "--logging_steps 0: must be >= 1"),
    (["--eval_steps", "0"], "--eval_steps 0: must be >= 1"),
    (["--top_k", "-1"], "--top_k -1: must be >= 0"),
    (["--repetition_penalty", "0"], "--repetition_penalty 0.0: must be > 0"),
    (["--temperature", "nan"], "--temperature nan: must be > 0"),
    (["--seed", "-1"], "--seed -1: must be in [0, 4294967295]"),
    (["--lr_scheduler_type", "bogus"], "--lr_scheduler_type bogus: must be one of linear, cosine"),
    (["--generation_kwargs", '{"min_tokens": "4"}'], "--generation_kwargs"),
    (["--eval_split", "test"], "--eval_split test names splits of --dataset, and there is none"),
    # ours
    (["--lora_r", "0"], "--lora_r 0: must be >= 1"),
    (["--lora_alpha", "0"], "--lora_alpha 0: must be > 0"),
    (["--lora_dropout", "1"], "--lora_dropout 1.0: must be in [0, 1)"),
    (["--vllm_server_port", "70000"], "--vllm_server_port 70000: must be in [1, 65535]"),
    (["--warmup_ratio", "1.5"], "--warmup_ratio 1.5: must be in [0, 1]"),
    (["--weight_decay", "-0.1"], "--weight_decay -0.1: must be >= 0"),
    (["--epsilon_high", "-1"], "--epsilon_high -1.0: must be >= 0"),
    (["--vllm_gpu_memory_utilization", "0"], "--vllm_gpu_memory_utilization 0.0: must be in (0, 1]"),
    (["--ddp_timeout", "0"], "--ddp_timeout 0.0: must be > 0"),
    (["--reward_timeout", "-1"], "--reward_timeout -1.0: must be > 0"),
    (["--generation_chunk_size", "-1"], "--generation_chunk_size -1: must be >= 0"),
    (["--async_generation_lag", "-1"], "--async_generation_lag -1: must be >= 0"),
    (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps 0: must be >= 1"),
    (["--min_p", "1.5"], "--min_p 1.5: must be in [0, 1]"),
    (["--seed", str(2**40)], "must be in [0, 4294967295]"),
    (["--vllm_importance_sampling_cap", "0.5"], "--vllm_importance_sampling_cap 0.5: must be >= 1"),
    (["--chat_template_kwargs", "[1]"], "--chat_template_kwargs [1]: must be a JSON object"),
    (["--model_init_kwargs", "{bad"], "--model_init_kwargs {bad: must be a JSON object"),
    (["--lr_scheduler_type", "reduce_lr_on_plateau"], "must be one of linear"),  # needs a metric to step
    (["--generation_kwargs", '{"stop_token_ids": [1.5]}'], "stop_token_ids=[1.5]: must be a list of token ids"),
    (["--vllm_tensor_parallel_size", "0"], "--vllm_tensor_parallel_size 0: must be >= 1"),
    (["--max_nonfinite_steps", "0"], "--max_nonfinite_steps 0: must be >= 1"),
    (["--reward_clip_range", "nan", "1"], "--reward_clip_range nan 1.0: must be finite"),
    (["--save_steps", "-1"], "--save_steps -1: must be >= 0"),
    (["--save_strategy", "epoch"], "--save_strategy epoch: must be one of steps, no"),
    (["--model", "/m", "--reward_funcs", "task_reward", "--use_peft", "--load_in_4bit", "--save_strategy", "no"],
     "--load_in_4bit with --save_strategy no"),  # the final model is merged from the last checkpoint
    (["--learning_rate", "inf"], "--learning_rate inf: must be >= 0"),
    (["--vllm_kv_cache_memory_bytes", "0"], "--vllm_kv_cache_memory_bytes 0: must be >= 1"),
    # ours: a flag that would change nothing without the one it acts beside (checks.ONLY_WITH)
    (["--async_generation_lag", "2"], "--async_generation_lag 2 means nothing without --async_generation"),
    (["--save_strategy", "no", "--save_steps", "100"], "--save_steps 100 means nothing without --save_strategy"),
    (["--use_vllm", "--vllm_server_port", "9000"], "means nothing without --use_vllm --vllm_mode server"),
    (["--vllm_mode", "server"], "--vllm_mode server means nothing without --use_vllm"),
    (["--use_vllm", "--vllm_mode", "server", "--vllm_gpu_memory_utilization", "0.5"],
     "--vllm_gpu_memory_utilization 0.5 means nothing without --use_vllm in colocate mode"),
    (["--beta", "0", "--kl_estimator", "k3"], "--kl_estimator k3 means nothing without a KL term (--beta > 0)"),
    (["--num_completions_to_print", "3"], "--num_completions_to_print 3 means nothing without --log_completions"),
    (["--use_dora"], "--use_dora means nothing without --use_peft"),
    (["--max_dynamic_sampling_rounds", "8"], "means nothing without --dynamic_sampling"),
    (["--ref_model_sync_steps", "64"], "means nothing without --sync_ref_model"),
    (["--max_tool_calls", "3"], "--max_tool_calls 3 means nothing without --environment or --tools"),
    (["--eval_steps", "5"], "--eval_steps 5 means nothing without --eval_split or --eval_dataset"),
    (["--dataset_split", "test"], "--dataset_split test means nothing without --dataset"),
    (["--run_name", "exp1"], "--run_name exp1 means nothing without --report_to wandb"),
    # ours: an estimator's own settings are its function's keyword parameters (rloo.py)
    (["--advantage_estimator_kwargs", '{"clip": 3}'],
     "--advantage_estimator_kwargs names 'clip', which rloo.rloo_advantages takes no setting"),
    (["--advantage_estimator_kwargs", "[3]"], "--advantage_estimator_kwargs [3]: must be a JSON object"),
]


@pytest.mark.parametrize("args, message", FLAG_CASES, ids=[" ".join(a) for a, _ in FLAG_CASES])
def test_a_bad_flag_is_one_line_naming_it_before_anything_loads(args, message):
    error = startup_error(args)
    assert error is not None and message in error, error
    assert error.startswith("error: ") and "\n" not in error


# what makes each owner in checks.ONLY_WITH present; a plain Config has none but a KL term and periodic checkpoints
OWNERS = {"--model": dict(model="m"), "--use_peft": dict(use_peft=True),
          "--model and --use_peft": dict(model="m", use_peft=True), "--dataset": dict(dataset="d.jsonl"),
          "--eval_split or --eval_dataset": dict(eval_dataset=["e=e.jsonl"]),
          "--environment or --tools": dict(tools="t.py:f"), "a KL term (--beta > 0)": dict(beta=0.1),
          "--sync_ref_model": dict(sync_ref_model=True), "--use_vllm": dict(use_vllm=True),
          "--use_vllm in colocate mode": dict(use_vllm=True),
          "--use_vllm --vllm_mode server": dict(use_vllm=True, vllm_mode="server"),
          "--vllm_importance_sampling_correction": dict(vllm_importance_sampling_correction=True),
          "--async_generation": dict(async_generation=True), "--dynamic_sampling": dict(dynamic_sampling=True),
          "--log_completions": dict(log_completions=True), "--report_to wandb": dict(report_to=["wandb"]),
          "--save_strategy steps": dict(save_strategy="steps"),
          "--resume_from_checkpoint": dict(resume_from_checkpoint="latest")}
ABSENT = {"a KL term (--beta > 0)": dict(beta=0.0), "--save_strategy steps": dict(save_strategy="no")}
NAMED = {"vllm_mode": "server", "kl_estimator": "k3", "vllm_weight_sync": "file",
         "vllm_importance_sampling_mode": "sequence_truncate"}
ONLY_WITH = [(needed, name) for needed, _, names in checks.ONLY_WITH for name in names]


def another_value(name):
    default = getattr(config.Config(), name)
    if name in NAMED or isinstance(default, bool):
        return NAMED.get(name, not default)
    return {int: lambda: default + 1, float: lambda: default + 0.5, str: lambda: default + "2",
            type(None): lambda: "x"}[type(default)]()


@pytest.mark.parametrize("needed, name", ONLY_WITH, ids=[name for _, name in ONLY_WITH])
def test_a_flag_that_would_change_nothing_without_its_owner_is_one_line(needed, name):
    """Each flag of checks.ONLY_WITH (its --help says "With log_completions: ...", "Server mode: ..."): another value
    than its default without the flag it acts beside is one line naming both; with that flag, or at its default,
    it passes."""
    absent = dataclasses.replace(config.Config(), **ABSENT.get(needed, {}), **{name: another_value(name)})
    with pytest.raises(SystemExit) as stopped:
        checks.check_only_with(absent)
    assert str(stopped.value).startswith(f"error: --{name}") and f"means nothing without {needed}: drop it" in \
        str(stopped.value) and "\n" not in str(stopped.value)
    checks.check_only_with(dataclasses.replace(absent, **OWNERS[needed]))
    checks.check_only_with(dataclasses.replace(absent, **{name: getattr(config.Config(), name)}))


def test_help_states_each_default_as_it_applies_and_each_domain():
    out = run(["--help"])
    assert out.returncode == 0 and "Failed to load CPU gemm_4bit_forward" not in out.stdout + out.stderr
    assert "['task_reward']" not in out.stdout.split("Without --model")[0]  # the preset's, not the default
    assert "[in (0, 1]]" in out.stdout and "[>= 2]" in out.stdout


def test_output_dir_that_is_a_file_or_read_only_fails_at_startup(tmp_path):
    (tmp_path / "a_file").write_text("x")
    assert "--output_dir" in startup_error(["--output_dir", str(tmp_path / "a_file")]) and "is a file" in \
        startup_error(["--output_dir", str(tmp_path / "a_file")])
    skipped = "cannot mount a read-only tmpfs here (needs root); the file case ran"
    with read_only_mount(tmp_path / "ro", skipped) as mount:
        assert "is not writable" in startup_error(["--output_dir", str(mount / "run")])


@pytest.mark.parametrize("installed,error", [("0.31.1", True), ("0.32.0", False), ("0.34.0", False)])
def test_a_vllm_older_than_the_declared_floor_stops_at_startup(monkeypatch, installed, error):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: found(name if name != "vllm" else "json"))
    monkeypatch.setattr(checks.stack, "version", lambda name: installed if name == "vllm" else None)
    line = startup_error(["--use_vllm"])
    assert (line == f"error: --use_vllm needs vLLM >= {checks.VLLM_OLDEST} (its weight-transfer engines); "
            f"{installed} is installed: pip install -U vllm") == error


# ------------------------------------------------------------------------------------------------ dataset rows

def data_error(tmp_path, lines=None, text=None, name="data.jsonl", extra=(), tokenizer_template=None):
    """The one line the data checks stop with for a dataset file (lines: JSON rows), or None."""
    path = tmp_path / name
    if text is not None:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    elif lines is not None:
        path.write_text("".join(json.dumps(row) + "\n" for row in lines))
    model, tokenizer, _ = data.embedded_task(0)
    tokenizer.chat_template = tokenizer_template
    try:
        cfg = train.parse_config(["--dataset", str(path), "--per_device_train_batch_size", "2", "--num_generations",
                                  "2", *extra])
        train.check_config(cfg)
        dataset, eval_sets, _ = data.load_datasets(cfg)
        data.check_data(dataset, tokenizer, None, model, cfg)
        for name, eval_set in eval_sets.items():
            data.check_data(eval_set, tokenizer, None, model, cfg, data.eval_where(cfg, name))
        if not hasattr(dataset, "__len__"):
            next(data.prompt_batches(dataset, cfg, 0))
    except SystemExit as e:
        return str(e)
    return None


GOOD = {"prompt": "12=", "target": "12"}
TEMPLATE = ("{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
            "{{ raise_exception('unknown role ' + m.role) }}{% endif %}{{ m.content }}{% endfor %}")
DATA_CASES = {  # name: (rows or raw text, what the line must say, extra flags)
    "empty file": (b"", "is empty", ()),
    "no prompt column": ([{"question": "1=", "target": "1"}] * 4, "has no 'prompt' column", ()),
    "int prompt": ([GOOD, {"prompt": 1234, "target": "1"}], "row 1: the prompt is '1234' of type int", ()),
    "dict prompt": ([GOOD, GOOD, {"prompt": {"a": 1}, "target": "1"}], "row 2: the prompt is", ()),
    "null prompt": ([{"prompt": None, "target": "1"}, GOOD], "row 0: the prompt is 'None' of type NoneType", ()),
    "empty string": ([GOOD, {"prompt": "  ", "target": "1"}], "row 1: the prompt is an empty string", ()),
    "pre-split words": ([{"prompt": ["1", "2", "="], "target": "12"}, GOOD], "pre-split words are not", ()),
    "non-UTF-8": (b'{"prompt": "12=", "target": "12"}\n{"prompt": "\xff1=", "target": "1"}\n',
                  "is not UTF-8: byte 46 (line 2)", ()),
    "CSV digits": (b"prompt,target\n1234,1234\n5678,5678\n", "of type int (a CSV column of digits", ()),
    "message without content": ([{"prompt": [{"role": "user"}], "target": "1"}] * 2, "has no 'content'", ()),
    "unknown role": ([{"prompt": [{"role": "robot", "content": "1="}], "target": "1"}] * 2,
                     "row 0: the chat template cannot render this prompt", ("TEMPLATE",)),
    "template checked on every row": ([GOOD] * 3 + [{"prompt": [{"role": "user", "content": "1="}], "target": "1"}],
                                      "row 3: the prompt is a conversation but", ()),
    "streaming, empty": (b"\n", "is empty", ("--streaming", "--max_steps", "2")),
    "streaming, bad row at first use": ([GOOD, {"prompt": 5, "target": "5"}] * 2, "stream row 1: the prompt is '5'",
                                        ("--streaming", "--max_steps", "2", "--shuffle_dataset", "false",
                                         "--per_device_train_batch_size", "4")),
    # ours
    "truncated JSON line": (b'{"prompt": "12=", "target": "12"}\n{"prompt": "1=", "tar', "cannot load dataset", ()),
    "empty conversation": ([{"prompt": [], "target": "1"}, GOOD], "an empty list of messages", ()),
    "message that is a string": ([{"prompt": [{"role": "user", "content": "1"}, "hello"], "target": "1"}] * 2,
                                 "item 1 is 'hello' of type str", ()),
    "role missing": ([{"prompt": [{"content": "1="}], "target": "1"}] * 2, "has no string 'role'", ()),
    "too long for the context": ([GOOD, {"prompt": "1" * 70, "target": "1"}], "row 1: the longest prompt has 70", ()),
    "eval prompt too long": ({"train": [GOOD] * 2, "test": [GOOD, GOOD, {"prompt": "1" * 70, "target": "1"}]},
                             "eval split 'test' row 2: the longest prompt has 70", ("--eval_split", "test")),
}


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_a_bad_dataset_row_is_one_line_naming_the_row(tmp_path, case):
    rows, message, extra = DATA_CASES[case]
    template = TEMPLATE if "TEMPLATE" in extra else None
    extra = tuple(e for e in extra if e != "TEMPLATE")
    raw = rows if isinstance(rows, bytes) else None
    name = "data.csv" if case == "CSV digits" else "data.jsonl"
    if isinstance(rows, dict):  # named splits: a save_to_disk DatasetDict
        from datasets import Dataset, DatasetDict
        DatasetDict({k: Dataset.from_list(v) for k, v in rows.items()}).save_to_disk(tmp_path / "splits")
        rows, name = None, "splits"
    error = data_error(tmp_path, rows, raw, name, extra, template)
    assert error is not None and message in error, error
    assert "\n" not in error


def test_the_startup_checks_read_the_prompt_column_whole_not_row_by_row(tmp_path, monkeypatch):
    """datasets >= 4 returns a Column for dataset["prompt"], whose iteration formats one row at a time (seconds a
    pass on 100k rows; start-up made five passes): every check reads the column as one list."""
    from datasets import arrow_dataset
    if not hasattr(arrow_dataset, "Column"):
        pytest.skip("datasets < 4: dataset['prompt'] is already a list")
    monkeypatch.setattr(arrow_dataset.Column, "__iter__", lambda self: pytest.fail("a Column iterated by row"))
    rows = [GOOD, {"prompt": [{"role": "user", "content": "1="}], "target": "1"}] * 8
    assert data_error(tmp_path, rows, tokenizer_template=TEMPLATE, extra=("--eval_split", "train")) is None
    dataset, _, _ = data.load_datasets(train.parse_config(["--dataset", str(tmp_path / "data.jsonl")]))
    assert data.identity(dataset)["rows"] == 16


def test_a_model_directory_passed_as_the_dataset(tmp_path):
    model, tokenizer, _ = data.embedded_task(0)
    model.save_pretrained(tmp_path / "model")
    error = startup_error(["--dataset", str(tmp_path / "model")]) or ""
    try:
        data.load_datasets(train.parse_config(["--dataset", str(tmp_path / "model")]))
    except SystemExit as e:
        error = str(e)
    assert "is a model directory" in error


def test_a_streaming_dataset_with_an_eval_split_evaluates(tmp_path):
    """It trained until the first evaluation, then len() of the stream raised: the eval split loads whole."""
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{i}{i}=", "target": f"{i}{i}"}) + "\n"
                                                 for i in range(10)))
    out = in_process(["--dataset", str(tmp_path / "data.jsonl"), "--streaming", "--eval_split", "train", "--eval_steps", "2",
               "--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4", "--logging_steps",
               "1", "--output_dir", str(tmp_path / "run")])
    assert out.returncode == 0, out.stderr[-2000:]
    assert any("eval_reward" in m for m in read_metrics(tmp_path / "run"))


# ------------------------------------------------------------------------------------------------ reward functions

REWARD_FILE = '''
import asyncio, sys, time
def exits(completions, **kw): sys.exit(0)
def interrupts(completions, **kw): raise KeyboardInterrupt
def helper(): raise KeyError("no such column")
def raises(completions, **kw): return helper()
def nan(completions, **kw): return [float("nan")] * len(completions)
def inf(completions, **kw): return [float("inf")] * len(completions)
def overflows(completions, **kw): return [1e39] * len(completions)
def strings(completions, **kw): return ["1"] * len(completions)
def short(completions, **kw): return [1.0]
def nothing(completions, **kw): return None
def mapping(completions, **kw): return {"a": 1.0}
def sleeps(completions, **kw): time.sleep(60)
async def async_sleeps(completions, **kw): await asyncio.sleep(60)
async def async_raises(completions, **kw): raise ValueError("judge down")
def flags(completions, **kw): return [True] * len(completions)
not_a_function = 3
'''
REWARD_CASES = {  # function: what the line must say (None: accepted)
    "exits": "reward function 'exits' raised at step 0: it called sys.exit(0)",
    "interrupts": "reward function 'interrupts' raised at step 0: KeyboardInterrupt",
    "raises": "reward function 'raises' raised at step 0: KeyError: 'no such column' (",
    "nan": "reward function 'nan' returned a value that is not finite in float32 (nan)",
    "inf": "returned a value that is not finite in float32 (inf)",
    "overflows": "returned a value that is not finite in float32 (1e+39)",  # finite in Python, inf in float32
    "strings": "reward function 'strings' returned a str ('1') for completion 0",
    "short": "must return a list of 4 floats (one per completion), got length 1",
    "nothing": "must return a list of 4 floats (one per completion), got NoneType",
    "mapping": "must return a list of 4 floats",
    "sleeps": "reward function 'sleeps' at step 0 did not return within --reward_timeout 0.5 s",
    "async_sleeps": "reward function 'async_sleeps' at step 0 did not return within --reward_timeout 0.5 s",
    "async_raises": "reward function 'async_raises' raised at step 0: ValueError: judge down",
    "flags": None,  # True is 1.0, as in TRL
}


@pytest.mark.parametrize("name", list(REWARD_CASES))
def test_a_failing_or_invalid_reward_is_one_line_naming_the_function_and_step(tmp_path, name, capsys):
    (tmp_path / "bad_rewards.py").write_text(REWARD_FILE)
    func = rewards.load_reward_func(f"{tmp_path / 'bad_rewards.py'}:{name}")
    ids = torch.tensor([[1], [2], [3], [4]])
    batch = batches.Rollout({"prompt": ["x", "y"]}, ids, ids, ids, ids, torch.zeros(4).bool(),
                            ids.tolist(), ["a", "b", "c", "d"])
    try:
        out = rewards.RewardFunctions([func], timeout=0.5)(batch, 2, 0)
        error = None
    except SystemExit as e:
        error = str(e)
    if REWARD_CASES[name] is None:
        assert error is None and out[:, 0].tolist() == [1.0] * 4
        return
    assert error is not None and REWARD_CASES[name] in error and "\n" not in error, error
    if name == "raises":  # the reward's own traceback, not rloo's
        printed = capsys.readouterr().err
        assert "bad_rewards.py" in printed and "helper" in printed and rewards.__file__ not in printed


LOAD_CASES = {
    "syntax.py": ("def f(:\n    pass\n", "f", "cannot load reward function file", "SyntaxError"),
    "imports.py": ("import no_such_package_xyz\n", "f", "ModuleNotFoundError: No module named 'no_such_package_xyz'",
                   "imports.py, line 1"),
    "raises_at_import.py": ("raise RuntimeError('config missing')\n", "f", "RuntimeError: config missing", ""),
    "exits_at_import.py": ("import sys\nsys.exit(3)\n", "f", "it called sys.exit(3)", ""),
    "not_callable.py": ("x = 3\n", "x", "not_callable.py:x is a int, not a function", ""),
    "missing.py": ("def g(**kw): return []\n", "f", "has no function 'f'", ""),
}


@pytest.mark.parametrize("file", list(LOAD_CASES))
def test_a_reward_file_that_does_not_load_is_one_line_naming_it(tmp_path, file):
    source, name, message, where = LOAD_CASES[file]
    (tmp_path / file).write_text(source)
    error = startup_error(["--reward_funcs", f"{tmp_path / file}:{name}"]) or ""
    if not error:  # loading happens after the config checks: load_rewards turns it into one line
        try:
            cfg = train.parse_config(["--reward_funcs", f"{tmp_path / file}:{name}"])
            rewards.load_rewards(cfg, torch.device("cpu"))
        except SystemExit as e:
            error = str(e)
    assert message in error and where in error and "\n" not in error, error


def test_a_causal_lm_is_not_taken_for_a_reward_model(tmp_path):
    model, tokenizer, _ = data.embedded_task(0)
    model.save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")
    with pytest.raises(ValueError, match="Qwen2ForCausalLM with no sequence-classification head"):
        rewards.load_reward_func(str(tmp_path / "lm"))


# ------------------------------------------------------------------------------------------------ end to end

def reward_file(tmp_path, body):
    path = tmp_path / "user_rewards.py"
    path.write_text(body)
    return str(path)


def no_traceback(out):
    assert "Traceback (most recent call last)" not in out.stderr.replace("Traceback of the reward function", ""), \
        out.stderr[-3000:]


def test_a_reward_that_exits_does_not_end_the_run_silently(tmp_path):
    rewards_py = reward_file(tmp_path, "import sys\ndef bye(completions, **kw):\n    sys.exit(0)\n")
    out = in_process(FAST + ["--reward_funcs", f"{rewards_py}:bye", "--output_dir", str(tmp_path / "run")])
    assert out.returncode != 0 and "reward function 'bye' raised at step 0: it called sys.exit(0)" in out.stderr
    assert not (tmp_path / "run" / "model.safetensors").exists()


@pytest.mark.slow
def test_sigterm_stops_a_reward_that_never_returns(tmp_path):
    rewards_py = reward_file(tmp_path, "import asyncio\nasync def stuck(completions, **kw):\n"
                                       "    await asyncio.sleep(10**6)\n")
    proc = start_drained([sys.executable, "train.py", *FAST, "--reward_funcs", f"{rewards_py}:stuck",
                          "--output_dir", str(tmp_path / "run")], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    while not (tmp_path / "run" / "metrics.jsonl").exists():  # the logger opens it just before the loop
        assert proc.poll() is None, drained(proc)[1][-2000:]
        time.sleep(0.1)
    time.sleep(2)
    start = time.time()
    proc.send_signal(signal.SIGTERM)  # the reward gets 10 s to finish its step, then is stopped
    _, stderr = drained(proc, 120)
    assert proc.returncode != 0 and "SIGTERM while reward function 'stuck' was running at step 0" in stderr
    assert 9 < time.time() - start < 60


def test_rewards_that_score_nothing_warn_then_stop(tmp_path):
    rewards_py = reward_file(tmp_path, "def never(completions, **kw):\n    return [None] * len(completions)\n")
    out = in_process(FAST[:1] + ["5"] + FAST[2:] + ["--reward_funcs", f"{rewards_py}:never", "--output_dir",
                                             str(tmp_path / "run")])
    assert out.returncode != 0 and out.stderr.count("every reward function returned None") == 1
    assert "3 batches in a row were scored by no reward function" in out.stderr
    no_traceback(out)


def test_a_run_that_trained_nothing_exits_non_zero_and_saves_no_model(tmp_path):
    """Rewards of +-3e38 make every gradient inf: each step is skipped; 2 steps < max_nonfinite_steps (3)."""
    rewards_py = reward_file(tmp_path, "def huge(completions, **kw):\n"
                                       "    return [3e38 if i % 2 else -3e38 for i in range(len(completions))]\n")
    out = in_process(FAST[:1] + ["2"] + FAST[2:] + ["--reward_funcs", f"{rewards_py}:huge", "--output_dir",
                                             str(tmp_path / "run")])
    assert out.returncode != 0 and "none of the 2 optimizer steps updated the weights" in out.stderr
    assert not (tmp_path / "run" / "model.safetensors").exists()
    no_traceback(out)


def train_until(args, out_dir, steps_logged):
    proc = start_drained([sys.executable, "train.py", *args, "--output_dir", str(out_dir)], cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    while not (out_dir / "metrics.jsonl").exists() or len(read_metrics(out_dir)) < steps_logged:
        assert proc.poll() is None, drained(proc)[1][-3000:]
        time.sleep(0.05)
    return proc


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_like_sigterm_and_a_second_one_exits_at_once(tmp_path):
    """The reward takes 0.5 s, so the signals arrive mid-step: the first one lets the reward finish and the step
    checkpoint; a second exits without waiting."""
    rewards_py = reward_file(tmp_path, "import time\nfrom rewards import task_reward\n"
                                       "def slow(**kw):\n    time.sleep(0.5)\n    return task_reward(**kw)\n")
    args = ["--max_steps", "100000", "--logging_steps", "1", "--save_steps", "0", "--per_device_train_batch_size",
            "16", "--reward_funcs", f"{rewards_py}:slow"]
    proc = train_until(args, tmp_path / "once", 3)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = drained(proc, 120)
    assert proc.returncode == 0, stderr[-2000:]
    assert "stopped by a signal: saved checkpoint-" in stdout and "--resume_from_checkpoint latest" in stdout
    assert any(p.startswith("checkpoint-") for p in os.listdir(tmp_path / "once"))
    proc = train_until(args, tmp_path / "twice", 3)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, stderr = drained(proc, 60)
    assert proc.returncode == 130 and "second Ctrl-C: exiting now" in stderr


def test_a_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_last_one(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root) to fill")
    try:
        out = in_process(FAST[:1] + ["6"] + FAST[2:] + ["--save_steps", "2", "--output_dir", str(disk / "run")])
        assert out.returncode != 0 and "No space left on device" in out.stderr, out.stderr[-2000:]
        assert "the last complete checkpoint, " in out.stderr and "checkpoint-2, is intact" in out.stderr
        assert sorted(os.listdir(disk / "run")) == ["checkpoint-2", "metrics.jsonl"]  # no .tmp left behind
        no_traceback(out)
    finally:
        subprocess.run(["umount", str(disk)])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A finished run with checkpoints 2, 4 and 6, copied afresh for each damage."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    done = in_process(FAST[:1] + ["6"] + FAST[2:] + ["--save_steps", "2", "--output_dir", str(out)])
    assert done.returncode == 0, done.stderr[-2000:]
    return out


DAMAGE = {
    "truncated shard": lambda d: os.truncate(next(d.glob("*.distcp")), 100),
    "deleted .metadata": lambda d: (d / ".metadata").unlink(),
    "truncated trainer_state.json": lambda d: (d / "trainer_state.json").write_text('{"step": 6, "num_to'),
    "deleted manifest": lambda d: (d / "manifest.json").unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_one_line_and_latest_passes_over_it(tmp_path, checkpoints, damage):
    run_dir = tmp_path / "run"
    shutil.copytree(checkpoints, run_dir)
    DAMAGE[damage](run_dir / "checkpoint-6")
    explicit = in_process(FAST[:1] + ["8"] + FAST[2:] + ["--output_dir", str(run_dir), "--resume_from_checkpoint",
                                                  str(run_dir / "checkpoint-6")])
    assert explicit.returncode != 0 and f"checkpoint '{run_dir / 'checkpoint-6'}' is damaged" in explicit.stderr
    assert f"--resume_from_checkpoint {run_dir / 'checkpoint-4'}" in explicit.stderr
    no_traceback(explicit)
    latest = in_process(FAST[:1] + ["8"] + FAST[2:] + ["--output_dir", str(run_dir), "--resume_from_checkpoint", "latest"])
    assert latest.returncode == 0, latest.stderr[-2000:]
    assert "checkpoint-6 is damaged" in latest.stderr and "resumed from" in latest.stdout
    assert "checkpoint-4 at step 4" in latest.stdout


def test_resuming_with_other_flags_says_which_take_effect(tmp_path, checkpoints):
    run_dir = tmp_path / "run"
    shutil.copytree(checkpoints, run_dir)
    out = in_process(FAST[:1] + ["8"] + FAST[2:] + ["--output_dir", str(run_dir), "--resume_from_checkpoint", "latest",
                                             "--learning_rate", "0.5", "--beta", "0.3"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "learning_rate 0.001 -> 0.5 (the checkpoint value stays)" in out.stderr
    assert "beta 0.02 -> 0.3 (the new value applies)" in out.stderr
    assert all(m["learning_rate"] == pytest.approx(1e-3) for m in read_metrics(run_dir) if m["step"] > 6)


# ------------------------------------------------------------------------------------------------ a resume, a model or a
# budget that does not match what the user meant (issue 63, class 3): checked at start-up, or said in the closing line

@pytest.mark.parametrize("steps, says", [
    ("6", "the checkpoint is at step 6 and this run ends at step 6 (--max_steps 6): nothing is left to train"),
    ("4", "the checkpoint is at step 6 and this run ends at step 4 (--max_steps 4)"),  # the two
])
def test_a_resume_with_no_steps_left_is_one_line(tmp_path, checkpoints, steps, says):
    run_dir = tmp_path / "run"
    shutil.copytree(checkpoints, run_dir)
    out = in_process(FAST[:1] + [steps] + FAST[2:] + ["--output_dir", str(run_dir), "--resume_from_checkpoint",
                                                    "latest"])
    assert out.returncode == 1 and says in out.stderr and "python train.py export" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("edit", ["chat template", "tokenizer vocabulary"])  # the issue's, and ours
def test_a_resume_whose_model_directory_renders_the_prompts_otherwise_is_one_line(tmp_path, chat_model_dir, edit):
    model = tmp_path / "model"
    shutil.copytree(chat_model_dir, model)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+{i}"}]}) + "\n"
                                              for i in range(64)))
    args = ["--model", str(model), "--dataset", str(tmp_path / "d.jsonl"), "--reward_funcs", "think_format_reward",
            "--output_dir", str(tmp_path / "run"), "--save_steps", "2", "--per_device_train_batch_size", "8",
            "--num_generations", "2", "--max_completion_length", "4"]
    assert in_process(args + ["--max_steps", "2"]).returncode == 0
    if edit == "chat template":
        template = model / "chat_template.jinja"
        template.write_text(template.read_text().replace("<|im_start|>assistant", "<|im_start|>assistantX"))
    else:  # the digits' ids swapped
        vocab = json.loads((model / "tokenizer.json").read_text())
        table = vocab["model"]["vocab"]
        table["1"], table["2"] = table["2"], table["1"]
        (model / "tokenizer.json").write_text(json.dumps(vocab))
    out = in_process(args + ["--max_steps", "4", "--resume_from_checkpoint", "latest"])
    assert out.returncode == 1 and "tokenized otherwise: the model directory's tokenizer or chat template differ" \
        in out.stderr, out.stderr[-2000:]
    out = in_process(args + ["--max_steps", "4", "--resume_from_checkpoint", "latest", "--accept_data_change"])
    assert out.returncode == 0 and "WARNING: the data changed since the checkpoint (the same rows, tokenized" in \
        out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("prompt, fails", [
    ("What is {i} plus {i}?", True),  # the issue's: English on the embedded digit model
    ("{i:04d} =", False),  # ours: one character of five unknown, a warning
    ("Quanto fa {i} più {i}?", True),  # ours: another language, the same
])
def test_prompts_the_tokenizer_cannot_read_are_said_at_start_up(tmp_path, prompt, fails):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": prompt.format(i=i), "target": f"{i:04d}"}) + "\n"
                                              for i in range(200)))
    out = in_process(["--dataset", str(tmp_path / "d.jsonl"), "--max_steps", "1", "--output_dir", str(tmp_path / "r")])
    said = "as its unknown token '<eos>'"
    assert said in out.stderr and "without --model the embedded model knows only the digits" in out.stderr
    assert (out.returncode == 1) == fails and ("would learn from prompts it cannot read" in out.stderr) == fails


def test_a_model_with_non_finite_weights_is_one_line_at_start_up(tmp_path):
    from step import data
    model, tokenizer, dataset = data.embedded_task(0)
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight[0, 0] = float("inf")
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    dataset.select(range(64)).to_json(tmp_path / "d.jsonl")
    out = in_process(["--model", str(tmp_path / "m"), "--dataset", str(tmp_path / "d.jsonl"), "--reward_funcs",
                      "task_reward", "--output_dir", str(tmp_path / "r")])
    assert out.returncode == 1 and "weights hold NaN or inf values (e.g. in model.layers.1.self_attn.q_proj" in \
        out.stderr, out.stderr[-2000:]


def test_a_run_stopped_by_its_time_budget_says_so_in_its_last_line(tmp_path):
    out = in_process(["--max_train_minutes", "0.02", "--output_dir", str(tmp_path / "r")])
    last = out.stdout.strip().splitlines()[-1]
    assert out.returncode == 0 and re.search(r"--max_train_minutes 0.02 spent at step \d+ of 500; metrics in", last), \
        last


def test_an_environment_of_the_users_on_the_embedded_model_says_what_holds(tmp_path):
    """The embedded preset's task_reward is not added to an environment that scores itself; its turn length and
    tokenizer are said at start-up, text the tokenizer cannot read once, and the samples show the prompt reset()
    gave the model, not the dataset row."""
    (tmp_path / "env.py").write_text(
        "class Echo:\n    def __init__(self, row):\n        self.row = row\n    def reset(self):\n"
        "        return 'Copy ' + self.row['target'] + '='\n    def step(self, text):\n        return 'ok', True\n"
        "    def get_reward(self):\n        return 0.5\n\n\ndef make_env(row):\n    return Echo(row)\n")
    out = in_process(["--environment", f"{tmp_path / 'env.py'}:make_env", "--max_steps", "2", "--logging_steps", "1",
                      "--output_dir", str(tmp_path / "r")])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--environment on the embedded model (no --model): its 5-token turns" in out.stderr
    assert out.stderr.count("the tokenizer reads 5 characters of the environment's text ('Copy ')") == 1
    logged = read_metrics(tmp_path / "r")[-1]
    assert "rewards/task_reward/mean" not in logged and logged["reward"] == pytest.approx(0.5)
    assert re.search(r"'Copy \d{4}=' -> ", out.stderr + out.stdout)


def test_save_total_limit_never_deletes_the_checkpoint_just_written(tmp_path, checkpoints):
    """Resumed from checkpoint-2 of a run that got to 6: the new checkpoint-4 is the one kept, not the older run's 6."""
    run_dir = tmp_path / "run"
    shutil.copytree(checkpoints, run_dir)
    out = in_process(FAST[:1] + ["4"] + FAST[2:] + ["--output_dir", str(run_dir), "--save_steps", "2", "--save_total_limit",
                                             "1", "--resume_from_checkpoint", str(run_dir / "checkpoint-2")])
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(p for p in os.listdir(run_dir) if p.startswith("checkpoint")) == ["checkpoint-4"]


# ------------------------------------------------------------------------------------------------ messages

def test_an_error_line_is_not_printed_onto_the_progress_bar(capsys):
    """The bar is drawn without a newline: an error printed after it once shared its line
    (`rloo:  50%|#####     | 1/2 [...]error: ...`)."""
    from tqdm import tqdm

    from plumbing.config import fail

    bar = tqdm(total=2, desc="rloo", file=sys.stderr)
    bar.update(1)
    with pytest.raises(SystemExit) as stop:
        fail("the reward function raised")
    sys.stderr.write(f"{stop.value}\n")  # as the interpreter prints it at exit
    shown = capsys.readouterr().err.replace("\r", "\n").rstrip("\n").split("\n")[-1]  # the terminal's last line
    bar.close()
    assert shown == "error: the reward function raised"
