"""What a run borrows from its process, and gives back however it ends: train.main can be called
again and again in one process (a notebook, a sweep; README 'Sweeps'), each run as from a fresh
one, and the caller finds the process as it was.

Borrowed: the SIGTERM and SIGINT handlers (checkpoint.watch_signals; a run in another thread than
the main one has none, Python allows them only there), sys.excepthook (which torch.distributed
wraps), threading.excepthook (plumbing/logs.py's, for tensorboard's writer thread), sys.stdout
(Stdout), torch's CPU threads (distributed.set_cpu_threads), torch's modes (FRESH: a caller's
no_grad, inference_mode, autocast, float64 default dtype, deterministic algorithms or lower fp32
matmul precision on the backends the run multiplies on are set aside for the run, which works as
in a fresh process), the random generators (the run seeds torch's; a
caller's sweep draws on from where it was), the process group when the run made it, environment
variables (a colocated vLLM engine's), warnings filters and logger levels, the attention
implementations packed models stand in front of (packing.BASE), the user's modules (user_code), the
paths said (stack.PATHS), and the run's own threads: tqdm's monitor, the generation thread and the
loggers (main registers those two here), the slow reward call's watcher. One run at a time
(RUNNING).
"""

import atexit
import contextlib
import gc
import logging
import os
import random
import signal
import sys
import threading
import traceback
import warnings

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from options import packing
from plumbing import distributed, stack, user_code
from step import reward_calls
from plumbing.config import fail

SIGNALS = (signal.SIGTERM, signal.SIGINT)

# The fp32 matmul backends a run multiplies on: oneDNN's (the CPU), and cuBLAS's where CUDA is. Each
# is set to IEEE fp32 through its own setting, which a caller's new-API settings do not make raise
# (the legacy getter does), and the backends the run does not use (cuDNN's) keep the caller's.
MATMUL_BACKENDS = (torch.backends.mkldnn.matmul,) + (
    (torch.backends.cuda.matmul,) if torch.cuda.is_available() else ())


def set_matmul_precisions(precisions):
    for backend, precision in zip(MATMUL_BACKENDS, precisions):
        backend.fp32_precision = precision


# torch's process-wide modes as a fresh process has them, which a run works under: (read, set,
# fresh). Grad and inference mode are per thread, entered as contexts in borrowed.
FRESH = ((torch.get_default_dtype, torch.set_default_dtype, torch.float32),
         (lambda: (torch.are_deterministic_algorithms_enabled(),
                   torch.is_deterministic_algorithms_warn_only_enabled()),
          lambda mode: torch.use_deterministic_algorithms(mode[0], warn_only=mode[1]),
          (False, False)),
         (torch.is_anomaly_enabled, torch.autograd.set_detect_anomaly, False),
         (lambda: [backend.fp32_precision for backend in MATMUL_BACKENDS], set_matmul_precisions,
          ["ieee"] * len(MATMUL_BACKENDS)))


RUNNING = threading.Lock()  # held by the run in progress


def in_main_thread():
    """Whether this is the main thread, the only one where Python lets a run set signal handlers."""
    return threading.current_thread() is threading.main_thread()


def random_states():
    """The random generators a run seeds or draws from: (torch's CPU one, the GPUs' where CUDA
    started, Python's, numpy's)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()


def set_random_states(states):
    cpu, cuda, python, numpy = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(python)
    np.random.set_state(numpy)


class Stdout:
    """sys.stdout for a run: when its reader goes (`| head` done, a `| tee` killed: BrokenPipeError)
    what the run prints there stops, with one warning, and the run goes on (docs/troubleshooting.md
    'Logs'); fd 1 then points at /dev/null, so the interpreter's last flush fails no more."""

    def __init__(self, stream):
        self.stream, self.broken = stream, False

    def write(self, text):
        return self.guarded(self.stream.write, text) or len(text)

    def flush(self):
        self.guarded(self.stream.flush)

    def guarded(self, call, *args):
        if self.broken:
            return None
        try:
            return call(*args)
        except BrokenPipeError:
            self.broken = True
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.stream.fileno())
            os.close(null)
            tqdm.write("rloo: WARNING: stdout's reader is gone (broken pipe): nothing more is "
                       "printed there; training, checkpoints and metrics.jsonl go on",
                       file=sys.stderr)
            return None

    def __getattr__(self, name):  # fileno, isatty, encoding: the stream's
        return getattr(self.stream, name)


