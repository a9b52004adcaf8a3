"""What a run borrows from its process, and gives back however it ends: train.main can be called
again and again in one process (a notebook, a sweep; README 'Sweeps'), each run as from a fresh
one, and the caller finds the process as it was.

Borrowed: the SIGTERM and SIGINT handlers (checkpoint.watch_signals), sys.excepthook (which
torch.distributed wraps), torch's CPU threads (distributed.set_cpu_threads), the process group when
the run made it, environment variables (a colocated vLLM engine's), warnings filters and logger
levels, the attention implementations packed models stand in front of (packing.BASE), the user's
modules (user_code), the paths said (stack.PATHS), and the run's own threads: tqdm's monitor, the
generation thread and the loggers (main registers those two here), the slow reward call's
watcher.
"""

import contextlib
import gc
import logging
import os
import signal
import sys
import warnings

import torch
import torch.distributed as dist
from tqdm import tqdm

import distributed
import packing
import reward_calls
import stack
import user_code

SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def borrowed():
    """The body of a run; -> an ExitStack that closes what the run opens (its generation thread, its
    logs), first thing on the way out."""
    handlers, hook = {signum: signal.getsignal(signum) for signum in SIGNALS}, sys.excepthook
    threads, environ, filters = torch.get_num_threads(), dict(os.environ), warnings.filters[:]
    levels = {name: logger.level for name, logger in logging.root.manager.loggerDict.items()
              if isinstance(logger, logging.Logger)}
    had_group, monitor, watcher = dist.is_initialized(), tqdm.monitor, reward_calls.WATCHER[0]
    stack.PATHS.clear()
    try:
        with contextlib.ExitStack() as opened:
            yield opened
        if dist.is_initialized() and not had_group:  # the run's group, once every rank is done
            distributed.shutdown()
    finally:
        if dist.is_initialized() and not had_group:  # an error's way out: no barrier, the peers
            distributed.PEERS.clear()  # may be gone
            dist.destroy_process_group()
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        sys.excepthook = hook  # init_process_group wraps it (a [rankN] prefix), once per group
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(environ)
        warnings.filters[:] = filters
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        user_code.forget()
        packing.BASE.clear()  # keyed by id(config): a later run's config may reuse an id
        if tqdm.monitor is not monitor:  # the thread tqdm starts with the first progress bar
            tqdm.monitor.exit()
            tqdm.monitor = monitor
        if reward_calls.WATCHER[0] is not watcher:  # the thread that warns of a slow reward call
            reward_calls.stop_watching()
        gc.collect()  # the run's models and their FSDP2 process groups, whose gloo threads join
