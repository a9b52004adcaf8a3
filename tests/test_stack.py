"""plumbing/stack.py: the precision chosen where --bf16 is unset, the checkpointing entry point of each transformers release,
and the start-up's line for each path a version or the device chose."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from plumbing import stack

pytestmark = pytest.mark.stack  # version-sensitive: CI runs it on the newest and oldest stacks too

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)  # devices as data: nothing here touches a GPU


@pytest.mark.parametrize("device, capability, flags, native", [
    (CPU, None, {"avx2", "avx512f"}, False),  # an AMD EPYC of the CI kind: no AVX512-BF16, no AMX
    (CPU, None, {"avx512f", "avx512_bf16"}, True),
    (CPU, None, {"amx_tile", "amx_bf16"}, True),
    (CPU, None, {"asimd", "bf16"}, True),  # ARM (Graviton 3+, Apple M2+ under Linux)
    (CUDA, (7, 0), set(), False),  # V100: bf16 emulated
    (CUDA, (8, 0), set(), True),
    (CUDA, (9, 0), set(), True)])
def test_unset_bf16_takes_what_the_device_computes_natively_and_says_so(monkeypatch, capsys, device,
                                                                       capability, flags, native):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(stack, "PATHS", {})
    cfg = SimpleNamespace(bf16=None)
    stack.choose_precision(cfg, device, flags)
    assert cfg.bf16 is native and stack.PATHS["precision"] == ("bf16" if native else "fp32")
    line = capsys.readouterr().out
    assert line.startswith("rloo: path: precision = ") and "--bf16 unset" in line
    cfg = SimpleNamespace(bf16=True)  # asked for: kept, and its cost said where it is emulated
    stack.choose_precision(cfg, device, flags)
    assert cfg.bf16 is True and ("emulated in software" in capsys.readouterr().out) is not native


def test_cpu_flags_are_read_from_x86_and_arm_cpuinfo(tmp_path):
    x86, arm = tmp_path / "x86", tmp_path / "arm"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert stack.cpu_flags(x86) == {"fpu", "avx2", "avx512_bf16"}
    assert stack.cpu_flags(arm) == {"fp", "asimd", "bf16"} and stack.cpu_flags(tmp_path / "none") == set()


def test_activation_checkpointing_uses_the_entry_point_the_release_has(monkeypatch):
    """transformers >= 5.23 deprecates gradient_checkpointing_enable (a FutureWarning at every --model run) for
    activation_checkpointing_enable; older releases have only the former."""
    calls = []
    new = SimpleNamespace(activation_checkpointing_enable=lambda **kw: calls.append(("new", kw)),
                          gradient_checkpointing_enable=lambda **kw: calls.append(("old", kw)))
    old = SimpleNamespace(gradient_checkpointing_enable=lambda **kw: calls.append(("old", kw)))
    monkeypatch.setattr(stack, "PATHS", {})
    stack.enable_activation_checkpointing(new)
    stack.enable_activation_checkpointing(old)
    assert calls == [("new", {"activation_checkpointing_kwargs": {"use_reentrant": False}}),
                     ("old", {"gradient_checkpointing_kwargs": {"use_reentrant": False}})]



def test_fsdp_param_groups_reads_the_list_of_torch_2_13_and_the_single_group_before(process_group):
    """The installed torch's FSDP2 state through the reader, then each release's shape as data."""
    from torch.distributed.fsdp import fully_shard
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    fully_shard(model[0]), fully_shard(model)
    assert [len(stack.fsdp_param_groups(unit)) for unit in (model[0], model)] == [1, 1]
    group = object()
    for state, groups in [(SimpleNamespace(_fsdp_param_groups=[group, group]), [group, group]),  # 2.13+
                          (SimpleNamespace(_fsdp_param_group=group), [group]),  # 2.9-2.12
                          (SimpleNamespace(_fsdp_param_group=None), [])]:  # a unit without parameters
        assert stack.fsdp_param_groups(SimpleNamespace(_get_fsdp_state=lambda s=state: s)) == groups

def test_the_start_up_names_the_versions_and_each_path_once(tmp_path):
    """A run says its stack and each path it took, once: the versions, the precision, the training
    rows (packed by default on a CPU), the KV cache, the packed attention."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "train.py", "--max_steps", "2", "--output_dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=root, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("rloo: path: ")]
    names = [line.split(" = ")[0].removeprefix("rloo: path: ") for line in lines]
    assert names == ["versions", "precision", "training rows", "KV cache", "packed attention"], lines
    assert f"torch {torch.__version__}" in lines[0] and lines[3].endswith("= KVBuffer (grows in place)")
