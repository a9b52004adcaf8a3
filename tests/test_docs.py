"""The docs name what exists, and cannot drift from the code: every `module.name`, `file.py` and `--flag` that
README.md, docs/*.md, the product's docstrings and `--help` mention; every section a citation names ("README
'Files'", "docs/vllm.md 'vLLM generation'") and every docs/ link; the lists of built-ins and of reserved names
against the code's tables; the README's file table against the files; and the README's worked example, applied to
a copy of the repository."""

import ast
import functools
import glob
import importlib
import inspect
import json
import os
import random
import re
import shutil
import subprocess
import sys

import pytest


import rewards
import rloo
from options import environments
from plumbing import config
from step import data, metrics
from conftest import in_process
from test_shape import FOLDERS, PRODUCT_FILES, ROOT, module_name

# a product module by the name prose uses (forward, as in `forward.forward_logps`) -> its file (step/forward.py)
MODULES = {os.path.basename(f)[:-3]: f for f in PRODUCT_FILES if f.endswith(".py")}
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
WORKED = "docs/worked-examples.md"  # README 'How to change one thing', worked through
# a user's own files in the examples, and other projects' sources: not ours to find
EXAMPLE_FILES = re.compile(r"^(my_\w+|FILE|file|path/to/file|__init__|envs|frozen_lake|increment_env)\.py$|^vllm/")
NOT_NAMES = {"py", "md", "json", "jsonl", "txt", "csv", "parquet", "safetensors", "sh", "lock", "whl", "gguf",
             "jinja"}  # file names: metrics.jsonl, rloo.lock
# torchrun's own flags (the launch recipes)
OTHER_FLAGS = {"nproc_per_node", "rdzv_endpoint", "rdzv_backend", "rdzv_id", "node_rank", "master_addr",
               "master_port", "write_data",  # torchrun's; recipes/arithmetic.py's own
               "top_n_sigma"}  # the flag docs/worked-examples.md's logit filter adds


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def prose(text):
    """Markdown without its fenced code blocks (their names are local variables, not references)."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def docstrings(path):
    tree = ast.parse(read(path))
    kinds = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return "\n".join(ast.get_docstring(node) or "" for node in ast.walk(tree) if isinstance(node, kinds))


@functools.cache
def help_text():
    return in_process(["--help"]).stdout


def texts():
    """Where the product names things: the docs, each product file's docstrings, --help."""
    found = {path: prose(read(path)) for path in DOCS}
    found.update({f"{path} (docstrings)": docstrings(path) for path in PRODUCT_FILES if path.endswith(".py")})
    found["train.py --help"] = help_text()
    return found


def defined(module):
    """The names a product module defines itself (not those it imports): its functions, classes and
    assignments at the top level."""
    names = set()
    for node in ast.parse(read(MODULES[module])).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            for name in ast.walk(target) if target is not None else []:
                if isinstance(name, ast.Name):
                    names.add(name.id)
    return names


def missing_names(text):
    """`module.name` (or module.Class.attribute) references in text to product modules that do not define
    them (a name the module only imports does not count: rollout.Rollout once moved to batches)."""
    missing = []
    for match in re.finditer(r"(?<![\w./-])(" + "|".join(MODULES) + r")\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)", text):
        chain = match[2].split(".")
        if chain[0] in NOT_NAMES:
            continue
        if chain[0] not in defined(match[1]):
            missing.append(match[0])
            continue
        obj = getattr(importlib.import_module(module_name(os.path.join(ROOT, MODULES[match[1]]))), chain[0])
        for part in chain[1:]:
            if not hasattr(obj, part):
                missing.append(match[0])
                break
            obj = getattr(obj, part)
    return missing


def test_every_module_name_the_docs_mention_exists():
    """rollout.Rollout (moved to batches), rollout.sampling_processors (to sampler) and forward.py's former name
    logps.py were all still named by the docs once."""
    missing = {where: found for where, text in texts().items() if (found := missing_names(text))}
    assert not missing, missing


def test_the_name_check_finds_a_stale_name():
    assert missing_names("the batch is `rollout.Rollout`, built by `batches.concat`") == ["rollout.Rollout"]


