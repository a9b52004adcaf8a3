"""Reward functions: the calling convention, loading by name, validation, and the built-in rewards.

Interface (same as TRL's GRPOTrainer/RLOOTrainer; README 'Writing a reward function'): a reward
function is called as
    f(prompts=[...], completions=[...], completion_ids=[...], **dataset_columns, step=...,
      trainer_state=..., log_extra=..., log_metric=...)
with one entry per completion (each prompt repeated G times) and returns a list of float | None of
the same length. None means "does not apply to this completion". `async def` functions run
concurrently. As in TRL, trainer_state is a transformers.TrainerState (global_step, max_steps,
epoch, ...), log_extra(column, values) adds a column of one value per completion to the
completions table, and log_metric(name, value) logs a scalar: the mean over the step's calls on
all ranks.
"""

import asyncio
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import sys
import sysconfig
import threading
import traceback

import torch
from transformers import TrainerState

import distributed
import tools
from config import fail
from models import prepare_model
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
    """'accuracy_reward' (built-in) | 'pkg.module:fn' | 'path/to/file.py:fn' | a
    sequence-classification model (local directory or Hub id) -> callable. prepare_model
    places/shards a reward model like the reference model."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    # DAPO's cache: the last fifth of the budget (4096 of 20480)
    if spec == "soft_overlong_punishment":
        return soft_overlong_punishment(max_completion_length, max(1, max_completion_length // 5))
    if ":" in spec:
        source, name = spec.rsplit(":", 1)
        if source.endswith(".py"):
            if not os.path.isfile(source):
                raise ValueError(f"reward function file {source!r} does not exist")
            module_spec = importlib.util.spec_from_file_location(os.path.basename(source)[:-3],
                                                                 source)
            module = importlib.util.module_from_spec(module_spec)
            try:
                module_spec.loader.exec_module(module)
            except BaseException as e:  # noqa: BLE001 (a syntax error, a failing import, sys.exit)
                message = f"cannot load reward function file {source!r}: {user_error(e)}"
                raise ValueError(message) from None
        else:
            try:
                module = importlib.import_module(source)
            except BaseException as e:  # noqa: BLE001
                raise ValueError(f"cannot import module {source!r} for reward function {spec!r}: "
                                 f"{user_error(e)}") from None
        if not hasattr(module, name):
            raise ValueError(f"{source!r} has no function {name!r} (reward function {spec!r})")
        if not callable(getattr(module, name)):
            raise ValueError(f"{source}:{name} is a {type(getattr(module, name)).__name__}, not a "
                             "function")
        return getattr(module, name)
    if looks_like_model(spec):
        return reward_model(spec, prepare_model or (lambda m: m.to(device)), device)
    raise ValueError(f"unknown reward function {spec!r}: use a built-in ({', '.join(BUILTINS)}, "
                     "soft_overlong_punishment), 'module:function', 'file.py:function', or the "
                     "path of a sequence-classification model")


def reward_model(path, prepare_model, device):
    """A sequence-classification model as a reward function: prompt + completion (through the chat
    template for conversations), right-padded, no gradient, reward = logits[:, 0] at the last token.
    Named after the path."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    try:
        architectures = AutoConfig.from_pretrained(path).architectures or []
        if not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise ValueError(f"it is a {', '.join(architectures) or 'model'} with no "
                             "sequence-classification head (one would be initialised at random); "
                             "pass a reward model")
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load reward model {path!r}: {str(e).splitlines()[0]}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    model.config.pad_token_id = tokenizer.pad_token_id  # the model scores the last non-pad token
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
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not hasattr(values, "__len__") or isinstance(values, (str, dict)) or len(values) != n:
        got = f"length {len(values)}" if hasattr(values, "__len__") else type(values).__name__
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


