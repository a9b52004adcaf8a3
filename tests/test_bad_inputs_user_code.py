"""Bad input of two classes (issue 29), one row per case, all in this process (no training run): names that
collide (dataset columns against the arguments the trainer passes reward functions, reward and metric names, eval-set
prefixes, tool names, module names) and what user code does to us (reward functions that change their arguments,
hang or return the wrong kind; environments and tools that return the wrong kind). Each case ends in one line that
names the problem and the fix, or in a resolution the user can see. Marked "issue" where issue 29 lists the case."""

import asyncio
import json
import sys
import threading
import time

import pytest
import torch

import rewards
import train
from options import environments, tools
from plumbing import config
from step import batches, data, metrics, reward_calls

N = 4  # completions in every reward batch here: two prompts, G = 2
ROW = {"prompt": "12=", "target": "12"}


def one_line(error):
    assert error is not None, "no error"
    assert error.startswith("error: ") and "\n" not in error, error
    return error


def rollout(rows=None, texts=None, turns=None):
    ids = torch.tensor([[1], [2], [3], [4]])
    return batches.Rollout(rows or {"prompt": ["x", "y"]}, ids, ids, ids, ids, torch.zeros(N).bool(),
                           [[5, 6], [7], [8, 9], [0]], texts or ["a", "b", "c", "d"], turns=turns)


def reward_error(funcs, batch=None, timeout=None):
    """The one line RewardFunctions stops with on a batch of N completions, or None."""
    try:
        rewards.RewardFunctions(funcs, timeout=timeout)(batch or rollout(), 2, 0)
    except SystemExit as e:
        return str(e)
    return None


def startup_error(tmp_path, rows, args=(), eval_rows=(ROW,)):
    """The one line the data checks stop with for a JSONL dataset of these rows (plus flags; DATA and EVAL in them:
    the dataset's file and an eval file of eval_rows), or None."""
    for name, lines in [("data", rows), ("eval", eval_rows)]:
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in lines))
    paths = {"DATA": str(tmp_path / "data.jsonl"), "EVAL": str(tmp_path / "eval.jsonl")}
    args = [a.replace("DATA", paths["DATA"]).replace("EVAL", paths["EVAL"]) for a in args]
    cfg = config.parse_config(["--dataset", paths["DATA"], *args])
    try:
        data.load_datasets(cfg)
    except SystemExit as e:
        return str(e)
    return None


# =============================================================================================== names that collide

COLUMN_CASES = {  # name: (rows, flags, what the line must say)
    "completions (issue)": ([{**ROW, "completions": "x"}], (), "--dataset"),
    "trainer_state (issue)": ([{**ROW, "trainer_state": 1}], (), "has a column 'trainer_state', which is also"),
    "prompts": ([{**ROW, "prompts": "x"}], (), "has a column 'prompts', which is also the name of an argument"),
    "completion_ids": ([{**ROW, "completion_ids": [1]}], (), "has a column 'completion_ids'"),
    "step": ([{**ROW, "step": 3}], (), "has a column 'step'"),
    "log_extra": ([{**ROW, "log_extra": 1}], (), "has a column 'log_extra'"),
    "log_metric": ([{**ROW, "log_metric": 1}], (), "has a column 'log_metric'"),
    "environments, reserved (issue)": ([{**ROW, "environments": "x"}], (), "has a column 'environments'"),
    "environment, reserved (issue)": ([{**ROW, "environment": "x"}], (), "has a column 'environment', a name rloo "
                                                                          "reserves"),
    "streamed": ([{**ROW, "completions": "x"}], ("--streaming", "--max_steps", "1"), "has a column 'completions'"),
    "in an eval set": ([ROW], ("--eval_dataset", "held=EVAL"), "eval set 'held' has a column 'step'"),
    "eval sets x and x_aux": ([ROW], ("--eval_dataset", "x=DATA", "x_aux=DATA"),
                              "eval sets 'x' and 'x_aux' would both log eval_x_aux_loss (set x's aux_loss and set "
                              "x_aux's loss); rename one of them"),
}


@pytest.mark.parametrize("case", list(COLUMN_CASES))
def test_a_column_or_eval_set_whose_name_collides_is_one_line_at_startup(tmp_path, case):
    rows, args, message = COLUMN_CASES[case]
    error = one_line(startup_error(tmp_path, rows, args, [{**ROW, "step": 3}]))
    assert message in error and "rename" in error, error


