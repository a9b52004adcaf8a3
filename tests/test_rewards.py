"""rewards.py: the calling convention, loading by name, validation, async concurrency, built-ins."""

import asyncio
import functools
import re

import pytest
import torch

import rewards
from plumbing import config
from step.reward_calls import compute_rewards, reward_name
from rewards import load_reward_func

PROMPTS = ["Solve: 2x + 3 = 7"] * 2 + ["2+2?"] * 2
COMPLETIONS = ["x = \\boxed{2}", "\\boxed{3}", "it is \\boxed{4}", "no idea"]
IDS = [[1, 2], [3], [4, 5, 6], [7]]


# The seed's example functions, verbatim (../shared/seed/RLOO_Trainer.txt)
def reward_func(completions, ground_truth, **kwargs):
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def format_reward_func(completions, **kwargs):
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def check_correct(completion):
    return "4" in completion


def math_reward_func(completions, task, **kwargs):
    rewards = []
    for completion, t in zip(completions, task):
        if t == "math":
            rewards.append(1.0 if check_correct(completion) else -1.0)
        else:
            rewards.append(None)  # not applicable
    return rewards


def test_seed_examples_run_verbatim_with_columns_and_none():
    columns = {"ground_truth": ["2", "2", "4", "4"], "task": ["math", "math", "chat", "math"]}
    out = compute_rewards([reward_func, math_reward_func], PROMPTS, COMPLETIONS, IDS, columns)
    assert out.shape == (4, 2)
    assert out[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert out[[0, 1, 3], 1].tolist() == [-1.0, -1.0, -1.0] and torch.isnan(out[2, 1])
    conversational = [[{"role": "assistant", "content": "<think>hm</think><answer>4</answer>"}],
                      [{"role": "assistant", "content": "4"}]]
    assert compute_rewards([format_reward_func], PROMPTS[:2], conversational, IDS[:2], {})[:, 0].tolist() == [1.0, 0.0]


def test_functions_receive_the_documented_keywords():
    seen = {}

    def spy(prompts, completions, completion_ids, label, **kwargs):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, label=label, **kwargs)
        return [0.0] * len(completions)

    compute_rewards([spy], PROMPTS, COMPLETIONS, IDS, {"label": list("abcd")}, step=7)
    assert seen["prompts"] == PROMPTS and seen["completions"] == COMPLETIONS and seen["completion_ids"] == IDS
    assert seen["label"] == list("abcd") and seen["step"] == 7


@pytest.mark.parametrize("output, problem", [
    ([1.0, 2.0], "must return a list of 4 floats"),
    (3.0, "must return a list of 4 floats"),
    ([1.0, "good", 0.0, 0.0], "returned a str"),
    ([1.0, float("nan"), 0.0, 0.0], "not finite"),
    ([1.0, float("inf"), 0.0, 0.0], "not finite"),
])
def test_bad_outputs_are_named_errors(output, problem):
    def broken_reward(**kwargs):
        return output
    with pytest.raises(ValueError, match=f"reward function 'broken_reward' .*{re.escape(problem)}|'broken_reward' {problem}"):
        compute_rewards([broken_reward], PROMPTS, COMPLETIONS, IDS, {})


def test_exception_in_reward_names_the_function_and_keeps_the_cause():
    def crashing_reward(**kwargs):
        raise KeyError("missing column")
    with pytest.raises(rewards.RewardError, match="crashing_reward") as info:
        compute_rewards([crashing_reward], PROMPTS, COMPLETIONS, IDS, {})
    assert isinstance(info.value.__cause__, KeyError)


def test_async_rewards_run_concurrently():
    """Each coroutine waits until all three have started: only concurrent calls all see the others (-1 = gave up)."""
    started, total = [], 3

    def make(k):
        async def waiting_reward(completions, **kwargs):
            started.append(k)
            for _ in range(2000):
                if len(started) == total:
                    return [float(k)] * len(completions)
                await asyncio.sleep(0.001)
            return [-1.0] * len(completions)
        waiting_reward.__name__ = f"waiting_{k}"
        return waiting_reward

    funcs = [make(k) for k in range(total)]
    out = compute_rewards(funcs, PROMPTS, COMPLETIONS, IDS, {})
    assert out[0].tolist() == [0.0, 1.0, 2.0]


