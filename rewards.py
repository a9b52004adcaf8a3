"""Reward functions: the calling convention, loading by name, validation, and the built-in rewards.

Interface (same as TRL's GRPOTrainer/RLOOTrainer; README 'Writing a reward function'): a reward
function is called as
    f(prompts=[...], completions=[...], completion_ids=[...], **dataset_columns, step=...,
      trainer_state=..., log_extra=..., log_metric=...)
with one entry per completion (each prompt repeated G times) and returns a list of float | None of
the same length. None means "does not apply to this completion". Each function gets its own
copy of the arguments (what it changes in place, no other sees). `async def` functions run
concurrently, stopped after ASYNC_TIMEOUT (10 minutes) unless --reward_timeout says otherwise;
a function still running after a minute is named on stderr every minute. As in TRL,
trainer_state is a transformers.TrainerState (global_step, max_steps, epoch, ...),
log_extra(column, values) adds a column of one value per completion to the completions table, and
log_metric(name, value) logs a scalar: the mean over the step's calls on all ranks.
"""

import asyncio
import contextlib
import copy
import functools
import importlib
import importlib.util
import inspect
import itertools
import math
import numbers
import os
import re
import sys
import sysconfig
import threading
import time
import traceback

import torch
from transformers import TrainerState

import distributed
import tools
from config import fail
from models import load_reward_model, prepare_model
from prompting import is_conversational, repeat_each


# ---------------------------------------------------------------------------------------------
# Built-in rewards
# ---------------------------------------------------------------------------------------------

def _text(completion):
    """Completion text, for standard (str) and conversational ([{"role": "assistant", "content":
    ...}]) prompts."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def task_reward(completions, target, **kwargs):
    """Embedded task: per-position partial credit, matches / max(len(completion), len(target)), in
    [0, 1].

    1.0 only for the exact target; extra or missing characters cost as much as wrong ones.
    """
    rewards = []
    for completion, want in zip(completions, target):
        got = _text(completion)
        rewards.append(sum(a == b for a, b in zip(got, want)) / max(len(got), len(want), 1))
    return rewards


def accuracy_reward(completions, solution, **kwargs):
    """1.0 if the completion's final answer equals `solution` (math-verify), else 0.0; None if the
    gold won't parse."""
    from math_verify import LatexExtractionConfig, LatexNormalizationConfig, parse, verify

    # math-verify's timeouts use signal.alarm, which only works on the main thread (reward fns may
    # run in threads)
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    answer_config = [LatexExtractionConfig(
        normalization_config=LatexNormalizationConfig(nits=False, malformed_operators=False,
                                                      basic_latex=True,
                                                 boxed="all", units=True),
        boxed_match_priority=0, try_extract_without_anchor=False)]
    rewards = []
    for completion, gold in zip(completions, solution):
        gold_parsed = parse(gold, extraction_mode="first_match", parsing_timeout=timeout)
        if not gold_parsed:
            rewards.append(None)
            continue
        answer = parse(_text(completion), extraction_config=answer_config,
                       extraction_mode="first_match",
                       parsing_timeout=timeout)
        rewards.append(float(verify(gold_parsed, answer, timeout_seconds=timeout)))
    return rewards


def last_number_reward(completions, solution, **kwargs):
    """1.0 if the last number in the completion equals `solution` (a number, or text holding one),
    else 0.0; None if the solution holds no number. For arithmetic answers in plain text, which
    accuracy_reward (LaTeX) does not read."""
    number = re.compile(r"-?\d+(?:\.\d+)?")
    rewards = []
    for completion, gold in zip(completions, solution):
        want, got = number.findall(str(gold)), number.findall(_text(completion).replace(",", ""))
        rewards.append(None if not want else float(bool(got) and float(got[-1]) == float(want[-1])))
    return rewards


