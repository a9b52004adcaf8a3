"""torch.distributed without clutter: start-up, this process's rank and the world size, and the two collectives the
trainer needs for its metrics (a gather of per-completion columns, a sum of per-step totals).

The same code runs as one process (`python train.py`: no process group, rank 0 of 1) and as N (`torchrun`). It holds
no model code (sharding is in train.prepare_model) and no checkpoint code (checkpoint.py).
"""

import os
import time

import torch
import torch.distributed as dist


def setup_distributed():
    """The device of this process; under torchrun also the process group (NCCL on GPU, gloo on CPU)."""
    if "RANK" not in os.environ:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(process_group_backend(device), device_id=device if device.type == "cuda" else None)
    return device


def process_group_backend(device):
    """NCCL for GPU tensors plus gloo for CPU tensors: --cpu_offload keeps gradients on the CPU, and clipping their
    norm is a collective on CPU tensors ("No backend type associated with device type cpu" under NCCL alone)."""
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main():
    return rank() == 0


def barrier():
    if world_size() > 1:
        dist.barrier()


def gather(columns):
    """{name: [..., B] tensor} -> {name: [..., world * B]}: every rank's columns concatenated along the last dim, in
    rank order (metrics and the global advantage normalization). None values pass through."""
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


def reduce_sums(sums):
    """{name: scalar tensor} summed over ranks in one all-reduce -> {name: float}."""
    names = list(sums)
    stacked = torch.stack([sums[name] for name in names])
    if world_size() > 1:
        dist.all_reduce(stacked)
    return dict(zip(names, stacked.tolist()))


def shutdown():
    """Tear the process group down once every rank is done (rank 0 may still be writing the final model)."""
    if world_size() > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        wait_for_gloo_workers()


def wait_for_gloo_workers(timeout=10.0, quiet=0.05):
    """Return once gloo's worker threads (pt_gloo_runloop) are parked, so the interpreter may finalize.

    destroy_process_group does not join them: FSDP2 still holds the group, and only its destructor joins them. A
    worker that has finished a collective but not yet dropped it (preempted on a busy machine) takes the GIL to release
    its tensors' Python objects; if that happens as the interpreter finalizes, CPython ends the thread with
    pthread_exit inside a noexcept destructor and the process aborts ('terminate called without an active
    exception'). Parked: sleeping, context switches unchanged for `quiet` seconds while this thread sleeps without the
    GIL (a worker waiting for the GIL wakes every 5 ms). No work is queued after destroy_process_group, so a parked
    worker stays parked. Linux only (/proc); elsewhere a no-op."""
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
