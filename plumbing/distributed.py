"""torch.distributed without clutter: start-up, this process's rank and the world size, and the two
collectives the trainer needs for its metrics (a gather of per-completion columns, a sum of per-step
totals, with their maxima and minima), and the full weights gathered from their FSDP2 shards one
at a time (what a vLLM weight push sends).

The same code runs as one process (`python train.py`: a process group of one, so that bf16 runs
FSDP2's mixed precision as N processes do) and as N (`torchrun`). It holds no model code (sharding
is in models.prepare_model) and no checkpoint code (plumbing/checkpoint.py).
"""

import datetime
import os
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from plumbing.config import fail


def setup_distributed(timeout=1800.0):
    """The device of this process and the process group (NCCL on GPU, gloo on CPU): torchrun's, or
    one of a single process (an in-memory store, no ports). timeout: seconds a collective may wait
    (--ddp_timeout), e.g. for rank 0's weight push to a vLLM server."""
    gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank() + 1))
    device = device_for(local_rank(), processes, gpu_count)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        warn_if_gpus_are_hidden()
    if dist.is_initialized():  # a caller in this process set it up (tests, bench.py)
        return device
    if device.type == "cpu":
        CPU_THREADS[:] = [set_cpu_threads()]
    device_id = device if device.type == "cuda" else None
    if device_id is not None:  # read as the group starts; the environment is given back after a run
        os.environ.update(NCCL_ERROR_HANDLING)
    options = dict(timeout=datetime.timedelta(seconds=timeout), device_id=device_id)
    if "RANK" not in os.environ:
        options.update(store=dist.HashStore(), rank=0, world_size=1)
    before = threads()
    dist.init_process_group(process_group_backend(device), **options)
    PEERS[:] = gather_objects((socket.gethostname(), os.getpid()))
    # gloo's workers: named pt_gloo_runloop in newer torch; in 2.9 they keep this thread's name
    # (NCCL's threads are named in both)
    now = threads()
    name = now.get(str(threading.get_native_id()))
    GLOO_THREADS[:] = [t for t, n in now.items()
                       if t not in before and n in ("pt_gloo_runloop", name)]
    return device


# How NCCL meets a lost or hung peer. torchrun sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1, with which
# NCCL's watchdog thread aborts the whole process: no line names the peer, and a hung one costs
# --ddp_timeout and ends without a word of the checkpoint. A blocking wait instead raises the failed
# or timed-out collective in the thread that waits for it, as gloo does, so the run ends with
# checkpoint.stop_if_a_peer_is_lost's line; no watchdog handling (0) leaves it that one way out. The
# cost: a rank's host waits for each collective it waits on (FSDP2's gathers among them).
NCCL_ERROR_HANDLING = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}

# (host, pid) of every rank, by rank, gathered at start-up: how a survivor names a lost peer
PEERS = []
# the ids of the threads gloo started in setup_distributed; see wait_for_gloo_workers
GLOO_THREADS = []


def threads():
    """{thread id: name} of this process's threads (Linux's /proc; elsewhere none)."""
    found = {}
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                found[tid] = f.read().strip()
        except OSError:  # the thread has just ended
            continue
    return found


def lost_peers(wait=2.0):
    """Ranks whose process has ended (killed, out of memory, stopped by an error), as far as this
    host can see: a peer on another host cannot be looked at. A collective fails as soon as the
    peer's sockets close, a moment before its process is gone: wait up to `wait` seconds."""
    host, deadline = socket.gethostname(), time.monotonic() + wait
    while True:
        lost = [r for r, (h, pid) in enumerate(PEERS) if h == host and process_ended(pid)]
        if lost or time.monotonic() >= deadline:
            return lost
        time.sleep(0.05)