def test_every_file_and_flag_the_docs_mention_exists():
    fields = set(config.Config.__dataclass_fields__)
    bench = {flag for tool in ("benchmarks/bench.py", "benchmarks/bench_learning.py", "benchmarks/gpu_check.py")
             for flag in re.findall(r'add_argument\("--(\w+)"', read(tool))}
    problems = []
    for where, text in texts().items():
        for match in re.finditer(r"(?<![\w/.-])([\w/.-]*\w\.py)\b", text):
            path = match[1]
            if not EXAMPLE_FILES.search(path) and not any(os.path.exists(os.path.join(ROOT, d, path))
                                                          for d in ("", "tests", "tests/data", "benchmarks")):
                problems.append((where, path))
        for flag in re.findall(r"--([a-z0-9]+(?:_[a-z0-9]+)+)", text):  # ours have underscores; vLLM's hyphens
            if flag.removeprefix("no_") not in fields | bench | OTHER_FLAGS:  # --no_X: a boolean's off
                problems.append((where, "--" + flag))
    assert not problems, problems


def test_every_cited_section_and_linked_page_exists():
    """Code and docs cite sections by page and heading, as README 'Files' or docs/vllm.md 'vLLM generation' (a
    title may wrap over lines, in a comment too), and link the pages."""
    headings = {path: re.findall(r"(?m)^#+ (.+)$", read(path)) for path in DOCS}
    tests = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tests", "*.py")))
    sources = DOCS + PRODUCT_FILES + [t for t in tests if t != "tests/test_docs.py"] + [".ci/run"]
    problems = []
    for source in sources:
        text = read(source)
        for page, title in re.findall(r"(README|docs/[\w-]+\.md) '([^']+)'", text):
            page, title = "README.md" if page == "README" else page, re.sub(r"\s+(#\s*)?", " ", title)
            if title not in headings.get(page, []):
                problems.append((source, page, title))
        base = os.path.dirname(source) if source.endswith(".md") else ""
        for link in re.findall(r"\]\(([\w./-]+\.md)\)", text):
            if not os.path.exists(os.path.join(ROOT, base, link)):
                problems.append((source, link))
    assert not problems, problems


def test_every_docs_page_is_linked_from_the_readme():
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)\)", read("README.md")))
    assert linked == set(DOCS[1:]), set(DOCS[1:]) ^ linked


def test_the_readme_front_page_is_short():
    assert len(read("README.md").splitlines()) <= 300


def test_the_lists_of_built_ins_are_the_codes():
    """Each built-in reward (rewards.BUILTIN_NAMES) and environment (environments.BUILTINS) is named by --help
    and by its page; the README's 'Files' table lists the product's files, and no other."""
    helped = help_text().replace("\n", " ")
    for name in rewards.BUILTIN_NAMES:
        assert name in helped and re.search(rf"`{name}\b", read("docs/rewards.md")), name
    for name in environments.BUILTINS:
        assert name in helped and re.search(rf"\b{name}\b", read("docs/multi-turn.md")), name
    on_disk = {os.path.join(folder, f) for folder in ("", "benchmarks", "recipes") + FOLDERS
               for f in os.listdir(os.path.join(ROOT, folder))
               if f.endswith((".py", ".sh")) and not f.startswith("my_") and f != "__init__.py"}
    assert set(PRODUCT_FILES) == on_disk - {"conftest.py"}, set(PRODUCT_FILES) ^ on_disk


def test_the_reserved_names_are_listed_where_their_users_read():
    """What the trainer passes reward functions (data.REWARD_ARGUMENTS: no dataset column may take these names)
    is listed in docs/rewards.md; the metric names and groups it owns (metrics.TRAINER_METRICS, TRAINER_GROUPS: no
    reward function may log under them) in docs/reference.md."""
    reward_page, reference = read("docs/rewards.md"), read("docs/reference.md")
    for name in data.REWARD_ARGUMENTS:
        assert re.search(rf"`{name}\b", reward_page), name
    for name in metrics.TRAINER_METRICS:
        assert re.search(rf"`{name}\b", reference), name
    for group in metrics.TRAINER_GROUPS:
        assert f"`{group}/" in reference, group