@contextlib.contextmanager
def borrowed():
    """The body of a run; -> an ExitStack that closes what the run opens (its generation thread, its
    logs), first thing on the way out."""
    if torch.get_default_device().type != "cpu":  # a context of torch's own, not one to set aside
        fail(f"train.main runs under a default device of {torch.get_default_device()} (the "
             "caller's torch.set_default_device or `with torch.device(...)`); call it outside")
    if not RUNNING.acquire(blocking=False):  # what it borrows is the process's, one run's at a time
        fail("train.main is already running in this process (from another thread): one run at a "
             "time, as each borrows the process's state; start the next when it returns")
    try:
        with lent() as opened:
            yield opened
    finally:
        RUNNING.release()


@contextlib.contextmanager
def lent():
    """borrowed's body: what the run takes from the process, given back however it ends."""
    handlers = {signum: signal.getsignal(signum) for signum in SIGNALS} if in_main_thread() else {}
    hooks, modes, states = (sys.excepthook, threading.excepthook), [r() for r, _, _ in FRESH], \
        random_states()
    threads, environ, filters = torch.get_num_threads(), dict(os.environ), warnings.filters[:]
    levels = {name: logger.level for name, logger in logging.root.manager.loggerDict.items()
              if isinstance(logger, logging.Logger)}
    had_group, monitor, stdout = dist.is_initialized(), tqdm.monitor, sys.stdout
    watcher = reward_calls.WATCHER[0]
    stack.PATHS.clear()
    try:
        sys.stdout = Stdout(stdout)
        for (_, set_mode, fresh) in FRESH:
            set_mode(fresh)
        with contextlib.ExitStack() as opened:
            # a caller's inference_mode or no_grad: torch's inference_mode(False) turns gradients on
            opened.enter_context(torch.inference_mode(False))
            for device in ("cpu", "cuda")[:1 + torch.cuda.is_available()]:  # a caller's autocast
                opened.enter_context(torch.autocast(device, enabled=False))
            yield opened
        if dist.is_initialized() and not had_group:  # the run's group, once every rank is done
            distributed.shutdown()
    finally:
        if dist.is_initialized() and not had_group:  # an error's way out
            distributed.shutdown(peers_alive=False)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        # init_process_group wraps sys's (a [rankN] prefix), once per group; threading's: logs.py's
        sys.excepthook, threading.excepthook = hooks
        sys.stdout = stdout
        for (_, set_mode, _), mode in zip(FRESH, modes):
            set_mode(mode)
        set_random_states(states)
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(environ)
        warnings.filters[:] = filters
        for name, level in levels.items():  # setLevel clears all loggers' caches: changed ones only
            if logging.getLogger(name).level != level:
                logging.getLogger(name).setLevel(level)
        user_code.forget()
        packing.BASE.clear()  # keyed by id(config): a later run's config may reuse an id
        if tqdm.monitor is not monitor:  # the thread tqdm starts with the first progress bar
            tqdm.monitor.exit()
            tqdm.monitor = monitor
        if reward_calls.WATCHER[0] is not watcher:  # the thread that warns of a slow reward call
            reward_calls.stop_watching()
        gc.collect()  # the run's models and their FSDP2 process groups, whose gloo threads join


@contextlib.contextmanager
def command_line():
    """`python train.py` from start to exit. A non-daemon thread user code left running (a reward's
    metrics flusher) would keep the interpreter from exiting after the run, holding a batch job's
    allocation until its wall time: name it, and exit without waiting for it."""
    try:
        yield
    except BaseException as error:
        leave_threads(error)
        raise
    leave_threads(None)


def leave_threads(error):
    """The exit as the interpreter's would be, without waiting for non-daemon threads alive."""
    left = [t for t in threading.enumerate() if t.is_alive() and not t.daemon
            and t is not threading.main_thread()]
    if not left:
        return
    code = 0 if error is None else 130 if isinstance(error, KeyboardInterrupt) else 1
    if isinstance(error, SystemExit):
        code = error.code if isinstance(error.code, int) else 0 if error.code is None else 1
        if not isinstance(error.code, (int, type(None))):
            print(error.code, file=sys.stderr)
    elif error is not None:
        traceback.print_exception(error)
    names = ", ".join(f"{t.name!r}" + (f" (started by {user_code.STARTED[t]})"
                                        if t in user_code.STARTED else "") for t in left)
    print(f"rloo: WARNING: thread {names} still running, not a daemon: exiting without waiting "
          "for it (make it a daemon, or end it, to keep it from holding the process)",
          file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(code)
