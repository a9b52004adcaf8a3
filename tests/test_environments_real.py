"""A TRL-style environment class on a real model (docs/multi-turn.md 'Multi-turn: tools and environments'): SmolLM2-135M-Instruct
with the calculator as the method of tests/data/calculator_env.py's CalculatorEnv, which scores itself (get_reward),
so the run has no --reward_funcs. The tool-function twin is tests/test_multiturn.py's real-model test."""
import pathlib

import pytest

from conftest import in_process
from test_train import read_metrics

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_a_trl_environment_class_on_a_real_model_calls_its_tool_and_scores_itself(smollm2_dir, tmp_path):
    """One step on 4 questions with three worked examples each (tests/data/multiply_tools.jsonl): the class loads
    unchanged (no-arg constructor, reset(solution, **kwargs), a tool method), its calculator method is shown to the
    model and called in most trajectories, and get_reward is the run's only reward source, logged under the class
    name (rewards/CalculatorEnv/mean) and nonzero: some calls returned the solution."""
    from chat_templates import QWEN2_5
    (tmp_path / "qwen.jinja").write_text(QWEN2_5)
    data_file = tmp_path / "data.jsonl"
    with open(ROOT / "tests" / "data" / "multiply_tools.jsonl") as f:
        data_file.write_text("".join(f.readlines()[:4]))
    out = in_process(["--model", str(smollm2_dir), "--dataset", str(data_file),
               "--environment", str(ROOT / "tests" / "data" / "calculator_env.py") + ":CalculatorEnv",
               "--chat_template_path", str(tmp_path / "qwen.jinja"),
               "--max_completion_length", "40", "--num_generations", "2", "--per_device_train_batch_size", "8",
               "--temperature", "0.7", "--beta", "0", "--max_steps", "1", "--bf16", "false", "--logging_steps", "1",
               "--save_strategy", "no", "--output_dir", str(tmp_path / "run")])
    assert out.returncode == 0, out.stderr[-3000:]
    (m,) = read_metrics(tmp_path / "run")
    assert [k for k in m if k.startswith("rewards/") and k.endswith("/mean")] == ["rewards/CalculatorEnv/mean"]
    assert m["tools/call_frequency"] > 0.25 and m["tools/failure_frequency"] < 0.5 and m["turns/mean"] > 1.2
    assert m["reward"] > 0 and m["rewards/CalculatorEnv/mean"] == m["reward"]