def test_column_names_that_do_not_collide_load(tmp_path):
    """The same words as parts of names, and eval sets whose names only share a start, are fine."""
    rows = [{**ROW, "completion": "x", "steps": 1, "environment_name": "a"}]
    assert startup_error(tmp_path, rows, ("--eval_dataset", "gsm=DATA", "gsm_hard=DATA")) is None


def test_the_reserved_names_are_every_argument_the_trainer_passes():
    """data.REWARD_ARGUMENTS is the list the start-up check holds against: it names every keyword a reward
    function gets beside the columns (and `environments`, reserved for the environment work)."""
    seen = {}

    def spy(**kwargs):
        seen.update(kwargs)
        return [0.0] * N

    rewards.RewardFunctions([spy])(rollout({"prompt": ["x", "y"], "target": ["1", "2"]}), 2, 0)
    assert set(seen) - {"target"} <= set(data.REWARD_ARGUMENTS)
    assert set(data.REWARD_ARGUMENTS) - set(seen) == {"environments"}


def test_a_streamed_row_that_brings_a_colliding_column_later_is_one_line():
    def anything(completions, **kwargs):
        return [0.0] * N

    error = one_line(reward_error([anything], rollout({"prompt": ["x", "y"], "step": [1, 2]})))
    assert "the batch has a column 'step', which is also the name of an argument" in error


SCORE = "def score(completions, **kwargs):\n    return [{value}] * len(completions)\n"


def test_two_reward_functions_of_one_name_log_apart_and_say_so(tmp_path, capsys):
    """Issue: two files each with `score`; the second's metrics were written over the first's. Now it is
    score_1, in the metric keys and the table, with a warning naming both."""
    for name, value in [("a", 1.0), ("b", 3.0)]:
        (tmp_path / f"{name}.py").write_text(SCORE.format(value=value))
    specs = [f"{tmp_path / 'a.py'}:score", f"{tmp_path / 'b.py'}:score", "task_reward", "task_reward"]
    cfg = config.parse_config(["--reward_funcs", *specs])
    funcs = rewards.load_rewards(cfg, "cpu")
    assert funcs.names == ["score", "score_1", "task_reward", "task_reward_1"]
    err = capsys.readouterr().err
    assert f"WARNING: reward function 2 ({specs[1]}) is named 'score', as is reward function 1 ({specs[0]}): it " \
           "logs as rewards/score_1/mean and rewards/score_1/std" in err
    assert "reward function 4 (task_reward) is named 'task_reward', as is reward function 3" in err
    per_func = torch.tensor([[1.0, 3.0, 0.5, 0.5]] * N)
    columns = {"rewards_per_func": per_func, "rewards": per_func.sum(-1), "lengths": torch.ones(N),
               "truncated": torch.zeros(N)}
    logged = metrics.generation_metrics(columns, funcs, 2)
    assert (logged["rewards/score/mean"], logged["rewards/score_1/mean"]) == (1.0, 3.0)


def test_a_reward_named_like_a_table_column_is_renamed_visibly(capsys):
    def step(completions, **kwargs):
        return [0.0] * N

    assert rewards.RewardFunctions([step, step]).names == ["step_1", "step_2"]
    assert "is named 'step', a column of the completions table: it logs as rewards/step_1/mean" in \
        capsys.readouterr().err


def logs(call):
    def reward(completions, log_extra, log_metric, **kwargs):
        call(log_extra, log_metric)
        return [0.0] * N
    return reward


LOG_CASES = {  # what the function logs: the line
    "the trainer's reward": (lambda e, m: m("reward", 1.0), "log_metric('reward', ...): 'reward' is the trainer's own"),
    "step": (lambda e, m: m("step", 1), "log_metric('step', ...)"),  # metrics.jsonl's step, read on resume
    "an eval metric": (lambda e, m: m("eval_accuracy", 1.0), "log_metric('eval_accuracy', ...)"),
    "a reward's metric": (lambda e, m: m("rewards/reward/mean", 1.0), "log_metric('rewards/reward/mean', ...)"),
    "not a number": (lambda e, m: m("judge_score", "high"), "log_metric('judge_score', 'high'): the value must be a"),
    "a table column": (lambda e, m: e("advantage", [1] * N), "log_extra('advantage', ...): the completions table has"),
    "a reward's column": (lambda e, m: e("reward", [1] * N), "log_extra('reward', ...)"),
}


@pytest.mark.parametrize("case", list(LOG_CASES))
def test_what_a_reward_logs_under_a_name_of_the_trainers_is_one_line(case):
    call, message = LOG_CASES[case]
    error = one_line(reward_error([logs(call)]))
    assert "reward function 'reward' raised at step 0: ValueError: " + message in error, error