def test_the_advantage_estimators_are_the_table_and_the_functions():
    """config.ADVANTAGE_ESTIMATORS (the flag's choices and help) names exactly rloo.py's NAME_advantages(rewards,
    num_generations, **settings) functions, whose settings have defaults."""
    functions = {}
    for name, f in vars(rloo).items():
        parameters = list(inspect.signature(f).parameters.values()) if callable(f) else []
        if name.endswith("_advantages") and name != "estimate_advantages" and \
                [p.name for p in parameters[:2]] == ["rewards", "num_generations"]:
            assert all(p.default is not p.empty for p in parameters[2:]), name
            functions[name.removesuffix("_advantages")] = f
    assert set(functions) == set(config.ADVANTAGE_ESTIMATORS)


def worked_example():
    """The README's worked example: (the function for rloo.py, the entry for config.ADVANTAGE_ESTIMATORS)."""
    section = read(WORKED).split("## Worked example")[1].split("\n## ")[0]
    function, entry = re.findall(r"```python\n(.*?)```", section, re.S)
    return function, entry


@pytest.mark.slow
def test_the_worked_example_trains_and_keeps_the_house_rules(tmp_path):
    """The two blocks of docs/worked-examples.md 'Worked example: GRPO's advantages', applied to a copy of the repository as a reader
    would (the function after rloo_advantages, the entry into the table): --advantage_estimator grpo trains the
    embedded task (its group-normalised advantages reach the loss), and the copy, with a scratch file of the
    reader's beside train.py, passes the house rules."""
    function, entry = worked_example()
    copy = tmp_path / "rloo"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "runs", "__pycache__", ".pytest_cache"))
    source = (copy / "rloo.py").read_text()
    anchor = source.index("\n\n\ndef ", source.index("def rloo_advantages"))
    (copy / "rloo.py").write_text(source[:anchor] + "\n\n\n" + function.rstrip() + source[anchor:])
    table = (copy / "plumbing" / "config.py").read_text()
    anchor = table.index("\n", table.index("ADVANTAGE_ESTIMATORS = {\n    "))
    (copy / "plumbing" / "config.py").write_text(table[:anchor + 1] + entry + table[anchor + 1:])
    # and a reader's scratch file beside train.py, as the README's my_rewards.py: not held to the house rules
    (copy / "my_rewards.py").write_text("def f(completions, **kwargs):\n" + "    x = 1\n" * 80 +
                                        "    return [0.0 for _ in completions]  # " + "x" * 120 + "\n")
    grad_norms = []
    for settings in ("{}", '{"scale_rewards": false}'):  # its own setting, through the flag alone
        out = tmp_path / f"out{len(settings)}"
        run = subprocess.run([sys.executable, "train.py", "--advantage_estimator", "grpo", "--max_steps", "60",
                              "--advantage_estimator_kwargs", settings, "--logging_steps", "20",
                              "--output_dir", str(out)], capture_output=True, text=True, cwd=copy, timeout=600,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert run.returncode == 0, run.stderr[-3000:]
        logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert logged[-1]["reward"] > logged[0]["reward"], (settings, logged)
        grad_norms.append(logged[0]["grad_norm"])
    assert abs(grad_norms[0] - grad_norms[1]) > 0.01 * grad_norms[0], grad_norms  # the setting reached it
    rules = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                            "tests/test_shape.py",
                            "tests/test_docs.py::test_the_advantage_estimators_are_the_table_and_the_functions"],
                           capture_output=True, text=True, cwd=copy, timeout=600)
    assert rules.returncode == 0, rules.stdout[-3000:]


CURRICULUM_CHECK = """
import json, sys
from datasets import load_dataset
from plumbing import config
from step import data
dataset = load_dataset("json", data_files=sys.argv[1], split="train")
cfg = config.parse_config(["--dataset", sys.argv[1]])
per_epoch = len(dataset) // 16
def epoch(e):  # the difficulties of epoch e's rows as the two ranks draw them, step by step
    return [dataset[i]["difficulty"] for p in range(e * per_epoch, (e + 1) * per_epoch) for r in range(2)
            for i in data.prompt_indices(p, dataset, 8, cfg, shard=(r, 2))]
print(json.dumps({"first": epoch(0), "later": epoch(1)}))
"""


