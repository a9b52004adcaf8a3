"""The user's own files, loaded by path: --reward_funcs FILE.py:fn (or a package directory),
--environment FILE.py:NAME and --tools FILE.py:fn. A file is executed once per run, whatever number
of flags name it, as one module (rloo_user_<n>_<stem>): a class, a judge model, a cache or a counter
at its top level is one object for all of them, as when a TRL user passes the objects themselves.
Its folder is on sys.path for the run, as for a script, so it imports the helpers beside it. The
run's modules leave sys.modules when it ends (forget), so the next run in the process reads the
files again.

The trainer owns the process while it runs, and user code (a grader that changes directory, a
reward-model wrapper that turns autograd off, a sandbox client's SIGTERM handler) runs inside it:
taken_back reads what such code may change before each call and sets it back after, saying once
which function changed what; the threads it leaves running are named at the end (STARTED).
"""

import contextlib
import importlib.util
import itertools
import os
import signal
import sys
import threading
import traceback

import torch

LOADED = {}  # resolved path -> its module, for this run
FOLDERS = []  # the folders of the user's files this run put on sys.path
numbers = itertools.count()  # a module name of its own for each file

# What user code may change under the trainer: (what, read, set back, process-wide). Grad mode is
# per thread (the caller's); a signal handler can be read anywhere but set only in the main thread.
STATE = (
    ("the working directory", os.getcwd, os.chdir, True),
    ("autograd (torch.set_grad_enabled)", torch.is_grad_enabled, torch.set_grad_enabled, False),
    ("torch's default dtype", torch.get_default_dtype, torch.set_default_dtype, True),
    ("torch's default device", torch.get_default_device, torch.set_default_device, True),
    ("deterministic algorithms", torch.are_deterministic_algorithms_enabled,
     torch.use_deterministic_algorithms, True),
    ("anomaly detection", torch.is_anomaly_enabled, torch.autograd.set_detect_anomaly, True),
    ("the SIGTERM handler", lambda: signal.getsignal(signal.SIGTERM),
     lambda handler: signal.signal(signal.SIGTERM, handler), "main"),
    ("the SIGINT handler", lambda: signal.getsignal(signal.SIGINT),
     lambda handler: signal.signal(signal.SIGINT, handler), "main"),
)
SAID = set()  # (who, what) already warned of, this run
STARTED = {}  # a non-daemon thread user code started -> who started it


@contextlib.contextmanager
def taken_back(who):
    """Around one call of user code (`who`: "reward function 'f'"): what it changed of STATE set
    back, each (who, what) said once on stderr; a non-daemon thread it started noted (STARTED),
    since the interpreter would wait for it at exit."""
    here = threading.current_thread()
    kept = [(what, read, put, read()) for what, read, put, shared in STATE
            if shared is True or here is threading.main_thread() or not shared]
    threads = set(threading.enumerate())
    try:
        yield
    finally:
        for what, read, put, was in kept:
            now = read()
            if now != was:
                put(was)
                say(who, what, f"{shown(was)} -> {shown(now)}; set back, as after every call")
        for thread in set(threading.enumerate()) - threads:
            if not thread.daemon and thread not in STARTED:
                STARTED[thread] = who
                say(who, f"thread {thread.name!r}", "started, not a daemon: the run does not wait "
                    "for it at its end")


def say(who, what, how):
    if (who, what) not in SAID:
        SAID.add((who, what))
        print(f"rloo: WARNING: {who} changed {what} ({how})", file=sys.stderr, flush=True)


def shown(value):
    """A state's value in a line: a signal handler by its function's name."""
    return getattr(value, "__qualname__", None) or repr(value)


def load(source, what):
    """The module of a .py file, or of a package directory through its __init__.py (its relative
    imports work); the same module for every mention of the same file. -> module; a ValueError of
    one line, naming the file and the line of it that raised, when it does not exist or its import
    fails."""
    path = os.path.realpath(source)
    if path in LOADED:
        return LOADED[path]
    package = os.path.isdir(path)
    entry = os.path.join(path, "__init__.py") if package else path
    if not os.path.isfile(entry):
        raise ValueError(f"{what} directory {source!r} has no __init__.py: make it a package, or "
                         "give DIR/FILE.py:FUNCTION" if package else
                         f"{what} file {source!r} does not exist")
    name = f"rloo_user_{next(numbers)}_{os.path.basename(path).removesuffix('.py')}"
    spec = importlib.util.spec_from_file_location(
        name, entry, submodule_search_locations=[path] if package else None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    folder = os.path.dirname(path)  # its helpers import as when it runs as a script
    if folder not in sys.path:
        sys.path.insert(0, folder)
        FOLDERS.append(folder)
    try:
        with taken_back(f"{what} {'package' if package else 'file'} {source!r}"):
            spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 (a syntax error, a failing import, sys.exit)
        del sys.modules[name]
        kind = "package" if package else "file"
        raise ValueError(f"cannot load {what} {kind} {source!r}: {import_error(e, entry)}") \
            from None
    LOADED[path] = module
    return module


def forget():
    """The end of a run: its modules leave sys.modules (a package's submodules too, and the helpers
    imported from the folders it put on sys.path, which leave it too)."""
    names = {module.__name__ for module in LOADED.values()}
    folders = tuple(os.path.join(folder, "") for folder in FOLDERS)
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None) or ""
        if name.split(".")[0] in names or folders and os.path.abspath(file).startswith(folders):
            del sys.modules[name]
    for folder in FOLDERS:
        if folder in sys.path:
            sys.path.remove(folder)
    FOLDERS.clear()
    LOADED.clear()
    SAID.clear()


def import_error(error, entry):
    """What went wrong importing `entry`, in one line with the line of it that raised."""
    if isinstance(error, SystemExit):
        return f"it called sys.exit({error.code!r})"
    if isinstance(error, SyntaxError):
        return f"SyntaxError: {error.msg} ({error.filename}, line {error.lineno})"
    path = os.path.realpath(entry)
    lines = [f.lineno for f in traceback.extract_tb(error.__traceback__)
             if os.path.realpath(f.filename) == path]
    where = f" ({entry}, line {lines[-1]})" if lines else ""
    return f"{type(error).__name__}: {error}{where}"