def run_with_timeout(call, timeout):
    """call() in this thread, or with a timeout in a daemon thread (tools.in_thread)."""
    if timeout is None:
        return call()
    outcome = tools.in_thread(call, timeout)
    if not outcome:
        raise TimeoutError(f"did not return within --reward_timeout {timeout:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def compute_rewards(funcs, prompts, completions, completion_ids, columns, timeout=None, **extra):
    """Call every reward function on the B completions -> [B, K] float tensor, NaN where a function
    returned None.

    Sync functions run one after another; async ones run concurrently on one event loop
    (asyncio.gather). Each is bounded by `timeout` seconds (None: unbounded). Any failure, even a
    SystemExit, is a RewardError naming the function, after the function's own traceback; a signal
    while one runs is one too.
    """
    kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids,
                  **columns, **extra)
    names = [reward_name(f) for f in funcs]
    at = f" at step {extra['step']}" if "step" in extra else ""

    def guarded(name, call):
        calling[0] = True
        try:
            return call()
        except Interrupted as e:
            raise RewardError(f"{e} while reward function {name!r} was running{at}, which did not "
                              "return within 10 s of it: stopped") from None
        except (TimeoutError, asyncio.TimeoutError) as e:
            raise RewardError(f"reward function {name!r}{at} {e or 'timed out'}") from None
        except BaseException as e:  # noqa: BLE001 (user code: SystemExit and KeyboardInterrupt too)
            print_user_traceback(e)
            raise RewardError(f"reward function {name!r} raised{at}: {user_error(e)}") from e
        finally:
            calling[0] = False

    outputs = {k: guarded(names[k], lambda f=f: run_with_timeout(lambda: f(**kwargs), timeout))
               for k, f in enumerate(funcs) if not _is_async(f)}
    async_ids = [k for k, f in enumerate(funcs) if _is_async(f)]
    if async_ids:
        async def bounded(k):
            try:
                return await asyncio.wait_for(funcs[k](**kwargs), timeout)
            except (TimeoutError, asyncio.TimeoutError):
                message = f"did not return within --reward_timeout {timeout:g} s"
                raise TimeoutError(message) from None

        async def gather():
            return await asyncio.gather(*(bounded(k) for k in async_ids), return_exceptions=True)

        results = guarded(", ".join(names[k] for k in async_ids), lambda: asyncio.run(gather()))
        for k, result in zip(async_ids, results):
            outputs[k] = guarded(names[k], lambda r=result: raise_if_error(r))
    columns_out = [_validate(names[k], outputs[k], len(completions)) for k in range(len(funcs))]
    # [B, K]
    return torch.tensor(columns_out, dtype=torch.float32).T.reshape(len(completions), len(funcs))


def raise_if_error(result):
    if isinstance(result, BaseException):
        raise result
    return result


class RewardFunctions:
    """The run's reward functions, loaded once (--reward_funcs): each callable, its metric name, its
    weight w_k of R = sum_k w_k R_k (--reward_weights, or 1.0 each) and the time it may take.
    max_steps and steps_per_epoch (optimizer steps; None for a stream) fill trainer_state."""

    def __init__(self, funcs, weights=None, timeout=None, cfg=None):
        self.funcs, self.timeout, self.cfg = funcs, timeout, cfg
        self.names = [reward_name(f) for f in funcs]
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
        logged = {}  # column -> values, one per completion

        def log_extra(column, values):
            values = list(values)
            if len(values) != len(completions):
                raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values for "
                                 f"{len(completions)} completions: give one per completion")
            logged[str(column)] = values

        def log_metric(name, value):
            value = float(value)  # a tensor or number; TypeError/ValueError name the function
            rollout.logged_metrics.setdefault(str(name), []).append(value)

        try:
            rewards = compute_rewards(self.funcs, prompts, completions, rollout.completion_lists,
                                      columns, self.timeout, step=step,
                                      trainer_state=self.trainer_state(step),
                                      log_extra=log_extra, log_metric=log_metric)
        except RewardError as e:
            fail(f"{e}. Checkpoints already written are intact")
        rollout.logged_columns.update(logged)
        return rewards.to(rollout.completion_mask.device)


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