@pytest.mark.slow
def test_the_curriculum_example_orders_the_prompts_and_trains(tmp_path):
    """docs/worked-examples.md 'Worked example: a curriculum', its block in place of data.epoch_order in a copy of the repository, as
    a reader would apply it: two ranks' batches of the first epoch come easiest first and cover it, the next epoch
    is shuffled, the embedded model trains on a dataset with a difficulty column, and the copy keeps the house
    rules."""
    section = read(WORKED).split("## Worked example: a curriculum")[1].split("\n## ")[0]
    (function,) = re.findall(r"```python\n(.*?)```", section, re.S)
    copy = tmp_path / "rloo"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "runs", "__pycache__", ".pytest_cache"))
    source = (copy / "step" / "data.py").read_text()
    start = source.index("def epoch_order(")
    (copy / "step" / "data.py").write_text(source[:start] + function.rstrip() + source[source.index("\n\n\ndef ", start):])
    rng, path = random.Random(0), tmp_path / "curriculum.jsonl"
    digits = ["".join(rng.choice("0123456789") for _ in range(4)) for _ in range(512)]
    path.write_text("".join(json.dumps({"prompt": d + "=", "target": d, "difficulty": len(set(d))}) + "\n"
                            for d in digits))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    order = subprocess.run([sys.executable, "-c", CURRICULUM_CHECK, str(path)], capture_output=True, text=True,
                           cwd=copy, timeout=300, env=env)
    assert order.returncode == 0, order.stderr[-3000:]
    drawn = json.loads(order.stdout.strip().splitlines()[-1])
    assert drawn["first"] == sorted(len(set(d)) for d in digits)  # the whole epoch, easiest first
    assert drawn["later"] != drawn["first"] and sorted(drawn["later"]) == drawn["first"]  # then shuffled
    run = subprocess.run([sys.executable, "train.py", "--dataset", str(path), "--max_steps", "150",
                          "--logging_steps", "30", "--output_dir", str(tmp_path / "out")], capture_output=True,
                         text=True, cwd=copy, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["reward"] > logged[0]["reward"] + 0.2, logged  # 0.09 -> 0.55 here
    rules = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                            "tests/test_shape.py"],
                           capture_output=True, text=True, cwd=copy, timeout=600)
    assert rules.returncode == 0, rules.stdout[-3000:]


def worked_blocks(title):
    """The python blocks of docs/worked-examples.md's section `## {title}`, in order."""
    section = read(WORKED).split(f"## {title}\n")[1].split("\n## ")[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def repository_copy(tmp_path):
    copy = tmp_path / "rloo"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "runs", "__pycache__", ".pytest_cache"))
    return copy


def edited_product_files(copy):
    """The product files a recipe changed in the copy (the issue's target: at most three)."""
    return [f for f in PRODUCT_FILES if open(os.path.join(ROOT, f)).read() != (copy / f).read_text()]


def trains_and_keeps_the_house_rules(copy, out, flags, script):
    """The copy's own check script passes, the embedded task learns with flags, the house rules hold."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    check = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=copy, timeout=300,
                           env=env)
    assert check.returncode == 0 and check.stdout.strip().endswith("ok"), check.stderr[-3000:]
    run = subprocess.run([sys.executable, "train.py", *flags, "--max_steps", "150", "--logging_steps", "30",
                          "--output_dir", str(out)], capture_output=True, text=True, cwd=copy, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["reward"] > logged[0]["reward"] + 0.2, logged
    rules = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                            "tests/test_shape.py"],
                           capture_output=True, text=True, cwd=copy, timeout=600)
    assert rules.returncode == 0, rules.stdout[-3000:]


TOKEN_LOSS_CHECK = """
import math, torch, rloo
torch.manual_seed(0)
logps = torch.randn(3, 5, requires_grad=True)
old, mask, A = logps.detach() + 0.3 * torch.randn(3, 5), (torch.rand(3, 5) > 0.3).float(), torch.randn(3)
loss, low, high = rloo.token_loss(logps, old, A, mask, 0.2, 0.28, mask.sum())
want = 0.0  # the formula, term by term
for i in range(3):
    for t in range(5):
        r = math.exp(logps[i, t].item() - old[i, t].item())
        want += mask[i, t].item() * min(r * A[i].item(), min(max(r, 0.8), 1.28) * A[i].item())
