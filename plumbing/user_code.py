"""The user's own files, loaded by path: --reward_funcs FILE.py:fn (or a package directory),
--environment FILE.py:NAME and --tools FILE.py:fn. A file is executed once per run, whatever number
of flags name it, as one module (rloo_user_<n>_<stem>): a class, a judge model, a cache or a counter
at its top level is one object for all of them, as when a TRL user passes the objects themselves.
The run's modules leave sys.modules when it ends (forget), so the next run in the process reads the
files again.
"""

import importlib.util
import itertools
import os
import sys
import traceback

LOADED = {}  # resolved path -> its module, for this run
numbers = itertools.count()  # a module name of its own for each file


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
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 (a syntax error, a failing import, sys.exit)
        del sys.modules[name]
        kind = "package" if package else "file"
        raise ValueError(f"cannot load {what} {kind} {source!r}: {import_error(e, entry)}") \
            from None
    LOADED[path] = module
    return module


def forget():
    """The end of a run: its modules leave sys.modules (a package's submodules too)."""
    names = {module.__name__ for module in LOADED.values()}
    for name in [n for n in sys.modules if n.split(".")[0] in names]:
        del sys.modules[name]
    LOADED.clear()


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
