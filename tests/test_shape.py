"""The shape the code promises (README 'Files'): one concept per file, a train.py a reader can hold, short functions,
short lines. Checked with ast on every top-level .py file (tests excluded)."""

import ast
import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP_LEVEL = sorted(glob.glob(os.path.join(ROOT, "*.py")))
MAX_FUNCTION_LINES, MAX_LINE = 60, 120


def functions(path):
    with open(path) as f:
        tree = ast.parse(f.read())
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def length(node):
    """Lines from the def (or its first decorator) to the last line of the body."""
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return node.end_lineno - first + 1


def test_top_level_files_are_found():
    names = {os.path.basename(p) for p in TOP_LEVEL}
    assert {"train.py", "rloo.py", "rollout.py", "rewards.py", "bench.py"} <= names


def test_train_py_is_at_most_500_lines():
    with open(os.path.join(ROOT, "train.py")) as f:
        assert len(f.read().splitlines()) <= 500


def test_main_is_at_most_60_lines():
    (main,) = [f for f in functions(os.path.join(ROOT, "train.py")) if f.name == "main"]
    assert length(main) <= MAX_FUNCTION_LINES


@pytest.mark.parametrize("path", TOP_LEVEL, ids=os.path.basename)
def test_no_function_is_longer_than_60_lines(path):
    long = [(f.name, length(f)) for f in functions(path) if length(f) > MAX_FUNCTION_LINES]
    assert not long, f"{os.path.basename(path)}: {long}"


@pytest.mark.parametrize("path", TOP_LEVEL, ids=os.path.basename)
def test_no_line_is_longer_than_120_characters(path):
    with open(path) as f:
        long = [i + 1 for i, line in enumerate(f.read().splitlines()) if len(line) > MAX_LINE]
    assert not long, f"{os.path.basename(path)}: lines {long}"


@pytest.mark.parametrize("path", TOP_LEVEL, ids=os.path.basename)
def test_every_file_opens_with_a_docstring(path):
    with open(path) as f:
        assert ast.get_docstring(ast.parse(f.read())), os.path.basename(path)
