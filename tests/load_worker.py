"""Loads --model DIR as train.py does (load_pretrained, then prepare_model) under torchrun, and writes
what each rank measured to argv[1].RANK.json: its peak resident set above the one before loading (MiB),
whether each full (all-gathered) parameter and each buffer equals the directory's, and whether the tied
embedding and head are still one parameter."""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402
from plumbing import distributed, models  # noqa: E402


def resident(key="VmRSS"):
    with open("/proc/self/status") as f:
        return int(f.read().split(key + ":")[1].split()[0]) / 1024


device = distributed.setup_distributed()
cfg = train.parse_config(sys.argv[2:])
with open("/proc/self/clear_refs", "w") as f:  # this worker's own peak from here (proc(5))
    f.write("5")
before = resident()
model = models.prepare_model(models.load_pretrained(cfg)[0], cfg, trainable=True, device=device)
grown = resident("VmHWM") - before
reference = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
expected = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
got = {**dict(model.named_parameters()), **dict(model.named_buffers())}
unequal = [name for name, value in got.items()
           if not torch.equal(getattr(value, "full_tensor", lambda: value)().cpu(), expected[name])]
tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
with open(f"{sys.argv[1]}.{distributed.rank()}.json", "w") as f:
    json.dump({"grown_mib": grown, "unequal": unequal, "tied": tied, "names": len(got)}, f)
distributed.shutdown()
