"""Calling reward functions, user code: the calling convention (docs/rewards.md 'Writing a reward
function'), each function on its own copy of the arguments, async ones concurrently, timeouts and a
signal that stops a call that never returns, and the one line that names a function that failed or
returned something unusable. rewards.py loads the functions and weighs what comes back.
"""

import asyncio
import contextlib
import copy
import functools
import inspect
import math
import numbers
import os
import sys
import sysconfig
import threading
import time
import traceback

import torch
from transformers import TrainerState

from options import tools
from plumbing import distributed, user_code


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
    if isinstance(values, torch.Tensor) or type(values).__module__ == "numpy":
        values = values.tolist()  # a 0-d one becomes a number: refused below, by its kind
    if not hasattr(values, "__len__") or isinstance(values, (str, dict)) or len(values) != n:
        sized = hasattr(values, "__len__") and not isinstance(values, (str, dict))
        got = f"length {len(values)}" if sized else type(values).__name__
        raise RewardError(f"reward function {name!r} must return a list of {n} floats (one per "
                          f"completion), got {got}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor) and v.dim() == 0 or type(v).__module__ == "numpy" and \
                getattr(v, "ndim", None) == 0:
            v = v.item()  # a 0-d tensor or array per completion, as TRL's torch.tensor(list) takes
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


# the files that call user code (rewards.py loads it, this file runs it): not the user's frames
CALLERS = (os.path.abspath(__file__),
           os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rewards.py"))


def user_frames(error):
    """The frames of a traceback outside CALLERS, Python's own library and installed packages: the
    user's code."""
    library = tuple(sysconfig.get_paths()[key] for key in ("stdlib", "purelib", "platlib"))
    return [f for f in traceback.extract_tb(error.__traceback__)
            if os.path.abspath(f.filename) not in CALLERS
            and not f.filename.startswith(("<", *library))]


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
    """The traceback of the user's own code, without the frames of CALLERS that called it."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if os.path.abspath(f.filename) not in CALLERS]
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
    seen for what it is rather than taken for a hang. limit: what stops it, in words. One thread
    watches every call of a run (watch): a thread started per call cost a step milliseconds."""
    where = f" on rank {distributed.rank()}" if distributed.world_size() > 1 else ""
    now = time.monotonic()
    call = {"running": running, "at": at + where, "limit": limit, "start": now,
            "due": now + SLOW_AFTER}
    with WATCH:
        WATCHED[id(call)] = call
        if WATCHER[0] is None:
            WATCHER[0] = threading.Thread(target=watch, daemon=True, name="rloo-reward-watch")
            WATCHER[0].start()
        WATCH.notify()
    try:
        yield
    finally:
        with WATCH:
            del WATCHED[id(call)]


WATCH = threading.Condition()  # guards WATCHED and WATCHER; the watcher sleeps on it
WATCHED = {}  # the calls running now: id -> {running, at, limit, start, due (next warning)}
WATCHER = [None]  # the thread that warns, started by a run's first call (process.borrowed ends it)


def watch():
    """The watcher: asleep until the next call's warning is due, or a call starts."""
    with WATCH:
        while WATCHER[0] is threading.current_thread():
            now = time.monotonic()
            for call in WATCHED.values():
                if call["due"] <= now:
                    names = call["running"]()
                    if names:
                        print(f"rloo: WARNING: reward function {', '.join(map(repr, names))} "
                              f"still running{call['at']} after {now - call['start']:.0f} s "
                              f"({call['limit']})", file=sys.stderr, flush=True)
                    call["due"] = now + SLOW_EVERY
            dues = [call["due"] for call in WATCHED.values()]
            WATCH.wait(min(dues) - now if dues else None)


def stop_watching():
    """End the watcher (process.borrowed, as a run ends); a later call starts another."""
    with WATCH:
        thread, WATCHER[0] = WATCHER[0], None
        WATCH.notify()
    if thread is not None:
        thread.join()


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
        with user_code.taken_back(f"reward function {name!r}"):
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