def test_every_metric_the_trainer_logs_is_reserved_from_log_metric(tmp_path):
    """metrics.trainer_metric holds the trainer's names: every key of a batch's and a step's metrics, and every key
    a real run writes (so a metric added without its name in metrics.TRAINER_METRICS fails here)."""
    per_func = torch.zeros(N, 1)
    columns = {"rewards_per_func": per_func, "rewards": torch.zeros(N), "lengths": torch.ones(N),
               "truncated": torch.zeros(N), "kl_sums": torch.zeros(N), "loss_tokens": torch.ones(N),
               "turns": torch.ones(N), "tool_calls": torch.ones(N), "tool_failures": torch.zeros(N),
               "env_failures": torch.zeros(N), "all_tokens": torch.ones(N)}
    keys = {*metrics.generation_metrics(columns, rewards.RewardFunctions([rewards.task_reward]), 2),
            *metrics.turn_metrics(columns)}
    sums = {k: 1.0 for k in ("tokens", "sequences", "clipped_low", "clipped_high", "loss", "entropy", "aux_loss",
                             "sampler_drift", "is_weight", "is_truncated")}
    scheduler = type("Scheduler", (), {"get_last_lr": lambda self: [1.0]})()
    keys |= set(metrics.step_metrics(sums, torch.tensor(1.0), scheduler, {"time/training": 1.0}, 1))
    keys |= {"step", "epoch", "num_tokens", "step_time", "tokens_per_second/generation", "sampling/staleness",
             "dynamic_sampling/rounds", "time/generation", "eval_reward"}
    train.main(["--max_steps", "2", "--logging_steps", "1", "--output_dir", str(tmp_path)])
    keys |= {k for line in (tmp_path / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)}
    assert [k for k in keys if not metrics.trainer_metric(k)] == []
    assert not metrics.trainer_metric("custom_accuracy") and not metrics.trainer_metric("judge/latency")


def test_a_package_directory_loads_as_reward_module(tmp_path):
    """Issue: DIR:fn with DIR a package was 'cannot import module ... ModuleNotFoundError'. Its relative imports
    work; a directory without __init__.py is one line."""
    package = tmp_path / "judges"
    package.mkdir()
    (package / "__init__.py").write_text("from .scoring import score\n")
    (package / "scoring.py").write_text(SCORE.format(value=2.0))
    func = rewards.load_reward_func(f"{package}:score")
    assert func(completions=["a", "b"]) == [2.0, 2.0]
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="reward function directory .*plain' has no __init__.py: make it a package, "
                                         "or give DIR/FILE.py:FUNCTION"):
        rewards.load_reward_func(f"{tmp_path / 'plain'}:score")


def test_a_reward_module_named_like_one_of_rloos_is_one_line(tmp_path, monkeypatch):
    """./rollout.py:score passed as rollout:score imported rloo's rollout.py, which has no score."""
    (tmp_path / "rollout.py").write_text(SCORE.format(value=1.0))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"'rollout' has no function 'score' \(reward function 'rollout:score'\): "
                                         r"'rollout' is rloo's own rollout.py, which shadows the rollout.py here; "
                                         r"pass rollout.py:score"):
        rewards.load_reward_func("rollout:score")
    assert rewards.load_reward_func("rollout.py:score")(completions=["a"]) == [1.0]


