"""torch.distributed without clutter: start-up, this process's rank and the world size, and the two
collectives the trainer needs for its metrics (a gather of per-completion columns, a sum of per-step
totals).

The same code runs as one process (`python train.py`: a process group of one, so that bf16 runs
FSDP2's mixed precision as N processes do) and as N (`torchrun`). It holds no model code (sharding
is in models.prepare_model) and no checkpoint code (checkpoint.py).
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from config import fail


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
    device_id = device if device.type == "cuda" else None
    options = dict(timeout=datetime.timedelta(seconds=timeout), device_id=device_id)
    if "RANK" not in os.environ:
        options.update(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(process_group_backend(device), **options)
    return device


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
    """{name: scalar tensor} summed over ranks in one all-reduce -> {name: float}."""
    names = list(sums)
    stacked = torch.stack([sums[name] for name in names])
    if world_size() > 1:
        dist.all_reduce(stacked)
    return dict(zip(names, stacked.tolist()))


def shutdown():
    """Tear the process group down once every rank is done (rank 0 may still be writing the final
    model)."""
    if dist.is_initialized():
        barrier()
        dist.destroy_process_group()
        wait_for_gloo_workers()


def wait_for_gloo_workers(timeout=10.0, quiet=0.05):
    """Return once gloo's worker threads (pt_gloo_runloop) are parked, so the interpreter may
    finalize.

    destroy_process_group does not join them: FSDP2 still holds the group, and only its destructor
    joins them. A worker that has finished a collective but not yet dropped it (preempted on a busy
    machine) takes the GIL to release its tensors' Python objects; if that happens as the
    interpreter finalizes, CPython ends the thread with pthread_exit inside a noexcept destructor
    and the process aborts ('terminate called without an active exception'). Parked: sleeping,
    context switches unchanged for `quiet` seconds while this thread sleeps without the GIL (a
    worker waiting for the GIL wakes every 5 ms). No work is queued after destroy_process_group, so
    a parked worker stays parked. Linux only (/proc); elsewhere a no-op."""
    def workers():
        found = {}
        for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() != "pt_gloo_runloop":
                        continue
                with open(f"/proc/self/task/{tid}/status") as f:
                    status = dict(line.split(":", 1) for line in f)
            except OSError:  # the thread has just ended
                continue
            found[tid] = tuple(status[k].split()[0] for k in
                               ("State", "voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"))
        return found

    deadline, before = time.monotonic() + timeout, workers()
    while before and time.monotonic() < deadline:
        time.sleep(quiet)
        now = workers()
        if now == before and all(state == "S" for state, _, _ in now.values()):
            return
        before = now
