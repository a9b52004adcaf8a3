"""torch.distributed without clutter: start-up, this process's rank and the world size, and the two collectives the
trainer needs for its metrics (a gather of per-completion columns, a sum of per-step totals).

The same code runs as one process (`python train.py`: no process group, rank 0 of 1) and as N (`torchrun`). It holds
no model code (sharding is in train.prepare_model) and no checkpoint code (checkpoint.py).
"""

import os

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