def test_a_reward_module_in_the_working_directory_but_not_on_the_path_says_how(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(SCORE.format(value=1.0))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    with pytest.raises(ValueError, match="No module named 'my_rewards'; to load the my_rewards.py here, pass "
                                         "my_rewards.py:FUNCTION"):
        rewards.load_reward_func("my_rewards:score")


DATACLASS_FILE = """from __future__ import annotations
import dataclasses

@dataclasses.dataclass
class Judge:
    value: float = 1.0

    def __call__(self, completions, **kwargs):
        return [self.value] * len(completions)

judge = Judge()

def make_env(row):
    return Judge()
"""


def test_files_loaded_by_path_get_a_module_name_of_their_own(tmp_path):
    """A dataclass under `from __future__ import annotations` looks its module up in sys.modules: a reward or
    environment file defining one failed to load ('NoneType' object has no attribute '__dict__'). Two files of one
    name both load, and neither replaces a module of that name (json)."""
    (tmp_path / "json.py").write_text(DATACLASS_FILE)
    other = tmp_path / "other"
    other.mkdir()
    (other / "json.py").write_text(DATACLASS_FILE.replace("value: float = 1.0", "value: float = 2.0"))
    assert rewards.load_reward_func(f"{tmp_path / 'json.py'}:judge")(completions=["a"]) == [1.0]
    assert rewards.load_reward_func(f"{other / 'json.py'}:judge")(completions=["a"]) == [2.0]
    assert sys.modules["json"] is json and json.dumps([1]) == "[1]"
    assert environments.load_environment(f"{tmp_path / 'json.py'}:make_env")({}).value == 1.0


def test_two_tools_that_are_one_function_are_one_line(tmp_path):
    """--tools f.py:calc,add with add = calc: the model would see two schemas named calc."""
    (tmp_path / "t.py").write_text('def calc(x: int) -> int:\n    """Double.\n\n    Args:\n        x: a number\n'
                                   '    """\n    return 2 * x\n\n\nadd = calc\n')
    with pytest.raises(SystemExit) as info:
        tools.load_tools(f"{tmp_path / 't.py'}:calc,add")
    assert "two tools are named calc (add is calc), the name the model calls a tool by; list each function once" \
        in one_line(str(info.value))


# ================================================================================== what user code does to us

def test_a_reward_that_changes_its_arguments_in_place_changes_nothing_else():
    """Issue: a function that empties completions and clears completion_ids left later functions and the logged
    completions with the mutated data. Each function now gets its own copies (lists, as user code expects)."""
    def vandal(prompts, completions, completion_ids, trainer_state, target, **kwargs):
        prompts[0].clear()
        prompts[2].append({"role": "user", "content": "injected"})
        completions[0][0]["content"] = "changed"
        completions.clear()
        for ids in completion_ids:
            ids.clear()
        completion_ids.append([99])
        target[0] = "changed"
        trainer_state.global_step = 99
        return [0.0] * N

    seen = {}

    def witness(prompts, completions, completion_ids, trainer_state, target, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, step=trainer_state.global_step,
                    target=target)
        return [1.0] * N

    chat = [[{"role": "user", "content": "1="}], [{"role": "user", "content": "2="}]]
    batch = rollout({"prompt": chat, "target": ["1", "2"]})
    before = (json.dumps(batch.rows), list(batch.texts), [list(i) for i in batch.completion_lists])
    out = rewards.RewardFunctions([vandal, witness])(batch, 2, 0)
    assert out[:, 1].tolist() == [1.0] * N
    assert seen["prompts"] == [chat[0], chat[0], chat[1], chat[1]] and seen["ids"] == [[5, 6], [7], [8, 9], [0]]
    assert seen["completions"] == [[{"role": "assistant", "content": t}] for t in "abcd"]
    assert seen["target"] == ["1", "1", "2", "2"] and seen["step"] == 0
    assert (json.dumps(batch.rows), batch.texts, batch.completion_lists) == before


def test_a_reward_that_changes_a_multi_turn_conversation_leaves_the_rollouts_turns():
    turns = [[{"role": "assistant", "content": t}, {"role": "tool", "content": "r"}] for t in "abcd"]
    batch = rollout(turns=json.loads(json.dumps(turns)))

    def vandal(completions, **kwargs):
        completions[0].pop()
        completions[1][0]["content"] = ""
        return [0.0] * N

    rewards.RewardFunctions([vandal, vandal])(batch, 2, 0)  # the second sees what the first did not change
    assert batch.turns == turns


@pytest.fixture
def quick_clock(monkeypatch):
    """The async default limit and the slow warning's intervals shrunk from minutes to tenths of a second."""
    monkeypatch.setattr(reward_calls, "ASYNC_TIMEOUT", 0.5)
    monkeypatch.setattr(reward_calls, "SLOW_AFTER", 0.1)
    monkeypatch.setattr(reward_calls, "SLOW_EVERY", 0.1)


def test_an_async_reward_that_never_returns_stops_at_the_default_limit_and_warns_meanwhile(quick_clock, capsys):
    """Issue: with no --reward_timeout the run hung forever with no word."""
    async def stuck(completions, **kwargs):
        await asyncio.sleep(3600)

    async def fine(completions, **kwargs):
        return [1.0] * N

    start = time.monotonic()
    error = one_line(reward_error([fine, stuck]))
    assert time.monotonic() - start < 5
    assert "reward function 'stuck' at step 0 did not return within 0.5 s, the default for async reward functions " \
           "(--reward_timeout)" in error
    warnings = [line for line in capsys.readouterr().err.splitlines() if "WARNING" in line]
    assert len(warnings) >= 2 and all("reward function 'stuck' still running at step 0 after" in w for w in warnings)
    assert "stopped at 0.5 s, the default for async reward functions; --reward_timeout sets another" in warnings[0]


def test_a_slow_sync_reward_is_named_while_it_runs_on_the_main_thread(quick_clock, capsys):
    """Sync rewards get no default limit and stay on the main thread: accuracy_reward's math-verify timeout uses
    signals there. They are still named while slow."""
    threads = []

    def slow(completions, **kwargs):
        threads.append(threading.current_thread())
        time.sleep(0.45)
        return [1.0] * N

    assert reward_error([slow]) is None and threads == [threading.main_thread()]
    warnings = [line for line in capsys.readouterr().err.splitlines() if "WARNING" in line]
    assert len(warnings) >= 2
    assert "reward function 'slow' still running at step 0 after 0 s (no time limit for a sync reward function; " \
           "--reward_timeout sets one)" in warnings[0]


def test_a_fast_reward_prints_no_warning(quick_clock, capsys):
    assert reward_error([lambda completions, **kw: [1.0] * N]) is None
    time.sleep(0.25)  # past the first warning: the watch ended with the call
    assert "WARNING" not in capsys.readouterr().err


async def judge_timed_out(completions, **kwargs):
    raise TimeoutError("judge API timed out")


def coroutine_returned(completions, **kwargs):
    return judge_timed_out(completions)


RETURN_CASES = {  # function or its return value: the line
    "a sync wrapper returning a coroutine": (coroutine_returned, "reward function 'coroutine_returned' returned a "
                                             "coroutine without awaiting it: declare it (or its __call__) `async def`"),
    "its own TimeoutError": (judge_timed_out, "reward function 'judge_timed_out' raised at step 0: TimeoutError: judge "
                                              "API timed out"),  # not taken for the trainer's timeout
    "a string of the right length": ("1234", "must return a list of 4 floats (one per completion), got str"),
    "a tensor of the wrong length": (torch.ones(3), "must return a list of 4 floats (one per completion), got length 3"),
    "a column tensor [B, 1]": (torch.ones(N, 1), "returned a list ([1.0]) for completion 0"),
    "a generator": ((x for x in [1.0] * N), "must return a list of 4 floats (one per completion), got generator"),
}


@pytest.mark.parametrize("case", list(RETURN_CASES))
def test_a_reward_returning_the_wrong_kind_is_one_line(case):
    func, message = RETURN_CASES[case]
    if not callable(func):
        value = func

        def func(completions, **kwargs):
            return value
    assert message in one_line(reward_error([func]))


def test_a_tensor_or_array_of_rewards_is_taken():
    import numpy
    values = [torch.tensor([1.0, 0.0, 1.0, 0.0]), numpy.array([1.0, 0.0, 1.0, 0.0], dtype=numpy.float32)]
    out = rewards.RewardFunctions([lambda completions, v=v, **kw: v for v in values])(rollout(), 2, 0)
    assert out.T.tolist() == [[1.0, 0.0, 1.0, 0.0]] * 2


@pytest.fixture(scope="module")
def tokenizer():
    return data.embedded_task(0)[1]


def multi_turn(tokenizer, make_env):
    cfg = config.parse_config(["--environment", "user_env.py:make_env", "--environment_timeout", "0.3"])
    return environments.MultiTurn(cfg, None, make_env, tokenizer, [0], 64)


class Env:
    """An environment whose reset and step return what it is given."""

    def __init__(self, reset=None, step=("1=", False)):
        self.reset_value, self.step_value = reset, step

    def reset(self):
        return self.reset_value

    def step(self, text):
        return self.step_value


def hangs(row):
    time.sleep(30)


START_CASES = {  # factory: the line
    "reset returns an int (issue)": (lambda row: Env(reset=5), "reset() returned '5' of type int; return a prompt (a "
                                                               "non-empty string or a list of {'role', 'content'} "
                                                               "messages), or None for the row's"),
    "reset returns an empty string": (lambda row: Env(reset=" "), "reset() returned an empty string"),
    "reset returns a list of words": (lambda row: Env(reset=["1", "="]), "reset() returned a list whose item 0 is '1'"),
    "reset returns a message without a role": (lambda row: Env(reset=[{"content": "1="}]),
                                               "reset() returned a conversation whose message 0 has no string 'role'"),
    "the factory returns None": (lambda row: None, "the factory returned 'None' (a NoneType), which has no step(text) "
                                                   "method; return an environment"),
    "the factory hangs": (hangs, "making the environment of a row did not return within --environment_timeout 0.3 s"),
    "reset raises": (lambda row: type("E", (Env,), {"reset": lambda self: {}["room"]})(),
                     "making the environment of a row raised KeyError: 'room'"),
}


@pytest.mark.parametrize("case", list(START_CASES))
def test_an_environment_that_cannot_start_is_one_line(tokenizer, case):
    factory, message = START_CASES[case]
    with pytest.raises(SystemExit) as info:
        multi_turn(tokenizer, factory).start({"prompt": "12=", "target": "12"})
    assert f"error: --environment user_env.py:make_env: {message}" in one_line(str(info.value))


def test_an_environment_whose_reset_returns_a_prompt_or_none_starts(tokenizer):
    for reset, prompt in [(None, "12="), ("3=", "3=")]:
        t = multi_turn(tokenizer, lambda row, r=reset: Env(reset=r)).start({"prompt": "12=", "target": "12"})
        assert t.prompt == prompt


CHAT = [{"role": "user", "content": "1="}]
STEP_CASES = {  # (prompt, what step returns): the line
    "(int, bool)": ("1=", (5, False), "got a reply '5' of type int"),
    "a 3-tuple": ("1=", ("a", False, 1.0), "got ('a', False, 1.0)"),
    "done a string": ("1=", ("a", "no"), "got done='no' (a str), which is not True or False"),
    "done None": ("1=", ("a", None), "got done='None' (a NoneType)"),
    "a message list to a string prompt": ("1=", ([{"role": "user", "content": "x"}], False), "got a reply"),
    "a string to a conversation": (CHAT, ("x", False), "with reply a list of messages (or anything with done=True); "
                                                       "got a reply 'x' of type str"),
    "a message whose content is an int": (CHAT, ([{"role": "user", "content": 5}], False),
                                          "got a reply that is a conversation whose message 0 (user) has a 'content' "
                                          "of type int, not a string"),
    "a message without a role": (CHAT, ([{"content": "x"}], False), "has no string 'role'"),
}


@pytest.mark.parametrize("case", list(STEP_CASES))
def test_an_environment_step_returning_the_wrong_kind_is_one_line(tokenizer, case):
    prompt, returned, message = STEP_CASES[case]
    loop = multi_turn(tokenizer, None)
    t = environments.Trajectory(Env(step=returned), prompt, [1], 10)
    with pytest.raises(SystemExit) as info:
        loop.step(t, "question")
    assert "step must return (reply, done)" in one_line(str(info.value)) and message in str(info.value)


@pytest.mark.parametrize("returned, expected", [
    (("ok", False), ("ok", False)), ((None, True), (None, True)), ((5, True), (5, True)),  # done: the reply unused
    (("ok", 0), ("ok", False)), (("ok", torch.tensor(True)), ("ok", True)),
])
def test_an_environment_step_of_the_right_kind_is_taken(tokenizer, returned, expected):
    t = environments.Trajectory(Env(step=returned), "1=", [1], 10)
    assert multi_turn(tokenizer, None).step(t, "question") == expected


def test_a_tool_result_json_cannot_hold_is_its_str_with_a_warning_once(capsys):
    """A set or an object reads as its repr, which the tool's author likely never meant: said once per tool."""
    funcs = {"members": lambda: {1, 2}}
    for _ in range(2):
        assert tools.call_tool(funcs, {"name": "members", "arguments": {}}, 5) == ("{1, 2}", False)
    err = capsys.readouterr().err
    assert err.count("WARNING") == 1
    assert "tool members returned a set, which is neither text nor JSON: the model reads its str(), '{1, 2}'; " \
           "return a str or JSON data" in err


def test_a_tool_result_of_arrays_and_tensors_is_json(capsys):
    import numpy
    funcs = {"stats": lambda: {"mean": numpy.float32(0.5), "counts": numpy.array([1, 2]), "t": torch.tensor([3])},
             "count": lambda: numpy.int64(7)}
    assert tools.call_tool(funcs, {"name": "stats", "arguments": {}}, 5) == (
        '{"mean": 0.5, "counts": [1, 2], "t": [3]}', False)
    assert tools.call_tool(funcs, {"name": "count", "arguments": {}}, 5) == ("7", False)
    assert "WARNING" not in capsys.readouterr().err
