"""The directories a run writes, checked before anything loads: each can be made and written (name
and path lengths, files in the way, permissions), and output_dir belongs to one live run at a time
(a lock file naming its process; a dead run's lock is taken over), holding no other run's
checkpoints unless the flags say so.
"""

import json
import os
import socket
import sys
import time
import weakref

from plumbing import distributed
from plumbing.checkpoint import checkpoint_dirs, reason
from plumbing.config import fail

PATH_MAX = 4096  # Linux's, bytes
LONGEST_WRITTEN = 80  # the longest name the run writes under a directory (a tensorboard event file)


def path_problem(value):
    """Why the run cannot make and write the directory `value` (a name over the filesystem's
    limit, the whole path over PATH_MAX, a file on the way, no write permission), or None: found
    at start-up, not as an OSError when the first checkpoint or metric is written."""
    if not value:
        return "is empty; pass a directory"
    path = os.path.abspath(value)
    existing = path
    while not os.path.exists(existing):  # a name too long "does not exist" either
        if os.path.islink(existing):  # a symbolic link whose target is gone
            return (f"cannot be made: {existing!r} is a symbolic link to "
                    f"{os.readlink(existing)!r}, which does not exist; make that, or pass another "
                    "directory")
        existing = os.path.dirname(existing)
    try:
        name_max = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    long_names = [name for name in path.split(os.sep) if len(os.fsencode(name)) > name_max]
    if long_names:
        return (f"holds a name of {len(os.fsencode(long_names[0]))} bytes "
                f"({long_names[0][:24]}...), over this filesystem's limit of {name_max}; "
                "pass a shorter one")
    if len(os.fsencode(path)) + LONGEST_WRITTEN > PATH_MAX:
        return (f"is {len(os.fsencode(path))} bytes long; with the files the run writes in it, "
                f"paths would pass the limit of {PATH_MAX}; pass a shorter one")
    if existing == path and not os.path.isdir(path):
        return "is a file; pass a directory"
    if not os.path.isdir(existing):
        return f"cannot be made: {existing!r} is a file; pass another directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"is not writable ({existing!r} is read-only for this user); pass another directory"
    return None


def check_output_dir(cfg):
    """Every directory the run writes (output_dir, and the vLLM weight files' --vllm_sync_dir) can
    be made and written; no other live run writes to output_dir (rank 0 takes its lock), and it
    holds no other run's checkpoints unless asked. Before anything loads. -> what releases the
    lock (train.main calls it as the run ends; else it goes with cfg), or None.""" 
    written = {"--output_dir": cfg.output_dir, "--vllm_sync_dir": cfg.vllm_sync_dir}
    for flag, value in written.items():
        problem = None if value is None and flag != "--output_dir" else path_problem(value)
        shown = value if len(value or "") <= 200 else f"{value[:80]}...{value[-80:]}"
        if problem:
            fail(f"{flag} {shown!r} {problem}")
    release = lock_output_dir(cfg) if distributed.is_main() else None
    if cfg.resume_from_checkpoint is None and not cfg.overwrite_output_dir and \
            checkpoint_dirs(cfg.output_dir):
        fail(f"output_dir {cfg.output_dir!r} holds another run's checkpoints; pass "
             "--resume_from_checkpoint latest to continue it, --overwrite_output_dir to replace "
             "it, or another --output_dir")
    return release


def resolve_paths(cfg):
    """The paths the run writes and reads after start-up, made absolute once it has checked them:
    user code that changes the working directory mid-run (a grader's chdir) cannot send the
    checkpoints and the final model elsewhere."""
    cfg.output_dir = os.path.abspath(cfg.output_dir)
    if cfg.vllm_sync_dir:
        cfg.vllm_sync_dir = os.path.abspath(cfg.vllm_sync_dir)
    if cfg.resume_from_checkpoint not in (None, "latest"):
        cfg.resume_from_checkpoint = os.path.abspath(cfg.resume_from_checkpoint)


