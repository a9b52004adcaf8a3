"""Train a few RLOO steps with vLLM generating (colocate or server), pushing the weights before each generation, and
check that the engine follows the trainer: the log-probs vLLM returns for its samples equal the trainer's forward
(and differ from the initial weights': the engine is not stale), and after a final push greedy completions match. Runs as one process or under torchrun; rank 0 writes a JSON report to argv[1].
    python tests/vllm_worker.py OUT.json --model DIR [--vllm_mode server --vllm_server_port P ...]"""

import copy
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rollout  # noqa: E402
import train  # noqa: E402
from options import lora, vllm_rollout  # noqa: E402
from plumbing import distributed, models  # noqa: E402
from step import forward, prompting  # noqa: E402

out_path, flags = sys.argv[1], sys.argv[2:]
device = distributed.setup_distributed()
rank, world_size = distributed.rank(), distributed.world_size()
cfg = train.parse_config(["--use_vllm", "--bf16", "false", "--num_generations", "4", "--per_device_train_batch_size",
                          "8", "--max_completion_length", "8", "--temperature", "0.9", "--dataset", "x",
                          "--reward_funcs", "think_format_reward", "--output_dir",
                          os.path.join(os.path.dirname(out_path), "vllm_run")] + flags)
model, tokenizer = models.load_model(cfg.model)
initial = copy.deepcopy(model).eval()  # the weights the engine loaded: a stale engine would still sample from these
eos_ids = prompting.eos_token_ids(tokenizer, model)
if cfg.use_peft:  # the engine gets W + (alpha / r) B A
    model = lora.add_adapter(model, lora.settings(cfg))
model = models.prepare_model(model, cfg, trainable=True)
generator = vllm_rollout.make_generator(cfg, model, tokenizer, None, device)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)  # large steps
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
prompts = [["What is 2+2?", "Say hi."], ["Count: 1 2 3", "abc"]][rank % 2]
# one greedy completion per prompt (below the flag's domain: a sampler setting, not a training run)
greedy_cfg = dataclasses.replace(train.parse_config(["--max_completion_length", "12"]), num_generations=1,
                                 temperature=0.0)
report = {"drift": []}
for step in range(3):
    batch = generator.generate({"prompt": prompts})  # pushes the weights of the last step first
    with torch.no_grad():  # the log-probs vLLM returned vs the trainer's forward on the same (pushed) weights
        logps, _, T, *_ = forward.forward_logps(model, batch, slice(None), cfg.temperature)
        initial_logps, _, _, *_ = forward.forward_logps(initial, batch, slice(None), cfg.temperature)
    mask = batch.completion_mask[:, :T]
    report["drift"].append(((batch.sampler_logps[:, :T] - logps).abs() * mask).max().item())
    report["moved"] = ((batch.sampler_logps[:, :T] - initial_logps).abs() * mask).max().item()
    advantages = torch.randn(len(batch.completion_lists))
    scores = train.Scores(None, None, batch.completion_mask.float(), advantages)
    train.policy_step(cfg, model, optimizer, scheduler, batch, scores)

greedy = vllm_rollout.VLLMGenerator(greedy_cfg, model, tokenizer, None, device, generator.engine)
from_vllm = greedy.generate({"prompt": prompts}).completion_lists
enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
model.eval()
with torch.no_grad(), rollout.unsharded(model):
    hf = model.generate(**enc, do_sample=False, max_new_tokens=12, eos_token_id=eos_ids,
                        pad_token_id=tokenizer.pad_token_id)[:, enc.input_ids.shape[1]:]
from_hf = rollout.completion_masks(hf, eos_ids, tokenizer.pad_token_id)
from_hf = [ids[:int(n)] for ids, n in zip(from_hf[0].tolist(), from_hf[1].sum(-1))]
report.update(greedy_vllm=from_vllm, greedy_hf=from_hf, greedy_equal=from_vllm == from_hf)
reports = [None] * world_size
if world_size > 1:
    torch.distributed.all_gather_object(reports, report)
else:
    reports = [report]
if rank == 0:
    with open(out_path, "w") as f:
        json.dump(reports, f)
generator.close()
distributed.shutdown()
