"""The path users run: a pretrained checkpoint loaded from a directory (SmolLM2-135M-Instruct, a Llama with
grouped-query attention, tied embeddings, a 49k vocabulary and a chat template; fixture `smollm2_dir`). What loading changes that a
model built in a test does not: eval mode, dropout rates in the config, the tokenizer's special tokens, the
precision the sampler runs in. Each run uses the fewest steps and tokens that show its point."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import rewards
import rollout
import train
from plumbing import models
from step import batches, forward, prompting
from rewards import RewardFunctions
from options.vllm_server import wait_for_server
from conftest import requires_vllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADDITION = os.path.join(ROOT, "tests", "data", "addition.jsonl")  # "What is a + b? Reply with only the number."
FILTERS = ["--temperature", "0.7", "--top_p", "0.9", "--top_k", "20", "--repetition_penalty", "1.1"]


def real_cfg(model_dir, *flags):
    return train.parse_config(["--model", str(model_dir), "--dataset", "unused", "--reward_funcs", "last_number_reward",
                               *flags])


def train_run(tmp_path, model_dir, *flags, steps=1):
    """train.py on the real model and the addition questions for `steps` steps of 8 completions; -> the metrics."""
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), "--model", str(model_dir), "--dataset",
         ADDITION, "--reward_funcs", "last_number_reward", "--num_generations", "4",
         "--per_device_train_batch_size", "8", "--max_completion_length", "8", "--max_steps", str(steps),
         "--logging_steps", "1", "--learning_rate", "1e-9", "--save_strategy", "no",  # 1.6 GB a checkpoint
         "--output_dir", str(tmp_path / "run"), *flags],
        capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.stack
def test_loaded_model_trains_in_train_mode_with_checkpointing_active(smollm2_dir):
    """from_pretrained hands over an eval-mode model, and Hugging Face layers checkpoint only in train mode: with
    --gradient_checkpointing the layers must run again in backward (recomputation), and only then."""
    model, _ = models.load_model(smollm2_dir)
    assert not model.training
    ids = torch.tensor([[1, 2200, 314, 253, 1345, 30, 2]])
    runs = {}
    for checkpointing in (True, False):
        m = models.prepare_model(AutoModelForCausalLM.from_pretrained(smollm2_dir) if not checkpointing else model,
                                 real_cfg(smollm2_dir, "--gradient_checkpointing", str(checkpointing)), True)
        assert m.training
        calls, mlp = [], m.model.layers[0].mlp
        forward = mlp.forward  # counted by wrapping: module hooks do not fire again when checkpointing recomputes
        mlp.forward = lambda *args, **kwargs: (calls.append(1), forward(*args, **kwargs))[1]
        logits = m(input_ids=ids, use_cache=False).logits
        logits.float().logsumexp(-1).sum().backward()
        runs[checkpointing] = (len(calls), logits.detach())
    assert runs[True][0] == 2 and runs[False][0] == 1  # forward + recomputation in backward; forward only
    torch.testing.assert_close(runs[True][1], runs[False][1], atol=0, rtol=0)  # the same function


def test_dropout_from_the_config_is_off_in_training(smollm2_dir):
    """Attention modules copy config.attention_dropout when they are built: zeroing the config afterwards is not
    enough. Two training-mode forwards of the same batch must give the same log-probs."""
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, attention_dropout=0.3)
    assert model.model.layers[0].self_attn.attention_dropout == 0.3
    model = models.prepare_model(model, real_cfg(smollm2_dir, "--gradient_checkpointing", "false"), True)
    model.train()
    ids = torch.tensor([[1, 2200, 314, 253, 1345, 30, 2, 216, 33, 34]])
    with torch.no_grad():
        first, second = (model(input_ids=ids).logits.log_softmax(-1) for _ in range(2))
    assert torch.equal(first, second)


def test_bf16_first_step_old_log_probs_equal_the_reference(smollm2_dir, process_group):
    """--bf16 in one process: FSDP2's mixed precision, as with N processes; sampling runs in bf16 with a bf16 KV cache,
    the reference is stored in bf16, and at the first step (policy == reference) the KL's old log-probs equal the
    reference's (bf16 kernels of another shape differ by ~0.04 nats/token: the sampler's own are not used as old
    log-probs in bf16)."""
    cfg = real_cfg(smollm2_dir, "--bf16", "true", "--num_generations", "2", "--per_device_train_batch_size", "4",
                   "--max_completion_length", "8", *FILTERS)
    model, tokenizer = models.load_model(smollm2_dir)
    ref = models.prepare_model(models.load_model(smollm2_dir)[0], cfg, trainable=False)
    model = models.prepare_model(model, cfg, trainable=True)
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}  # stored, not cast at every forward
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # master weights
    rows = {"prompt": [[{"role": "user", "content": "What is 2 + 3?"}], "The capital of France is"],
            "solution": ["5", "no number"]}
    dtypes = []
    hook = model.model.layers[0].mlp.register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))
    caches = []
    kv_cache = rollout.kv_cache
    rollout.kv_cache = lambda *args: caches.append(kv_cache(*args)) or caches[-1]
    try:
        batch = rollout.generate(model, tokenizer, rows, cfg, torch.device("cpu"), seed=0)
    finally:
        rollout.kv_cache = kv_cache
        hook.remove()
    assert set(dtypes) == {torch.bfloat16}  # the sampler ran in bf16 ...
    assert {layer.keys.dtype for layer in caches[0].layers} == {torch.bfloat16}  # ... with its keys in bf16
    scored = train.score(cfg, batch, RewardFunctions([rewards.last_number_reward]), model, ref, 0)
    mask = scored.loss_mask
    difference = ((scored.old_logps - scored.ref_logps).abs() * mask).sum() / mask.sum()
    assert difference <= 1e-3
    sampler = ((batch.sampler_logps - scored.ref_logps).abs() * mask).sum() / mask.sum()
    assert sampler > 1e-3  # what old log-probs from the bf16 sampler would have given (why they are not used)


def test_decode_loop_with_penalty_and_filters_records_the_trainers_log_probs(tmp_path, smollm2_dir):
    """fp32, T = 0.7, top-p, top-k, repetition penalty: the sampler's log-probs are log softmax(logits / T) of the
    unfiltered distribution, the trainer's, so at the first step the drift and the KL are ~0."""
    [metrics] = train_run(tmp_path, smollm2_dir, "--bf16", "false", *FILTERS)
    assert metrics["sampling/sampling_logp_difference/mean"] <= 1e-4
    assert abs(metrics["kl"]) <= 1e-4