def process_ended(pid):
    """Gone, or a zombie its launcher (torchrun) has not reaped yet."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def collective_failed(error):
    """Whether an exception is a collective's that lost its peer (gloo's sockets, NCCL's blocking
    wait: NCCL_ERROR_HANDLING), rather than a bug of ours."""
    return isinstance(error, dist.DistError) or "gloo/transport" in str(error)


# the start-up line's note on the CPU thread count: what set_cpu_threads chose and why
CPU_THREADS = []


def set_cpu_threads():
    """torch's intra-op threads on the CPU: one per core that other processes leave idle (sampled
    at start-up), or OMP_NUM_THREADS where set (torchrun sets 1). A thread on a core a neighbour
    keeps busy holds up every parallel op: 100 steps of the embedded task beside one busy process
    on 2 cores take ~29 s with 2 threads, ~17 s with 1; quiet, 2 threads are the faster. -> a note
    for the start-up line"""
    env = os.environ.get("OMP_NUM_THREADS")
    busy = None if env else busy_cores(since=IMPORTED)
    threads, reason = choose_cpu_threads(usable_cores(), busy, env)
    torch.set_num_threads(threads)
    return f"{threads} thread(s): {reason}"


def choose_cpu_threads(cores, busy, env=None):
    """The rule: OMP_NUM_THREADS if given, else the cores not kept busy by other processes (a
    neighbour at under half a core leaves its core to us), at least 1. -> (threads, reason)"""
    if env:
        return int(env), f"OMP_NUM_THREADS={env}"
    idle = max(0, min(cores, int(cores - busy + 0.5)))
    return max(1, idle), f"{idle} of {cores} cores idle at start-up; OMP_NUM_THREADS overrides"


def usable_cores():
    """The cores this process may run on (its affinity; all where that is unknown)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_sample():
    """(wall seconds, this process's CPU seconds, (total, idle + iowait) ticks of the cores this
    process may run on: Linux's per-core lines of /proc/stat, or None elsewhere)"""
    mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    total = idle = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name.startswith("cpu") and name != "cpu" and (mine is None or
                                                                 int(name[3:]) in mine):
                    values = [int(x) for x in fields]
                    total, idle = total + sum(values), idle + values[3] + values[4]
    except (OSError, ValueError, IndexError):
        return time.monotonic(), 0.0, None
    own = os.times()
    return time.monotonic(), own.user + own.system, (total, idle)


# taken at import: start-up's imports (seconds) are the window busy_cores samples, so that a run
# does not sleep for one
IMPORTED = cpu_sample()


def busy_cores(seconds=0.25, since=None):
    """Cores' worth of CPU time other processes used on the cores this process may run on (its
    affinity: a job confined to 8 of 64 cores does not count the others' load), 0 where Linux's
    /proc/stat is missing: since `since` (a cpu_sample from 0.25 to 60 s ago), else over `seconds`
    of sleep. This process's own CPU time is not counted."""
    first = since if since and 0.25 <= time.monotonic() - since[0] <= 60 else None
    if first is None:
        first = cpu_sample()
        if first[2] is None:  # no /proc/stat: nothing to wait for
            return 0.0
        time.sleep(seconds)
    last = cpu_sample()
    if first[2] is None or last[2] is None:
        return 0.0
    ticks, idle = last[2][0] - first[2][0], last[2][1] - first[2][1]
    own = (last[1] - first[1]) * os.sysconf("SC_CLK_TCK")  # in ticks, as /proc/stat counts
    return max(0.0, usable_cores() * (1 - (idle + own) / max(1, ticks)))


