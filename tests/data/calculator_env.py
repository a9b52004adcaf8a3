"""A TRL-style environment class (README 'Multi-turn: tools and environments'), the worked example
of an environment that owns its tool and its reward:

    python train.py --model runs/smollm2-135m --dataset tests/data/multiply_tools.jsonl \
        --chat_template_path runs/qwen2.5.jinja \
        --environment tests/data/calculator_env.py:CalculatorEnv

No-argument constructor, reset(**row columns), public methods as tools (type hints and a
Google-style docstring give their schemas), get_reward() from its own state: no --reward_funcs."""
import os
import sys

# the safe parser of --tools tests/data/calculator.py, beside this file (never eval)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from calculator import calculator as evaluate  # noqa: E402


class CalculatorEnv:
    def reset(self, solution, **kwargs):
        """The row's `solution` column; None keeps the row's prompt (its worked examples)."""
        self.solution, self.results = str(solution), []

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / and parentheses.

        Args:
            expression: the expression, e.g. "37 * 41"
        """
        result = evaluate(expression)
        self.results.append(result)
        return result

    def get_reward(self) -> float:
        """1.0 if a calculator call returned the solution: the model asked the right question."""
        return float(self.solution in self.results)