@pytest.mark.stack
def test_string_prompts_get_the_tokenizers_bos_and_conversations_only_the_templates(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    question = "What is 2 + 3?"
    conversation = [{"role": "user", "content": question}]
    plain, chat = prompting.tokenize_prompts(tokenizer, [question, conversation])
    assert plain == tokenizer(question, add_special_tokens=False).input_ids  # SmolLM2 adds no BOS: none here
    templated = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    assert chat == list(templated["input_ids"] if hasattr(templated, "keys") else templated)  # TRL's ids
    tokenizer.bos_token, tokenizer.add_bos_token = "<|endoftext|>", True  # as Llama's, Gemma's, Mistral's do
    tokenizer.chat_template = "{{ bos_token }}" + tokenizer.chat_template  # ... and their templates write it
    bos = tokenizer.bos_token_id
    plain, chat = prompting.tokenize_prompts(tokenizer, [question, conversation])
    assert plain[0] == bos and plain[1:] == tokenizer(question, add_special_tokens=False).input_ids
    assert chat[0] == bos and chat.count(bos) == 1  # the template's BOS, and not a second one
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token  # as train.setup (5.17's GGUF: none)
    cfg = real_cfg(smollm2_dir, "--num_generations", "2", "--max_completion_length", "1")
    batch = rollout.generate(model, tokenizer, {"prompt": [question, "Hi"]}, cfg, torch.device("cpu"))
    first_real = batch.prompt_ids.gather(1, batch.prompt_mask.argmax(1, keepdim=True))  # after left padding
    assert first_real.flatten().tolist() == [bos] * 4


VLLM = ["--use_vllm", "--bf16", "false"]
COLOCATED = [*VLLM, "--vllm_kv_cache_memory_bytes", str(512 * 2**20)]  # 8,192 positions fit


@requires_vllm
def test_colocated_vllm_with_filters_gives_the_trainers_log_probs(tmp_path, smollm2_dir):
    """T = 1 with penalty and filters: a colocated engine reports raw log-probs, log softmax(logits) before them,
    which is log pi_T at T = 1; at T = 0.7 no vLLM mode is, so the trainer computes them: KL ~0 either way."""
    [at_t1] = train_run(tmp_path / "t1", smollm2_dir, *COLOCATED, *FILTERS[2:])
    assert at_t1["sampling/sampling_logp_difference/mean"] <= 1e-4 and abs(at_t1["kl"]) <= 1e-4
    [at_t07] = train_run(tmp_path / "t07", smollm2_dir, *COLOCATED, *FILTERS)
    assert "sampling/sampling_logp_difference/mean" not in at_t07  # vLLM reported nothing it could not
    assert abs(at_t07["kl"]) <= 1e-4  # was 0.62 per token with vLLM's filtered log-probs


@requires_vllm
def test_vllm_server_with_filters_gives_the_trainers_log_probs(tmp_path, smollm2_dir):
    from test_rollout import free_port, start_server

    port = free_port()
    server = start_server(smollm2_dir, port, extra=["--kv-cache-memory-bytes", str(512 * 2**20)])
    try:
        wait_for_server(f"http://127.0.0.1:{port}", timeout=400)
        [metrics] = train_run(tmp_path, smollm2_dir, *VLLM, "--vllm_mode", "server", "--vllm_server_port", str(port),
                              *FILTERS)
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
    assert "sampling/sampling_logp_difference/mean" not in metrics and abs(metrics["kl"]) <= 1e-4


@requires_vllm
def test_colocated_vllm_context_is_the_datasets_not_the_models_and_too_long_a_one_is_one_line(tmp_path, smollm2_dir):
    """The engine's context defaults to the longest prompt plus max_completion_length: SmolLM2 runs in the default
    256 MiB KV cache. Its full 8,192-token context in fp32 would need 384 MiB: asked for, it is one line that names
    both flags."""
    flags = ["--model", str(smollm2_dir), "--dataset", ADDITION, "--reward_funcs", "last_number_reward", "--use_vllm",
             "--bf16", "false", "--num_generations", "4", "--per_device_train_batch_size", "8",
             "--max_completion_length", "8", "--max_steps", "1", "--vllm_max_model_length", "8192"]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *flags, "--output_dir", str(tmp_path / "a")],
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "--vllm_max_model_length" in out.stderr and "--vllm_kv_cache_memory_bytes" in out.stderr
    [metrics] = train_run(tmp_path, smollm2_dir, "--use_vllm", "--bf16", "false")
    assert abs(metrics["kl"]) <= 1e-4