def device_for(rank_on_node, local_processes, gpu_count):
    """The device of the process with this rank on its node (LOCAL_RANK): its own GPU, or the CPU
    where the node shows none. local_processes: how many this node runs (LOCAL_WORLD_SIZE). More
    processes than GPUs is one line: two ranks on one GPU would share its memory, and NCCL refuses
    a group that holds one GPU twice."""
    if gpu_count == 0:
        return torch.device("cpu")
    if local_processes > gpu_count:
        fail(f"{local_processes} processes on this node but {gpu_count} visible GPU(s), so two "
             f"ranks would share a GPU: start at most {gpu_count} (torchrun --nproc_per_node, "
             "launch.sh's NPROC_PER_NODE) or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    return torch.device("cuda", rank_on_node)


def warn_if_gpus_are_hidden():
    """Training on the CPU on a machine with NVIDIA GPUs is almost always a launch mistake: say so,
    loudly."""
    driver = "/proc/driver/nvidia/gpus"
    gpus = os.listdir(driver) if os.path.isdir(driver) else []
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus or hidden == "":
        if hidden is not None:
            why = f"CUDA_VISIBLE_DEVICES={hidden!r} hides them"
        elif torch.version.cuda is None:
            why = f"this torch build has no CUDA (torch {torch.__version__})"
        else:
            why = "CUDA cannot initialise them"
        print(f"rloo: WARNING: this machine has {len(gpus) or 'some'} NVIDIA GPU(s) but this "
              f"process trains on the CPU: {why}", file=sys.stderr)


def process_group_backend(device):
    """NCCL for GPU tensors plus gloo for CPU tensors: --cpu_offload keeps gradients on the CPU, and
    clipping their norm is a collective on CPU tensors ("No backend type associated with device type
    cpu" under NCCL alone)."""
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def local_rank():
    """The process's rank on its node (torchrun's LOCAL_RANK)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main():
    return rank() == 0


def barrier():
    if world_size() > 1:
        dist.barrier()


def gather(columns):
    """{name: [..., B] tensor} -> {name: [..., world * B]}: every rank's columns concatenated along
    the last dim, in rank order (metrics and the global advantage normalization). None values pass
    through."""
    if world_size() == 1:
        return dict(columns)
    gathered = {}
    for name, tensor in columns.items():
        if tensor is None:
            gathered[name] = None
            continue
        parts = [torch.empty_like(tensor) for _ in range(world_size())]
        dist.all_gather(parts, tensor.contiguous())
        gathered[name] = torch.cat(parts, -1)
    return gathered


def gather_objects(obj):
    """Any picklable object from every rank, in rank order (names only some ranks know)."""
    if world_size() == 1:
        return [obj]
    objects = [None] * world_size()
    dist.all_gather_object(objects, obj)
    return objects


def reduce_sums(sums):
    """{name: scalar tensor} summed over ranks in one all-reduce -> {name: float}; names that start
    with "max/" or "min/" are this rank's extremes instead, taken over ranks by reduce_extremes."""
    extremes = {k: v for k, v in sums.items() if k.startswith(("max/", "min/"))}
    names = [name for name in sums if name not in extremes]
    stacked = torch.stack([sums[name] for name in names])
    if world_size() > 1:
        dist.all_reduce(stacked)
    return {**dict(zip(names, stacked.tolist())), **reduce_extremes(extremes)}


def reduce_extremes(extremes):
    """{"max/..." or "min/...": scalar tensor} -> {name: float}, the largest or smallest over ranks
    in one all-reduce (a minimum is minus the maximum of minus the values); none, no collective."""
    if not extremes:
        return {}
    names = list(extremes)
    stacked = torch.stack([extremes[name] for name in names]).float()
    sign = torch.tensor([-1.0 if name.startswith("min/") else 1.0 for name in names],
                        device=stacked.device)
    stacked = stacked * sign
    if world_size() > 1:
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    return dict(zip(names, (stacked * sign).tolist()))


def shutdown(peers_alive=True):
    """Tear the process group down once every rank is done (rank 0 may still be writing the final
    model). peers_alive False: an error's way out, no barrier (the peers may be gone)."""
    if dist.is_initialized():
        if peers_alive:
            barrier()
        PEERS.clear()  # they may now end: none of them is lost
        dist.destroy_process_group()
        wait_for_gloo_workers()


def wait_for_gloo_workers(timeout=10.0, quiet=0.05):
    """Return once gloo's worker threads (gloo_workers) are parked, so the interpreter may finalize.

    destroy_process_group does not join them: FSDP2 still holds the group, and only its destructor
    joins them. A worker that has finished a collective but not yet dropped it (preempted on a busy
    machine) takes the GIL to release its tensors' Python objects; if that happens as the
    interpreter finalizes, CPython ends the thread with pthread_exit inside a noexcept destructor
    and the process aborts ('terminate called without an active exception'). Parked: sleeping,
    context switches unchanged for `quiet` seconds while this thread sleeps without the GIL (a
    worker waiting for the GIL wakes every 5 ms). No work is queued after destroy_process_group, so
    a parked worker stays parked. Linux only (/proc); elsewhere a no-op."""
    deadline, before = time.monotonic() + timeout, gloo_workers()
    while before and time.monotonic() < deadline:
        time.sleep(quiet)
        now = gloo_workers()
        if now == before and all(state == "S" for state, _, _ in now.values()):
            return
        before = now


def gloo_workers():
    """{thread id: (state, voluntary and involuntary context switches)} of gloo's worker threads:
    named pt_gloo_runloop (newer torch), or started in setup_distributed (GLOO_THREADS)."""
    found = {}
    for tid, name in threads().items():
        if name != "pt_gloo_runloop" and tid not in GLOO_THREADS:
            continue
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                status = dict(line.split(":", 1) for line in f)
        except OSError:  # the thread has just ended
            continue
        found[tid] = tuple(status[k].split()[0] for k in
                           ("State", "voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"))
    return found


def full_weights(model, tensors="state_dict"):
    """(name, full tensor) one at a time; FSDP2 shards are all-gathered in the same order on every
    rank, on the GPU (with --cpu_offload the shards live in host memory, and gathering them there
    would run on gloo). tensors "state_dict": a tied lm_head.weight too (colocated vLLM keeps its
    own copy of it); "parameters": each tensor once (the weight-transfer engine rejects a tied
    alias)."""
    items = model.state_dict().items() if tensors == "state_dict" else model.named_parameters()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
    for name, tensor in items:
        if isinstance(tensor, DTensor):
            if device is not None and tensor.device != device:
                tensor = DTensor.from_local(tensor.to_local().to(device), tensor.device_mesh,
                                            tensor.placements, shape=tensor.shape,
                                            stride=tensor.stride())
            tensor = tensor.full_tensor()
        yield name, tensor.detach()