def think_format_reward(completions, **kwargs):
    """1.0 if the completion is `<think>...</think>` followed by an answer, with exactly one think
    block."""
    pattern = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL)
    return [1.0 if pattern.match(_text(c)) else 0.0 for c in completions]


def soft_overlong_punishment(max_completion_len, soft_punish_cache):
    """DAPO's soft overlong penalty (Yu et al. 2025, eq. 13) as a reward function of completion
    length L: 0 if L <= max - cache;  (max - cache - L) / cache if max - cache < L <= max;  -1
    beyond.
    """
    def soft_overlong_punishment_reward(completion_ids, **kwargs):
        rewards = []
        for ids in completion_ids:
            length = len(ids)
            if length <= max_completion_len - soft_punish_cache:
                rewards.append(0.0)
            elif length <= max_completion_len:
                start = max_completion_len - soft_punish_cache
                rewards.append((start - length) / soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards
    return soft_overlong_punishment_reward


BUILTINS = {f.__name__: f for f in (task_reward, accuracy_reward, last_number_reward,
                                    think_format_reward)}


# ---------------------------------------------------------------------------------------------
# Loading by name (CLI) and calling
# ---------------------------------------------------------------------------------------------

def looks_like_model(spec):
    """A local directory, or a Hub id such as 'org/name' (no ':' and no '.py')."""
    hub_id = bool(re.fullmatch(r"[\w.-]+/[\w.-]+", spec)) and not spec.endswith(".py")
    return os.path.isdir(spec) or hub_id


def load_reward_func(spec, prepare_model=None, device="cpu", max_completion_length=None):
    """'accuracy_reward' (built-in) | 'pkg.module:fn' | 'path/to/file.py:fn' | 'path/to/package:fn'
    | a sequence-classification model (local directory or Hub id) -> callable. prepare_model
    places/shards a reward model like the reference model."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    # DAPO's cache: the last fifth of the budget (4096 of 20480)
    if spec == "soft_overlong_punishment":
        return soft_overlong_punishment(max_completion_length, max(1, max_completion_length // 5))
    if ":" in spec:
        source, name = spec.rsplit(":", 1)
        module = reward_module(source, spec)
        if not hasattr(module, name):
            raise ValueError(f"{source!r} has no function {name!r} (reward function {spec!r})"
                             f"{shadowed(module, source, name)}")
        if not callable(getattr(module, name)):
            raise ValueError(f"{source}:{name} is a {type(getattr(module, name)).__name__}, not a "
                             "function")
        return getattr(module, name)
    if looks_like_model(spec):
        return reward_model(spec, prepare_model or (lambda m: m.to(device)), device)
    raise ValueError(f"unknown reward function {spec!r}: use a built-in ({', '.join(BUILTINS)}, "
                     "soft_overlong_punishment), 'module:function', 'file.py:function', or the "
                     "path of a sequence-classification model")


def reward_module(source, spec):
    """The module of 'SOURCE:function': a .py file or a package directory, by path, else a module
    name on sys.path. A failure is a ValueError of one line."""
    if source.endswith(".py") or os.path.isdir(source):
        return module_from_path(source)
    try:
        return importlib.import_module(source)
    except BaseException as e:  # noqa: BLE001 (a failing import inside it, sys.exit)
        local = source.replace(".", os.sep) + ".py"
        hint = f"; to load the {local} here, pass {local}:FUNCTION" if os.path.isfile(local) else ""
        raise ValueError(f"cannot import module {source!r} for reward function {spec!r}: "
                         f"{user_error(e)}{hint}") from None


def shadowed(module, source, name):
    """Why a module lacks the function: it is one of rloo's own (data, config, ...), found before
    a file of the same name in the current directory."""
    local = source.replace(".", os.sep) + ".py"
    ours = os.path.dirname(os.path.abspath(getattr(module, "__file__", None) or "")) == PROJECT
    if not ours or not os.path.isfile(local):
        return ""
    return (f": {source!r} is rloo's own {os.path.basename(module.__file__)}, which shadows the "
            f"{local} here; pass {local}:{name} (a path) or rename the file")


PROJECT = os.path.dirname(os.path.abspath(__file__))
loaded_modules = itertools.count()  # a name of its own for each file or package loaded by path


def module_from_path(source):
    """A .py file, or a package directory through its __init__.py, imported under a name of its
    own and registered in sys.modules: a package's relative imports and a file's dataclasses need
    it, and no module of the same name (json.py, data.py) is replaced."""
    package = os.path.isdir(source)
    entry = os.path.join(source, "__init__.py") if package else source
    if not os.path.isfile(entry):
        raise ValueError(f"reward function directory {source!r} has no __init__.py: make it a "
                         "package, or give DIR/FILE.py:FUNCTION" if package
                         else f"reward function file {source!r} does not exist")
    stem = os.path.basename(os.path.normpath(source)).removesuffix(".py")
    name = f"rloo_reward_{next(loaded_modules)}_{stem}"
    try:
        return tools.exec_module_at(name, entry, source if package else None)
    except BaseException as e:  # noqa: BLE001 (a syntax error, a failing import, sys.exit)
        what = "package" if package else "file"
        message = f"cannot load reward function {what} {source!r}: {user_error(e)}"
        raise ValueError(message) from None


def reward_model(path, prepare_model, device):
    """A sequence-classification model as a reward function: prompt + completion (through the chat
    template for conversations), right-padded, no gradient, reward = logits[:, 0] at the last token.
    Named after the path."""
    try:  # its files, weights and pad id checked at start-up, not at the first batch it scores
        model, tokenizer = load_reward_model(path)
    except (OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"cannot load reward model {path!r}: {str(e).splitlines()[0]}") from None
    model = prepare_model(model)

    @torch.no_grad()
    def score(prompts, completions, **kwargs):
        texts = [tokenizer.apply_chat_template(p + c, tokenize=False) if isinstance(p, list)
                 else p + c
                 for p, c in zip(prompts, completions)]
        enc = tokenizer(texts, padding=True, return_tensors="pt",
                        add_special_tokens=False).to(device)
        return model(**enc).logits[:, 0].float().tolist()

    score.__name__ = os.path.basename(os.path.normpath(path))
    return score


def reward_name(func):
    """Metric name of a reward function: __name__, through functools.partial and callable
    objects."""
    while hasattr(func, "func"):  # functools.partial
        func = func.func
    return getattr(func, "__name__", None) or type(func).__name__


def _is_async(func):
    call = getattr(func, "__call__", None)
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(call)


FLOAT32_MAX = 3.4028234663852886e38  # rewards are trained on in float32: beyond this they are inf


class RewardError(ValueError):
    """A reward function failed or returned something unusable: one line naming it (the loop stops
    with it)."""


class Interrupted(BaseException):
    """Raised inside reward code by SIGTERM/SIGINT (checkpoint.watch_signals), so a call that never
    returns cannot keep the run from stopping. A BaseException: reward code's own `except Exception`
    does not swallow it."""


# True while reward code runs: a signal then stops it at once rather than waiting for the call to
# end
calling = [False]


def _validate(name, values, n):
    """list[float | None] of length n -> list[float] with NaN for None; anything else is a
    RewardError."""
    if inspect.isawaitable(values):  # a sync wrapper around an async function
        getattr(values, "close", lambda: None)()  # no "never awaited" warning after the line
        raise RewardError(f"reward function {name!r} returned a {type(values).__name__} without "
                          "awaiting it: declare it (or its __call__) `async def`, so the trainer "
                          "awaits it")
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not hasattr(values, "__len__") or isinstance(values, (str, dict)) or len(values) != n:
        sized = hasattr(values, "__len__") and not isinstance(values, (str, dict))
        got = f"length {len(values)}" if sized else type(values).__name__
        raise RewardError(f"reward function {name!r} must return a list of {n} floats (one per "
                          f"completion), got {got}")
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
        elif isinstance(v, numbers.Real) and abs(v) <= FLOAT32_MAX:  # bools: True is 1.0, as TRL
            out.append(float(v))
        else:
            numeric = isinstance(v, numbers.Real)
            problem = ("a value that is not finite in float32" if numeric
                       else f"a {type(v).__name__}")
            raise RewardError(f"reward function {name!r} returned {problem} ({v!r}) for completion "
                              f"{i}; return a finite float, or None when the function does not "
                              "apply")
    return out


def user_frames(error):
    """The frames of a traceback outside this file, Python's own library and installed packages: the
    user's code."""
    library = tuple(sysconfig.get_paths()[key] for key in ("stdlib", "purelib", "platlib"))
    return [f for f in traceback.extract_tb(error.__traceback__)
            if f.filename != __file__ and not f.filename.startswith(("<", *library))]


def user_error(error):
    """An exception from user code as one line: its type, message and the user's own innermost
    frame."""
    if isinstance(error, SystemExit):
        return f"it called sys.exit({error.code!r})"
    frames = user_frames(error)
    where = f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
    if isinstance(error, SyntaxError):
        return f"SyntaxError: {error.msg} ({error.filename}, line {error.lineno})"
    return f"{type(error).__name__}: {error}{where}"


def print_user_traceback(error):
    """The traceback of the user's own code, without the frames of this file that called it."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename != __file__]
    lines = traceback.format_list(frames) + traceback.format_exception_only(error)
    print("Traceback of the reward function (most recent call last):\n" + "".join(lines), end="",
          file=sys.stderr)


class RewardTimeout(Exception):
    """A reward function that did not return in time (told apart from a TimeoutError of its own)."""


def run_with_timeout(call, timeout):
    """call() in this thread, or with a timeout in a daemon thread (tools.in_thread)."""
    if timeout is None:
        return call()
    outcome = tools.in_thread(call, timeout)
    if not outcome:
        raise RewardTimeout(f"did not return within --reward_timeout {timeout:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


# With no --reward_timeout an async reward function (a judge model behind an API) is stopped after
# this many seconds, room for a slow judge. A sync one has no limit: timing it would run it in a
# thread, and that switches off math-verify's own timeout in accuracy_reward (main thread only).
ASYNC_TIMEOUT = 600.0
# A reward function still running after SLOW_AFTER s is named on stderr, then every SLOW_EVERY s
SLOW_AFTER = SLOW_EVERY = 60.0


@contextlib.contextmanager
def warn_while_slow(running, at, limit):
    """While the block runs: after SLOW_AFTER s, and every SLOW_EVERY s after that, one line on
    stderr naming the reward functions still running (running() -> names), so that a slow one is
    seen for what it is rather than taken for a hang. limit: what stops it, in words."""
    done, start = threading.Event(), time.monotonic()
    where = f" on rank {distributed.rank()}" if distributed.world_size() > 1 else ""

    def watch():
        wait = SLOW_AFTER
        while not done.wait(wait) and running():
            print(f"rloo: WARNING: reward function {', '.join(map(repr, running()))} still "
                  f"running{at}{where} after {time.monotonic() - start:.0f} s ({limit})",
                  file=sys.stderr, flush=True)
            wait = SLOW_EVERY

    threading.Thread(target=watch, daemon=True, name="rloo-reward-watch").start()
    try:
        yield
    finally:
        done.set()


def time_limit(timeout, is_async):
    """What stops a reward function, in words (the slow warning's)."""
    if timeout is not None:
        return f"--reward_timeout {timeout:g} s stops it"
    if is_async:
        return (f"stopped at {ASYNC_TIMEOUT:g} s, the default for async reward functions; "
                "--reward_timeout sets another")
    return "no time limit for a sync reward function; --reward_timeout sets one"


SCALARS = frozenset((str, int, float, bool, type(None)))


def own_copy(value):
    """value with its lists, tuples and dicts copied afresh, what they hold at the bottom (strings,
    numbers, images) shared: what a reward function does to its arguments in place stays in its
    copy, unseen by the functions after it and by the logged completions."""
    if type(value) is list:
        if set(map(type, value)) <= SCALARS:  # token ids, texts: one C-level copy
            return value.copy()
        return [own_copy(v) for v in value]
    if type(value) is tuple:
        return tuple(own_copy(v) for v in value)
    if type(value) is dict:
        return {k: own_copy(v) for k, v in value.items()}
    if isinstance(value, TrainerState):
        return copy.deepcopy(value)
    return value


def reward_arguments(prompts, completions, completion_ids, columns, extra):
    """Every reward function's keyword arguments: the batch's, the row columns', the trainer's
    (extra). A column named like another argument is one line (data.check_columns stops it at
    start-up; a stream's later row can still bring one)."""
    given = dict(prompts=prompts, completions=completions, completion_ids=completion_ids)
    clash = sorted(set(columns) & (set(given) | set(extra)))
    if clash:
        raise RewardError(f"the batch has a column {clash[0]!r}, which is also the name of an "
                          "argument the trainer passes reward functions; rename the column")
    return {**given, **columns, **extra}


def guarded(name, at, call):
    """call(), reward code: a failure, even a SystemExit, is a RewardError naming the function,
    after the function's own traceback; a timeout or a signal while it runs is one too."""
    calling[0] = True
    try:
        return call()
    except Interrupted as e:
        raise RewardError(f"{e} while reward function {name!r} was running{at}, which did not "
                          "return within 10 s of it: stopped") from None
    except RewardTimeout as e:
        raise RewardError(f"reward function {name!r}{at} {e}") from None
    except BaseException as e:  # noqa: BLE001 (user code: SystemExit and KeyboardInterrupt too)
        print_user_traceback(e)
        raise RewardError(f"reward function {name!r} raised{at}: {user_error(e)}") from e
    finally:
        calling[0] = False


def compute_rewards(funcs, prompts, completions, completion_ids, columns, timeout=None,
                    names=None, **extra):
    """Call every reward function on the B completions -> [B, K] float tensor, NaN where a function
    returned None.

    Each function gets its own copy of the arguments (own_copy). Sync functions run one after
    another in this thread, within `timeout` seconds when one is given (then in a thread); async
    ones run concurrently on one event loop (run_async). A function still running after
    SLOW_AFTER s is named on stderr. names: the functions' metric names (default reward_name).
    """
    kwargs = reward_arguments(prompts, completions, completion_ids, columns, extra)
    names = names or [reward_name(f) for f in funcs]
    at = f" at step {extra['step']}" if "step" in extra else ""
    outputs = {}
    for k, f in enumerate(funcs):
        if _is_async(f):
            continue
        call = functools.partial(f, **own_copy(kwargs))
        with warn_while_slow(lambda k=k: [names[k]], at, time_limit(timeout, False)):
            outputs[k] = guarded(names[k], at, lambda: run_with_timeout(call, timeout))
    async_ids = [k for k, f in enumerate(funcs) if _is_async(f)]
    if async_ids:
        outputs.update(run_async(funcs, names, async_ids, kwargs, timeout, at))
    columns_out = [_validate(names[k], outputs[k], len(completions)) for k in range(len(funcs))]
    # [B, K]
    return torch.tensor(columns_out, dtype=torch.float32).T.reshape(len(completions), len(funcs))


def run_async(funcs, names, ids, kwargs, timeout, at):
    """funcs[ids], async, concurrently on one event loop (asyncio.gather), so their latencies
    overlap; each within `timeout` s, or ASYNC_TIMEOUT when none is given -> {k: output}."""
    limit = ASYNC_TIMEOUT if timeout is None else timeout
    why = (f"--reward_timeout {timeout:g} s" if timeout is not None else
           f"{ASYNC_TIMEOUT:g} s, the default for async reward functions (--reward_timeout)")
    pending = set(ids)

    async def bounded(k, arguments):
        try:
            task = asyncio.ensure_future(funcs[k](**arguments))
            done, _ = await asyncio.wait({task}, timeout=limit)
        finally:
            pending.discard(k)
        if not done:
            task.cancel()
            raise RewardTimeout(f"did not return within {why}")
        return task.result()

    async def gather():
        calls = [bounded(k, own_copy(kwargs)) for k in ids]
        return await asyncio.gather(*calls, return_exceptions=True)

    with warn_while_slow(lambda: [names[k] for k in ids if k in pending], at,
                         time_limit(timeout, True)):
        results = guarded(", ".join(names[k] for k in ids), at, lambda: asyncio.run(gather()))
    return {k: guarded(names[k], at, lambda r=result: raise_if_error(r))
            for k, result in zip(ids, results)}


def raise_if_error(result):
    if isinstance(result, BaseException):
        raise result
    return result


# The completions table's own columns (metrics.completions_table): a reward function or a
# log_extra column of one of these names would be a second column of that name
TABLE_COLUMNS = ("step", "prompt", "completion", "advantage", "image")
# The trainer's own metric names and groups (metrics.py, train.py, batches.py): a log_metric of
# one of them, or of evaluation's eval_..., would overwrite it or pose as it
TRAINER_METRICS = ("step", "epoch", "reward", "reward_std", "frac_reward_zero_std", "kl",
                   "entropy", "loss", "grad_norm", "learning_rate", "num_tokens", "step_time",
                   "aux_loss", "nonfinite_skipped")
TRAINER_GROUPS = ("rewards", "completions", "clip_ratio", "sampling", "dynamic_sampling", "time",
                  "tokens_per_second", "turns", "tools", "environment")


def trainer_metric(name):
    """Whether a metric name is the trainer's: one it logs, one of its groups, or evaluation's."""
    group, slash, _ = name.partition("/")
    in_group = bool(slash) and group in TRAINER_GROUPS
    return name in TRAINER_METRICS or in_group or name.startswith("eval_")


def unique_names(funcs, specs=None):
    """The functions' metric names (reward_name), each made distinct from those before it and from
    the table's columns by a suffix, with a warning: a second `score` logs as rewards/score_1/mean
    rather than overwrite the first's rewards/score/mean. specs: --reward_funcs, to name them."""
    def label(i):
        return f"reward function {i + 1} ({specs[i] if specs else reward_name(funcs[i])})"

    names = []
    for k, func in enumerate(funcs):
        name = unique = reward_name(func)
        suffix = 0
        while unique in names or unique in TABLE_COLUMNS:
            suffix += 1
            unique = f"{name}_{suffix}"
        if unique != name and distributed.is_main():
            same = (f"as is {label(names.index(name))}" if name in names
                    else "a column of the completions table")
            print(f"rloo: WARNING: {label(k)} is named {name!r}, {same}: it logs as "
                  f"rewards/{unique}/mean and rewards/{unique}/std", file=sys.stderr)
        names.append(unique)
    return names


class RewardFunctions:
    """The run's reward functions, loaded once (--reward_funcs): each callable, its metric name, its
    weight w_k of R = sum_k w_k R_k (--reward_weights, or 1.0 each) and the time it may take.
    max_steps and steps_per_epoch (optimizer steps; None for a stream) fill trainer_state."""

    def __init__(self, funcs, weights=None, timeout=None, cfg=None):
        self.funcs, self.timeout, self.cfg = funcs, timeout, cfg
        specs = cfg and cfg.reward_funcs
        self.names = unique_names(funcs, specs if specs and len(specs) == len(funcs) else None)
        self.weights = torch.tensor(weights or [1.0] * len(funcs))  # [K]
        self.max_steps, self.steps_per_epoch = 0, None

    def trainer_state(self, step):
        """TRL's trainer_state argument: the fields of transformers.TrainerState a run has."""
        epoch = step / self.steps_per_epoch if self.steps_per_epoch else None
        cfg = self.cfg
        return TrainerState(
            global_step=step, max_steps=self.max_steps, epoch=epoch,
            num_train_epochs=cfg and cfg.num_train_epochs, logging_steps=cfg and cfg.logging_steps,
            eval_steps=cfg and cfg.eval_steps, save_steps=cfg and cfg.save_steps,
            train_batch_size=cfg and cfg.per_device_train_batch_size,
            is_local_process_zero=distributed.local_rank() == 0,
            is_world_process_zero=distributed.is_main())

    def __call__(self, rollout, G, step):
        """The functions on a Rollout's B = P*G completions: each prompt and dataset column repeated
        G times; conversational prompts get [{"role": "assistant", "content": text}] completions.
        What they log goes to rollout.logged_columns and rollout.logged_metrics. -> [B, K], NaN
        where a function returned None. A failure stops the run with one line."""
        prompts = repeat_each(rollout.rows["prompt"], G)
        completions = [[{"role": "assistant", "content": t}] if is_conversational(p) else t
                       for p, t in zip(prompts, rollout.texts)]
        if rollout.turns is not None:  # multi-turn: the conversation after the prompt
            completions = rollout.turns
        columns = {c: repeat_each(v, G) for c, v in rollout.rows.items() if c != "prompt"}
        log = RewardLog(rollout, len(completions), self.names)
        try:
            rewards = compute_rewards(self.funcs, prompts, completions, rollout.completion_lists,
                                      columns, self.timeout, self.names, step=step,
                                      trainer_state=self.trainer_state(step),
                                      log_extra=log.log_extra, log_metric=log.log_metric)
        except RewardError as e:
            fail(f"{e}. Checkpoints already written are intact")
        rollout.logged_columns.update(log.columns)
        return rewards.to(rollout.completion_mask.device)


class RewardLog:
    """What reward functions log on one batch, TRL's log_extra(column, values) (columns of the
    completions table) and log_metric(name, value) (into rollout.logged_metrics), checked as user
    code calls them: a table column's name or a trainer metric's, a count other than B, a value
    that is not a number is a ValueError, which the calling function's one line names."""

    def __init__(self, rollout, B, reward_names):
        self.rollout, self.B, self.reward_names = rollout, B, reward_names
        self.columns = {}  # column -> values, one per completion

    def log_extra(self, column, values):
        column, values = str(column), list(values)
        if column in TABLE_COLUMNS or column in self.reward_names:
            raise ValueError(f"log_extra({column!r}, ...): the completions table has a column "
                             f"{column!r} of its own; choose another name")
        if len(values) != self.B:
            raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values for {self.B} "
                             "completions: give one per completion")
        self.columns[column] = values

    def log_metric(self, name, value):
        name = str(name)
        if trainer_metric(name):
            raise ValueError(f"log_metric({name!r}, ...): {name!r} is the trainer's own metric "
                             "name (or in its eval_, rewards/, time/... groups); choose another")
        try:
            value = float(value)  # a number, or a tensor of one
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"log_metric({name!r}, {str(value)[:40]!r}): the value must be a "
                             "number") from None
        self.rollout.logged_metrics.setdefault(name, []).append(value)


def load_rewards(cfg, device):
    """--reward_funcs -> RewardFunctions; reward models are placed and sharded like the reference
    model. A function that does not load is one line naming it."""
    funcs = []
    for spec in cfg.reward_funcs:
        try:
            place = lambda m: prepare_model(m, cfg, False, device)  # noqa: E731
            funcs.append(load_reward_func(spec, place, device, cfg.max_completion_length))
        except ValueError as e:
            fail(str(e))
    return RewardFunctions(funcs, cfg.reward_weights, cfg.reward_timeout, cfg)