LOCK = "rloo.lock"  # in output_dir while a run writes there: {"pid", "host", "started", "token"}


def lock_output_dir(cfg):
    """output_dir/rloo.lock, made with O_EXCL (one process wins), names the run writing there: a
    second run would write its metrics and checkpoints over the first's. A lock whose process is
    gone from this host (killed with SIGKILL, out of memory) is stale and taken over, so a resume
    is never blocked by its own dead run. Held until the returned finalizer is called (train.main,
    as the run ends however it ends) or `cfg` goes, then removed with the directories it made if
    the run left them empty. -> the finalizer, or None when this process held it already."""
    directory = made = os.path.abspath(cfg.output_dir)
    while not os.path.isdir(os.path.dirname(made)):  # the first directory makedirs will make
        made = os.path.dirname(made)
    made = None if os.path.isdir(directory) else made
    os.makedirs(directory, exist_ok=True)
    path, me = os.path.join(directory, LOCK), {**this_process(), "token": os.urandom(8).hex()}
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            holder = read_lock(path)
        if holder is not None and ours(holder):
            return None  # taken by an earlier check in this process: it stays as it is
        if holder is None and time.time() - mtime(path) < 5:  # being written: read it again
            time.sleep(0.1)
            continue
        if holder is not None and not lock_is_stale(holder):
            fail(f"--output_dir {cfg.output_dir!r} is in use by another run (pid "
                 f"{holder['pid']} on {holder['host']}): two runs in one directory "
                 "write over each other's metrics and checkpoints; wait for it to end or pass "
                 f"another --output_dir (if no such run exists, delete {path})")
        if holder is not None:
            print(f"rloo: note: {path} was left by pid {holder['pid']}, which is gone: taking it "
                  "over", file=sys.stderr)
        try:  # stale, or never written (its writer killed)
            remove_lock(path, holder)
        except OSError as e:  # not a file, or not ours to remove: asking beats looping
            fail(f"--output_dir {cfg.output_dir!r}: cannot take over the stale lock {path} "
                 f"({reason(e)}); delete it")
    with os.fdopen(fd, "w") as f:
        json.dump(me, f)
    return weakref.finalize(cfg, release_lock, path, me, made)


def this_process():
    """Who holds a lock: pid, host and the process's start time (a reused pid is not the process
    that took the lock)."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": started(os.getpid())}


def ours(holder):
    return all(holder.get(key) == value for key, value in this_process().items())


def started(pid):
    """A process's start time in clock ticks since boot (Linux's /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def mtime(path):
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


def read_lock(path):
    """The lock's holder, or None when it is unreadable (a writer killed mid-write)."""
    try:
        with open(path) as f:
            holder = json.load(f)
    except (OSError, ValueError):
        return None
    whole = isinstance(holder, dict) and isinstance(holder.get("pid"), int) and \
        isinstance(holder.get("host"), str)
    return holder if whole else None


def lock_is_stale(holder):
    """The lock's process is gone (or its pid now names another process); known only on its own
    host (another host's may be alive)."""
    if holder.get("host") != socket.gethostname():
        return False
    pid = holder["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):  # another user's process
        return False
    return holder.get("started") is not None and started(pid) != holder["started"]


def remove_lock(path, holder):
    """Remove the lock if it still holds `holder` (another process may have taken it since)."""
    if read_lock(path) == holder:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def release_lock(path, me, made=None):
    """The lock removed, and the directories the check made (output_dir up to `made`) while they
    are empty: a run that failed before writing anything leaves nothing behind. A directory that
    went read-only (or away) keeps it: the next run takes a dead run's lock over."""
    try:
        remove_lock(path, me)
    except OSError as e:
        print(f"rloo: note: cannot remove the lock {path} ({reason(e)}); the next run in this "
              "directory takes it over", file=sys.stderr)
        return
    directory = os.path.dirname(path)
    while made and directory.startswith(made):
        try:
            os.rmdir(directory)
        except OSError:
            return
        directory = os.path.dirname(directory)