assert abs(loss.item() + want / mask.sum().item()) < 1e-5, (loss, want)
on_policy, _, _ = rloo.token_loss(logps, logps.detach(), A, mask, 0.2, 0.28, mask.sum())
(grad,) = torch.autograd.grad(on_policy, logps)  # rho = 1: REINFORCE per token, -A_i m_it / N_tok
torch.testing.assert_close(grad, -A[:, None] * mask / mask.sum())
print("ok")
"""


@pytest.mark.slow
def test_the_token_loss_example_matches_its_formula_and_trains(tmp_path):
    """docs/worked-examples.md 'Worked example: a token-level loss' applied to a copy of the repository as a reader would: the
    function after rloo_loss, the call in train.policy_step in place of rloo_loss's (and the import). The loss is
    its formula term by term and REINFORCE per token at rho = 1, the embedded task learns with it, the copy keeps
    the house rules, and the change touches two product files."""
    function, call = worked_blocks("Worked example: a token-level loss")
    copy = repository_copy(tmp_path)
    source = (copy / "rloo.py").read_text()
    anchor = source.index("\n\n\ndef ", source.index("def rloo_loss"))
    (copy / "rloo.py").write_text(source[:anchor] + "\n\n\n" + function.rstrip() + source[anchor:])
    train = (copy / "train.py").read_text()
    start = train.index("            loss, low, high = rloo_loss(")
    end = train.index(")\n", train.index("is_weights", start)) + 2
    train = train[:start] + call + train[end:]
    (copy / "train.py").write_text(train.replace("rloo_loss, sequence_kl", "sequence_kl, token_loss"))
    assert sorted(edited_product_files(copy)) == ["rloo.py", "train.py"]
    trains_and_keeps_the_house_rules(copy, tmp_path / "out", [], TOKEN_LOSS_CHECK)


FILTER_CHECK = """
import statistics, torch, rloo
from plumbing import checks, config
from step import sampler_rules
torch.manual_seed(0)
z = 2 * torch.randn(6, 40)
kept = rloo.sampling_mask(z, top_n_sigma=1.0)
for row, keep in zip(z.tolist(), kept.tolist()):  # brute force: within one (sample) std of the top
    bound = max(row) - statistics.stdev(row)
    assert keep == [v >= bound for v in row]
assert 1 <= kept.sum(-1).min() and kept.sum(-1).max() < 40
cfg = config.parse_config(["--top_n_sigma", "1", "--replay_sampling_mask", "true"])
assert sampler_rules.sampling_filter(cfg) == {"top_n_sigma": 1.0}
try:
    checks.check_config(config.parse_config(["--top_n_sigma", "1", "--use_vllm"]))
    raise AssertionError("--use_vllm took a filter vLLM lacks")
except config.Failed as e:
    assert "--top_n_sigma: vLLM has no such filter" in str(e), e
print("ok")
"""


@pytest.mark.slow
def test_the_logit_filter_example_masks_refuses_vllm_and_trains(tmp_path):
    """docs/worked-examples.md 'Worked example: a logit filter' applied to a copy as a reader would: the flag after min_p's, the
    FILTERS line, the clause first in rloo.sampling_mask. The mask is the brute-force set, the replayed filter is
    the flag's, --use_vllm refuses it with one line, the embedded task learns with it replayed, the copy keeps the
    house rules, and the change touches three product files."""
    flag, table, clause = worked_blocks("Worked example: a logit filter")
    copy = repository_copy(tmp_path)
    source = (copy / "plumbing" / "config.py").read_text()
    anchor = source.index("\n", source.index("min_p times the top token's probability")) + 1
    (copy / "plumbing" / "config.py").write_text(source[:anchor] + flag + source[anchor:])
    source = (copy / "step" / "sampler_rules.py").read_text()
    start = source.index("FILTERS = ")
    (copy / "step" / "sampler_rules.py").write_text(source[:start] + table + source[source.index("\n", start) + 1:])
    source = (copy / "rloo.py").read_text().replace("min_p=None):", "min_p=None, top_n_sigma=None):", 1)
    anchor = source.index("\n", source.index("keep = torch.ones_like(z, dtype=torch.bool)")) + 1
    (copy / "rloo.py").write_text(source[:anchor] + clause + source[anchor:])
    assert sorted(edited_product_files(copy)) == ["plumbing/config.py", "rloo.py", "step/sampler_rules.py"]
    trains_and_keeps_the_house_rules(copy, tmp_path / "out", ["--top_n_sigma", "3", "--replay_sampling_mask",
                                                              "true"], FILTER_CHECK)
