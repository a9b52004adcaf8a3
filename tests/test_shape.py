"""The shape the code promises (README 'Files'): one concept per file, a train.py a reader can hold,
short functions, short lines, imports that run one way, named interfaces. Checked with ast on the
product's files, the README's 'Files' table: a file of the user's beside them (the README's
my_rewards.py, a scratch script) is not held to them."""

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def product_files():
    """The README's 'Files' table, in its order."""
    with open(os.path.join(ROOT, "README.md")) as f:
        table = f.read().split("\n## Files\n")[1].split("\n## ")[0]
    return re.findall(r"(?m)^\| `([\w./]+)` \|", table)


PRODUCT_FILES = product_files()
TOP_LEVEL = [os.path.join(ROOT, name) for name in PRODUCT_FILES if name.endswith(".py")]
MAX_FUNCTION_LINES, MAX_LINE, MAX_FILE_LINES = 60, 100, 600
PROJECT = {os.path.basename(p)[:-3] for p in TOP_LEVEL}


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


def test_main_and_the_loop_are_well_under_the_function_limit():
    """Room for an experiment: a few more lines in the loop must not trip a rule."""
    lengths = {f.name: length(f) for f in functions(os.path.join(ROOT, "train.py"))}
    assert lengths["main"] <= 30 and lengths["train"] <= 50, lengths


def test_every_module_the_product_imports_is_in_the_table():
    """A new concept's file joins the table (and the rules); a file nothing imports is the user's."""
    found, todo = set(), ["train", "bench", "bench_shapes", "bench_learning", "gpu_check"]
    paths = {name[:-3]: os.path.join(ROOT, folder, name) for folder in ("recipes", "benchmarks", "")
             for name in os.listdir(os.path.join(ROOT, folder)) if name.endswith(".py")}
    while todo:
        name = todo.pop()
        found.add(name)
        todo += sorted(project_imports(paths[name], True, set(paths)) - found)
    assert found <= PROJECT, found - PROJECT
    assert {os.path.basename(p) for p in TOP_LEVEL} == {m + ".py" for m in found}, "in the table, unused"


@pytest.mark.parametrize("path", TOP_LEVEL, ids=os.path.basename)
def test_no_function_is_longer_than_60_lines(path):
    long = [(f.name, length(f)) for f in functions(path) if length(f) > MAX_FUNCTION_LINES]
    assert not long, f"{os.path.basename(path)}: {long}"


@pytest.mark.parametrize("path", TOP_LEVEL, ids=os.path.basename)
def test_no_file_is_longer_than_600_lines(path):
    """A file a reader can hold; a longer one is two concepts (train.py: 500, above)."""
    with open(path) as f:
        assert len(f.read().splitlines()) <= MAX_FILE_LINES, os.path.basename(path)


@pytest.mark.parametrize("path", TOP_LEVEL, ids=os.path.basename)
def test_no_line_is_longer_than_100_characters(path):
    with open(path) as f:
        long = [i + 1 for i, line in enumerate(f.read().splitlines()) if len(line) > MAX_LINE]
    assert not long, f"{os.path.basename(path)}: lines {long}"


@pytest.mark.parametrize("path", TOP_LEVEL, ids=os.path.basename)
def test_every_file_opens_with_a_docstring(path):
    with open(path) as f:
        assert ast.get_docstring(ast.parse(f.read())), os.path.basename(path)


def project_imports(path, top_level_only, project=None):
    """The project modules a file imports (at module level, or inside functions)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    nodes = tree.body if top_level_only else [n for f in functions(path) for n in ast.walk(f)]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & (PROJECT if project is None else project)


def test_imports_run_one_way_without_a_cycle():
    graph = {os.path.basename(p)[:-3]: project_imports(p, True) for p in TOP_LEVEL}
    state = {}

    def visit(module, trail):
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", "import cycle: " + " -> ".join(trail + [module])
        state[module] = "open"
        for imported in sorted(graph[module]):
            visit(imported, trail + [module])
        state[module] = "done"

    for module in graph:
        visit(module, [])
    assert graph["config"] == {"domains"} and graph["domains"] == set(), "config.py (over domains.py) is the leaf"


@pytest.mark.parametrize("path", TOP_LEVEL, ids=os.path.basename)
def test_no_function_imports_a_project_module(path):
    """A function-level import of a project module hides a cycle; they are for optional packages."""
    assert project_imports(path, False) == set()


@pytest.mark.parametrize("path", TOP_LEVEL, ids=os.path.basename)
def test_no_function_returns_a_tuple_of_its_inner_functions(path):
    """Interfaces are named (a class or a dataclass of callables), not unpacked by position."""
    offenders = []
    for f in functions(path):
        inner = {n.name for n in ast.walk(f) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n is not f}
        for node in ast.walk(f):
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple):
                names = {e.id for e in node.value.elts if isinstance(e, ast.Name)}
                if names & inner:
                    offenders.append(f.name)
    assert not offenders, offenders