def test_load_by_name_module_and_file(tmp_path):
    assert load_reward_func("think_format_reward") is rewards.think_format_reward
    assert load_reward_func("rewards:task_reward") is rewards.task_reward
    f = tmp_path / "my_rewards.py"
    f.write_text("def length_reward(completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    fn = load_reward_func(f"{f}:length_reward")
    assert fn(completions=["ab", "c"]) == [2.0, 1.0]
    with pytest.raises(ValueError, match="unknown reward function 'nope'.*accuracy_reward"):
        load_reward_func("nope")
    with pytest.raises(ValueError, match="has no function 'missing'"):
        load_reward_func(f"{f}:missing")


def test_reward_names_through_partials_and_callable_objects():
    class Judge:
        def __call__(self, completions, **kwargs):
            return [0.0] * len(completions)
    assert reward_name(functools.partial(functools.partial(reward_func, ground_truth=[]))) == "reward_func"
    assert reward_name(Judge()) == "Judge"
    assert reward_name(rewards.soft_overlong_punishment(10, 4)) == "soft_overlong_punishment_reward"


def test_task_reward_partial_credit():
    got = rewards.task_reward(["321", "3x1", "32", "3210", "", "123"], ["321"] * 6)
    assert got == [1.0, 2 / 3, 2 / 3, 3 / 4, 0.0, 1 / 3]


def test_accuracy_reward_math_verify():
    out = rewards.accuracy_reward(["The answer is $\\boxed{\\frac{1}{2}}$", "\\boxed{0.5}", "\\boxed{3}",
                                   [{"role": "assistant", "content": "\\boxed{2}"}], "\\boxed{1}"],
                                  solution=["$\\frac{1}{2}$", "$\\frac{1}{2}$", "$2$", "$2$", "not math at all"])
    assert out == [1.0, 1.0, 0.0, 1.0, None]


def test_last_number_reward_reads_plain_text_answers():
    completions = ["7", "The answer is 7.", "3 + 4 = 8", "none", "1,234", [{"role": "assistant", "content": "It is -2"}]]
    assert rewards.last_number_reward(completions, ["7", "$7$", "7", "7", "1234", "-2"]) == [1, 1, 0, 0, 1, 1]
    assert rewards.last_number_reward(["7"], ["no number"]) == [None]  # unscorable, not wrong
    assert rewards.load_reward_func("last_number_reward") is rewards.last_number_reward


def test_accuracy_reward_is_safe_off_the_main_thread():
    """math-verify's signal-based timeout only works on the main thread; in a worker thread we run without it."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        out = pool.submit(rewards.accuracy_reward, ["\\boxed{2}", "\\boxed{3}"], solution=["$2$", "$2$"]).result()
    assert out == [1.0, 0.0]


def test_think_format_and_soft_overlong():
    assert rewards.think_format_reward(["<think>a</think>b", "<think>a<think>b</think>", "b"]) == [1.0, 0.0, 0.0]
    punish = rewards.soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    assert punish(completion_ids=[[0] * 6, [0] * 8, [0] * 10, [0] * 11]) == [0.0, -0.5, -1.0, -1.0]
    # by name (--reward_funcs soft_overlong_punishment): the cache is the last fifth of the budget
    cfg = config.parse_config(["--reward_funcs", "task_reward", "soft_overlong_punishment",
                              "--max_completion_length", "10"])
    funcs = rewards.load_rewards(cfg, "cpu")
    assert funcs.names == ["task_reward", "soft_overlong_punishment_reward"]
    by_name = load_reward_func("soft_overlong_punishment", max_completion_length=10)
    assert by_name(completion_ids=[[0] * 8, [0] * 9, [0] * 10]) == [0.0, -0.5, -1.0]


def test_reward_model_scores_prompt_plus_completion_with_logits_column_zero(reward_model_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    rm = load_reward_func(str(reward_model_dir))
    assert reward_name(rm) == "tiny-rm"
    conversation = [{"role": "user", "content": "2+2?"}]
    completions = ["4", "five", [{"role": "assistant", "content": "4"}]]
    got = rm(prompts=["2+2?", "2+2?", conversation], completions=completions)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir)
    tok = AutoTokenizer.from_pretrained(reward_model_dir)
    texts = ["2+2?4", "2+2?five", tok.apply_chat_template(conversation + completions[2], tokenize=False)]
    with torch.no_grad():
        want = [model(**tok(t, return_tensors="pt")).logits[0, 0].item() for t in texts]  # one at a time, no padding
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(x, 4) for x in got)) == 3


def test_unknown_model_like_name_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot load reward model"):
        load_reward_func(str(tmp_path))  # a directory without a model
