"""One optimizer step on a fixed global batch of 16 completions, run as 1 process or under torchrun with N ranks
(each rank takes its slice of whole groups). Rank 0 saves loss, grad norm and the full updated weights to argv[1]."""

import dataclasses
import os
import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rollout  # noqa: E402
import train  # noqa: E402
from options import lora  # noqa: E402
from plumbing import distributed, models  # noqa: E402
from step import data, forward  # noqa: E402

device = distributed.setup_distributed()
rank, world_size = distributed.rank(), distributed.world_size()
per_rank = 16 // world_size
cfg = train.parse_config(["--num_generations", "4", "--per_device_train_batch_size", str(per_rank // 2),
                          "--gradient_accumulation_steps", "2", "--max_completion_length", "6",
                          "--gradient_checkpointing", "true"] + sys.argv[2:])
model, tokenizer, _ = data.embedded_task(seed=0)
torch.manual_seed(123)  # the same global batch on every rank
full = rollout.generate(model, tokenizer, {"prompt": ["12=", "345=", "6789=", "0="]}, cfg, device)
advantages = torch.randn(16, generator=torch.Generator().manual_seed(5))  # not zero-mean: a nonzero loss
rows = slice(rank * per_rank, (rank + 1) * per_rank)
batch = full.take(list(range(16))[rows])
if cfg.use_peft:  # B drawn at random, the same on every rank, so that A gets a gradient too
    model = lora.add_adapter(model, lora.settings(cfg))
    g = torch.Generator().manual_seed(7)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.05)
model = models.prepare_model(model, cfg, trainable=True)
# a frozen reference, synced after the step (TR-DPO: ref <- ref + alpha (pi - ref)) after a no-grad forward
# (with LoRA the reference is the adapter-off policy: nothing to sync)
ref = None if cfg.use_peft else models.prepare_model(data.embedded_task(seed=1)[0], cfg, trainable=False)
if ref is not None:
    forward.batch_logps(ref, batch, cfg)
# updated weights = w - grad: compares the gradients
optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
scores = train.Scores(None, None, batch.completion_mask.float(), advantages[rows])
_, stats, grad_norm, _ = train.policy_step(cfg, model, optimizer, scheduler, batch, scores)
stats = distributed.reduce_sums(stats)
options, ref_state = StateDictOptions(full_state_dict=True, cpu_offload=True), None
if ref is not None:
    models.sync_reference(dataclasses.replace(cfg, sync_ref_model=True, ref_model_sync_steps=1,
                                              ref_model_mixup_alpha=0.5), model, ref, step=1)
    ref_state = get_model_state_dict(ref, options=options)
state = get_model_state_dict(model, options=options)
if rank == 0:
    torch.save({"loss": stats["loss"] / world_size, "grad_norm": grad_norm.item(), "state": state, "ref": ref_state},
               sys.argv[1])
distributed.shutdown()  # after rank 0 has saved; see distributed.wait_for_gloo_workers