def random_batch(b, T, vocab, prompt_len=16):
    g = torch.Generator().manual_seed(0)
    completion_ids = torch.randint(0, vocab, (b, T), generator=g)
    return batches.Rollout(rows={}, prompt_ids=torch.randint(0, vocab, (b, prompt_len), generator=g),
                           prompt_mask=torch.ones(b, prompt_len, dtype=torch.long),
                           completion_ids=completion_ids, completion_mask=torch.ones(b, T, dtype=torch.long),
                           truncated=torch.ones(b, dtype=torch.bool),
                           completion_lists=completion_ids.tolist(), texts=[""] * b)


def logps_and_grads(model, batch, chunked):
    model.zero_grad(set_to_none=True)
    logps, entropy, _, *_ = forward.forward_logps(model, batch, slice(None), 0.9, chunked=chunked)
    (logps * torch.linspace(0.5, 1.5, logps.shape[1])).sum().backward()
    return logps.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.stack
def test_chunked_head_gives_the_full_logits_log_probs_and_gradients(smollm2_dir):
    """LogpsHead (the [b, T, V] logits never exist) against the model's own head: the same log-probs, entropies and
    gradients in fp32, on a real 49k vocabulary, tied embeddings and gradient checkpointing."""
    model = models.prepare_model(models.load_model(smollm2_dir)[0], real_cfg(smollm2_dir, "--bf16", "false"), True)
    batch = random_batch(2, 200, model.config.vocab_size)  # 200 positions: 2 chunks of 170 and 30
    chunked, full = logps_and_grads(model, batch, True), logps_and_grads(model, batch, False)
    torch.testing.assert_close(chunked[0], full[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked[1], full[1], atol=1e-4, rtol=0)
    for name, grad in full[2].items():
        torch.testing.assert_close(chunked[2][name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_training_forward_memory_is_bounded_well_below_the_logits(smollm2_dir):
    """4 completions of 1,024 tokens through SmolLM2's 49k vocabulary: the logits alone are 768 MiB in fp32, and the
    model's own head kept 4.4x that alive (peak 3,890 MiB, measured). Through LogpsHead the peak beyond the weights
    and their gradients stays under 0.6x the logits, so that the logits made whole even once fail it. Counted by
    torch's MemTracker (every tensor allocated), not by the process's RSS, so the bound is exact on a busy machine.
    The bound is the head's: SmolLM2 cut to its first 4 layers keeps it (measured: 551 MiB in all, the bound 785;
    all 30 layers: 1,253 MiB) and takes less time."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model = models.load_model(smollm2_dir)[0]
    model.model.layers = model.model.layers[:4]
    model.config.num_hidden_layers = 4
    model = models.prepare_model(model, real_cfg(smollm2_dir, "--bf16", "false"), True)
    batch = random_batch(4, 1024, model.config.vocab_size)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        logps, _, _, *_ = forward.forward_logps(model, batch, slice(None), 1.0)
        logps.sum().backward()
    (peak,) = [snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values()]
    weights = sum(p.numel() * 4 for p in model.parameters())
    logits = 4 * 1024 * model.config.vocab_size * 4
    assert peak < 2 * weights + 0.6 * logits, (peak / 2**20, weights / 2**20, logits / 2**20)
