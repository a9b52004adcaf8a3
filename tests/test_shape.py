"""The shape the code promises (README 'Files'): the card's four scripts at the top and every other
concept one flat file in a folder named for what it holds, a train.py a reader can hold, short
functions, short lines, imports that run one way, named interfaces. Checked with ast on the
product's files, the README's 'Files' table: a file of the user's beside them (the README's
my_rewards.py, a scratch script) is not held to them. In seconds: python -m pytest tests/test_shape.py"""

import ast
import fnmatch
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The design card's top level: the four scripts, launch.sh, the README and the requirements; tests,
# docs, recipes and benchmarks beside them; pytest.ini (the test command's settings); and the folders
# that hold every other concept, one flat file each
CARD = {"README.md", "requirements.txt", "train.py", "rloo.py", "rollout.py", "rewards.py",
        "launch.sh", "pytest.ini", "tests", "docs", "recipes", "benchmarks"}
FOLDERS = ("step", "options", "plumbing")
SCRATCH = "my_*"  # a file of the user's at the top (README 'Files'): held to no rule


def product_files():
    """The README's 'Files' table, in its order."""
    with open(os.path.join(ROOT, "README.md")) as f:
        table = f.read().split("\n## Files\n")[1].split("\n## ")[0]
    return re.findall(r"(?m)^\| `([\w./]+)` \|", table)


def module_name(path):
    """How the code imports a file: rloo.py -> rloo, step/forward.py -> step.forward; the
    benchmarks and the recipe put their folders on sys.path: benchmarks/bench.py -> bench."""
    folder, name = os.path.split(os.path.relpath(path, ROOT)[:-3])
    return f"{folder}.{name}" if folder in FOLDERS else name


PRODUCT_FILES = product_files()
TOP_LEVEL = [os.path.join(ROOT, name) for name in PRODUCT_FILES if name.endswith(".py")]
MAX_FUNCTION_LINES, MAX_LINE, MAX_FILE_LINES = 60, 100, 600
PROJECT = {module_name(p) for p in TOP_LEVEL}


def functions(path):
    with open(path) as f:
        tree = ast.parse(f.read())
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def length(node):
    """Lines from the def (or its first decorator) to the last line of the body."""
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return node.end_lineno - first + 1


def test_top_level_files_are_found():
    names = {os.path.relpath(p, ROOT) for p in TOP_LEVEL}
    assert {"train.py", "rloo.py", "rollout.py", "rewards.py", "step/forward.py",
            "benchmarks/bench.py"} <= names


def ignored(name):
    """A name .gitignore leaves out (runs/, __pycache__/): what a run or Python writes."""
    with open(os.path.join(ROOT, ".gitignore")) as f:
        patterns = [p.strip().rstrip("/") for p in f if p.strip() and not p.startswith("#")]
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def test_the_top_level_is_the_cards_and_every_other_concept_is_in_a_folder():
    """The next concept goes into a folder (README 'Files'), never onto the top level."""
    extra = {name for name in os.listdir(ROOT) if not name.startswith(".") and not ignored(name)
             and not fnmatch.fnmatch(name, SCRATCH)} - CARD - set(FOLDERS)
    assert not extra, f"{sorted(extra)} at the top level: a new concept is a file in " \
                      f"{', '.join(FOLDERS)} (README 'Files'), a scratch file is named {SCRATCH}.py"


@pytest.mark.parametrize("folder", FOLDERS)
def test_each_folder_is_flat_and_says_what_it_holds(folder):
    """No folder inside a folder; its __init__.py only says what it holds (no package machinery)."""
    inside = [n for n in os.listdir(os.path.join(ROOT, folder)) if not ignored(n)]
    assert all(n.endswith(".py") for n in inside), inside
    with open(os.path.join(ROOT, folder, "__init__.py")) as f:
        body = ast.parse(f.read()).body
    assert len(body) == 1 and ast.get_docstring(ast.Module(body, [])), "a docstring only"


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
    paths.update({f"{folder}.{name[:-3]}": os.path.join(ROOT, folder, name) for folder in FOLDERS
                  for name in os.listdir(os.path.join(ROOT, folder))
                  if name.endswith(".py") and name != "__init__.py"})
    while todo:
        name = todo.pop()
        found.add(name)
        todo += sorted(project_imports(paths[name], True, set(paths)) - found)
    assert found <= PROJECT, found - PROJECT
    assert PROJECT == found, "in the table, unused"


@pytest.mark.parametrize("path", TOP_LEVEL, ids=lambda p: os.path.relpath(p, ROOT))
def test_no_function_is_longer_than_60_lines(path):
    long = [(f.name, length(f)) for f in functions(path) if length(f) > MAX_FUNCTION_LINES]
    assert not long, f"{os.path.relpath(path, ROOT)}: {long}"


@pytest.mark.parametrize("path", TOP_LEVEL, ids=lambda p: os.path.relpath(p, ROOT))
def test_no_file_is_longer_than_600_lines(path):
    """A file a reader can hold; a longer one is two concepts (train.py: 500, above)."""
    with open(path) as f:
        assert len(f.read().splitlines()) <= MAX_FILE_LINES, os.path.relpath(path, ROOT)


@pytest.mark.parametrize("path", TOP_LEVEL, ids=lambda p: os.path.relpath(p, ROOT))
def test_no_line_is_longer_than_100_characters(path):
    with open(path) as f:
        long = [i + 1 for i, line in enumerate(f.read().splitlines()) if len(line) > MAX_LINE]
    assert not long, f"{os.path.relpath(path, ROOT)}: lines {long}"


@pytest.mark.parametrize("path", TOP_LEVEL, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_file_opens_with_a_docstring(path):
    with open(path) as f:
        assert ast.get_docstring(ast.parse(f.read())), os.path.relpath(path, ROOT)


def project_imports(path, top_level_only, project=None):
    """The project modules a file imports (at module level, or inside functions)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    nodes = tree.body if top_level_only else [n for f in functions(path) for n in ast.walk(f)]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in FOLDERS:
            found |= {f"{node.module}.{a.name}" for a in node.names}  # from step import forward
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found & (PROJECT if project is None else project)


def test_imports_run_one_way_without_a_cycle():
    graph = {module_name(p): project_imports(p, True) for p in TOP_LEVEL}
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
    assert graph["plumbing.config"] == {"plumbing.domains"} and graph["plumbing.domains"] == set(), \
        "plumbing/config.py (over plumbing/domains.py) is the leaf"


@pytest.mark.parametrize("path", TOP_LEVEL, ids=lambda p: os.path.relpath(p, ROOT))
def test_no_function_imports_a_project_module(path):
    """A function-level import of a project module hides a cycle; they are for optional packages."""
    assert project_imports(path, False) == set()


@pytest.mark.parametrize("path", TOP_LEVEL, ids=lambda p: os.path.relpath(p, ROOT))
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
