"""The GPU path's contract, read on the CPU: what one step may cost in collectives, key lengths and kernels over
[B, vocab]. Collective counts, tensor shapes and op counts are the same on a CPU as on a GPU, so each defect a
reading of the GPU path found has a counter here that fails when the defect is put back (docs/gpus.md 'On GPUs')."""

import collections
import contextlib
import json
import mmap
import os
import subprocess
import sys
import types
import warnings

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.tensor import DTensor
from transformers import Qwen2Config, Qwen2ForCausalLM

import rollout
import train
from plumbing import models
from step import data, forward, metrics
from test_train import cfg_for


@contextlib.contextmanager
def counted_gathers(monkeypatch):
    """FSDP2 parameter groups gathered (an all-gather each at world size > 1; a one-process group skips the
    collective itself, not the gather), by group: "root" or the first parameter's module path."""
    counts, unshard = collections.Counter(), FSDPParamGroup.unshard

    def counting(group, *args, **kwargs):
        pending = group._all_gather_result is not None or group.is_unsharded
        unshard(group, *args, **kwargs)
        if not pending and group._all_gather_result is not None:
            counts.update(["gathers"])

    monkeypatch.setattr(FSDPParamGroup, "unshard", counting)
    yield counts
    monkeypatch.undo()


def forward_backward(model, ids):
    model(input_ids=ids).logits.float().sum().backward()


# ------------------------------------------------------------------------------------------- the decode cache

@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_the_static_cache_belongs_to_compile_decode_alone_on_every_device(device_type):
    """A CUDA decode once always took the full-width StaticCache: attention then read capacity keys per token."""
    assert not rollout.static_cache(device_type, cfg_for(compile_decode=False))
    assert rollout.static_cache(device_type, cfg_for(compile_decode=True))


def test_at_decode_step_t_attention_sees_at_most_prompt_plus_t_plus_one_keys(monkeypatch):
    """Key length and key heads as the SDPA kernel gets them, with GQA (4 query heads, 2 key heads): L + t + 1 keys
    at the t-th one-token step; an unpadded batch keeps its 2 key heads (enable_gqa), a left-padded one needs a mask,
    with which transformers' SDPA path expands keys to the 4 query heads (repeat_kv; FlashAttention-2 through
    --model_init_kwargs attn_implementation avoids it on a GPU)."""
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def counting(query, key, value, *args, **kwargs):
        seen.append((query.shape[2], key.shape[1], key.shape[2]))
        return sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    config = Qwen2Config(vocab_size=16, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    cfg, T = cfg_for(max_completion_length=6), 6
    for ids, mask, heads in [([[3, 4, 5], [6, 7, 8]], [[1, 1, 1], [1, 1, 1]], 2),
                             ([[0, 4, 5], [6, 7, 8]], [[0, 1, 1], [1, 1, 1]], 4)]:
        seen.clear()
        with torch.no_grad():
            rollout.decode(model, torch.tensor(ids), torch.tensor(mask), cfg, [16], 0, torch.tensor([1, 2]))  # no EOS
        L, steps = len(ids[0]), [s for s in seen if s[0] == 1]
        assert len(steps) == T - 1
        assert [keys for _, _, keys in steps] == [L + t + 1 for t in range(T - 1)]
        assert {h for _, h, _ in steps} == {heads}


# ------------------------------------------------------------------------------------------- FSDP2 (bf16, one process)

IDS = torch.tensor([[1, 2, 3, 4, 5, 6]] * 2)


def test_all_gathers_per_forward_backward_are_the_same_before_and_after_a_generation(process_group, monkeypatch):
    """unsharded() gathers the policy once for a generation and must leave FSDP2's own settings behind: the root
    (embeddings, head, final norm) stays gathered from forward to backward, as before (it once resharded after every
    forward for the rest of the run: one extra all-gather per micro-batch). The first generation comes before the
    first training forward, as in train.py."""
    cfg, counts = cfg_for(bf16=True), []
    for generate_first in (False, True):
        model = models.prepare_model(data.embedded_task(seed=0)[0], cfg, trainable=True)
        for generation in ([generate_first, True]):
            if generation:
                with rollout.unsharded(model), torch.no_grad():
                    model(input_ids=IDS)
            with counted_gathers(monkeypatch) as count:
                forward_backward(model, IDS)
            counts.append(count["gathers"])
    assert counts[0] == 1 + 2 * 2  # the root once, each of the 2 layers in forward and again in backward
    assert set(counts) == {counts[0]}, counts


def test_a_frozen_model_holds_no_gathered_parameter_between_forwards(process_group):
    """The reference (and reward models) run no backward, so their FSDP2 root must reshard after forward: otherwise
    its embeddings and head stay gathered, full size, on every rank for the whole run."""
    ref = models.prepare_model(data.embedded_task(seed=0)[0], cfg_for(bf16=True), trainable=False)
    with torch.no_grad():
        ref(input_ids=IDS)
    assert all(isinstance(p, DTensor) for p in ref.parameters())
    # nor does the policy after a no-grad pass (the KL's old log-probs, LoRA's adapter-off reference): its root
    # stayed gathered into the next training step and the checkpoint (a modules_to_save head lost its key)
    model, tokenizer, _ = data.embedded_task(seed=0)
    cfg = cfg_for(bf16=True, max_completion_length=4)
    batch = rollout.generate(model, tokenizer, {"prompt": ["12="]}, cfg, torch.device("cpu"), seed=0)
    policy = models.prepare_model(model, cfg, trainable=True)
    forward.batch_logps(policy, batch, cfg)
    assert all(isinstance(p, DTensor) for p in policy.parameters())


def test_qlora_at_world_size_two_is_one_line():
    """A 4-bit base is neither sharded nor wrapped: nothing would all-reduce the adapters' gradients, and each rank
    would train its own."""
    cfg = cfg_for(model="some/model", use_peft=True, load_in_4bit=True)
    train.check_config(cfg, world_size=1)
    with pytest.raises(SystemExit, match="--load_in_4bit with 2 processes: .* run one process"):
        train.check_config(cfg, world_size=2)


# ------------------------------------------------------------------------------------------- the chunked head

def test_the_head_chunk_is_sized_by_the_device_and_its_gradient_sums_in_fp32(monkeypatch):
    """At the bench geometry (64 rows, V = 151,936) an H200's budget holds at least 16 positions of every row per
    chunk (a 64 MB budget gave 1: 257 chunks, each re-reading the head three times). Over 256 chunks the bf16 head
    gradient stays within 1.2x of the unchunked one's error against fp32 (summed in bf16 it was about 2x)."""
    assert forward.head_chunk_tokens(151_936, "cuda", 141 * 2**30) >= 64 * 16
    assert forward.head_chunk_tokens(151_936, "cpu") >= 16
    torch.manual_seed(0)
    V, H, b, T = 2048, 64, 4, 256
    weight, hidden = torch.randn(V, H) * 0.5, torch.randn(b, T + 1, H)
    targets, weights = torch.randint(0, V, (b, T)), torch.randn(b, T)

    def head_grad(dtype, tokens):
        monkeypatch.setattr(forward, "HEAD_CHUNK_ELEMENTS", tokens * V)
        head = torch.nn.Linear(H, V, bias=False, dtype=dtype)
        head.weight.data.copy_(weight)
        logps = forward.LogpsHead(targets, 1.0)
        logps.lm_head = head
        (logps(hidden.to(dtype))[..., 0] * weights).sum().backward()
        return head.weight.grad.float()

    exact = head_grad(torch.float32, b * T)
    errors = [(head_grad(torch.bfloat16, tokens) - exact).norm() / exact.norm() for tokens in (b * T, 4)]
    assert errors[1] <= 1.2 * errors[0], errors



@pytest.mark.parametrize("trained", [True, False])
def test_the_chunked_heads_backward_allocates_one_vocab_sized_gradient_or_none_when_frozen(trained, monkeypatch):
    """The head's backward over 8 chunks: a trained head sums its [V, H] gradient into one fp32 buffer (a [V, H]
    temporary per chunk was 8 more); a frozen head (LoRA's base) allocates none (it computed and dropped 9: 216 MB a
    step at SmolLM2's vocabulary). Counted as ops that return a new [V, H] tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode
    V, H, b, T = 512, 16, 2, 32
    monkeypatch.setattr(forward, "HEAD_CHUNK_ELEMENTS", 8 * V)  # 8 tokens a chunk: 8 chunks
    head = torch.nn.Linear(H, V, bias=False).requires_grad_(trained)
    logps = forward.LogpsHead(torch.randint(0, V, (b, T)), 1.0)
    logps.lm_head = head
    hidden = torch.randn(b, T + 1, H, requires_grad=True)
    out = logps(hidden)[..., 0].sum()

    class VocabSized(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            fresh = not func.is_view and not func.__name__.split(".")[0].endswith("_")  # new storage
            if fresh and isinstance(result, torch.Tensor) and result.shape == (V, H):
                VocabSized.count += 1
            return result

    with VocabSized():
        out.backward()
    assert VocabSized.count == int(trained)
    assert hidden.grad is not None and (head.weight.grad is not None) == trained


def test_the_chunked_heads_backward_recomputes_log_probs_not_the_entropy(monkeypatch):
    """The entropy is a metric (no gradient): the head's backward, which recomputes each chunk's logits, scores the
    log-probs only. Counted as ops that make a new [n, V] tensor: 8 a chunk (the logits, the logsumexp's softmax
    gradient, the gather's, their sum); recomputing the entropy too made 10, two passes over the vocabulary each
    chunk, on a GPU a memory-bound kernel over V = 152k each."""
    from torch.utils._python_dispatch import TorchDispatchMode
    V, H, b, T = 512, 16, 2, 32
    monkeypatch.setattr(forward, "HEAD_CHUNK_ELEMENTS", 8 * V)  # 8 tokens a chunk: 8 chunks
    logps = forward.LogpsHead(torch.randint(0, V, (b, T)), 1.0)
    logps.lm_head = torch.nn.Linear(H, V, bias=False)
    out = logps(torch.randn(b, T + 1, H, requires_grad=True))
    assert out[..., 1].gt(0).all()  # the forward still reports the entropy

    class VocabWide(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if isinstance(result, torch.Tensor) and result.shape[-2:] == (8, V) and not func.is_view:
                VocabWide.count += 1
            return result

    with VocabWide():
        out[..., 0].sum().backward()
    assert VocabWide.count == 8 * 8, VocabWide.count


def test_a_bf16_heads_gradient_sums_its_bf16_factors_into_fp32_in_one_gemm_a_chunk_on_cuda(monkeypatch):
    """The head's weight gradient, the largest GEMM of the backward (3.6e13 FLOP a 32k-token step of a 7B model with a
    152k vocabulary): on CUDA one addmm a chunk from the bf16 factors into the fp32 buffer (out_dtype), on tensor
    cores; fp32 copies of both factors ran it without them under the run's IEEE fp32 matmuls. Read as the ops and
    dtypes the backward dispatches, on the meta device standing in for CUDA (the CPU keeps the fp32 copies: it has
    no such kernel)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    V, H, b, T = 512, 16, 2, 32
    monkeypatch.setattr(forward, "HEAD_CHUNK_ELEMENTS", 8 * V)  # 8 tokens a chunk: 8 chunks
    monkeypatch.setattr(forward, "FP32_OUT_DEVICES", ("meta",))
    with torch.device("meta"):
        logps = forward.LogpsHead(torch.randint(0, V, (b, T)), 1.0)
        logps.lm_head = torch.nn.Linear(H, V, bias=False, dtype=torch.bfloat16)
        out = logps(torch.randn(b, T + 1, H, dtype=torch.bfloat16, requires_grad=True))[..., 0].sum()

    class Products(TorchDispatchMode):
        seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("mm", "addmm", "addmm_"):
                tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
                Products.seen.append((func.__name__, [str(t.dtype) for t in tensors]))
            return func(*args, **(kwargs or {}))

    with Products():
        out.backward()
    weight_grads = [dtypes for name, dtypes in Products.seen if name == "addmm.dtype_out"]
    assert weight_grads == [["torch.float32", "torch.bfloat16", "torch.bfloat16", "torch.float32"]] * 8
    assert not [p for p in Products.seen if p[0] != "addmm.dtype_out" and "torch.float32" in p[1]], Products.seen
    assert logps.lm_head.weight.grad.dtype == torch.bfloat16


def test_an_fp32_head_is_gathered_once_per_micro_batch_whatever_the_chunk_count(process_group, monkeypatch):
    """--cast_lm_head_to_fp32 makes the head an FSDP2 unit of its own: LogpsHead calls it once per micro-batch, so it
    is gathered once (kept to backward, as the root), not in forward and again in backward for every chunk (64
    all-gathers for 32 chunks), and a generation leaves it so."""
    _, tokenizer, _ = data.embedded_task(seed=0)
    config = data.embedded_task(seed=0)[0].config
    config.tie_word_embeddings = False
    cfg = cfg_for(bf16=True, cast_lm_head_to_fp32=True, max_completion_length=8)
    model = Qwen2ForCausalLM(config)
    batch = rollout.generate(model, tokenizer, {"prompt": ["12=", "345="]}, cfg, torch.device("cpu"), seed=0)
    model = models.prepare_model(model, cfg, trainable=True)
    counts = []
    for tokens in (10**6, 2, 2):  # one chunk, then 2-token chunks, then the same after a generation
        if len(counts) == 2:
            with rollout.unsharded(model), torch.no_grad():
                model(input_ids=IDS)
        monkeypatch.setattr(forward, "HEAD_CHUNK_ELEMENTS", tokens * config.vocab_size)
        with counted_gathers(monkeypatch) as count:
            logps, _, _, *_ = forward.forward_logps(model, batch, slice(None), 1.0)
            logps.sum().backward()
        counts.append(count["gathers"])
    assert counts == [1 + 2 * 2 + 1] * 3, counts  # the root, 2 layers in forward and backward, the head


@pytest.mark.parametrize("padding_free", [False, True])
def test_the_sharded_policy_returns_log_probs_that_are_no_view(process_group, padding_free):
    """FSDP2 hooks its pre-backward gather onto the root's outputs; on a view an in-place op would drop the hook, so
    it warns (every --bf16 or multi-GPU run printed "returned a view tensor ... wrong gradients"). LogpsHead's
    [b, T, C] is a tensor of its own, padded and packed."""
    model, tokenizer, _ = data.embedded_task(seed=0)
    cfg = cfg_for(bf16=True, max_completion_length=6)
    batch = rollout.generate(model, tokenizer, {"prompt": ["12=", "3456="]}, cfg, torch.device("cpu"), seed=0)
    model = models.prepare_model(model, cfg, trainable=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logps, *_ = forward.forward_logps(model, batch, slice(None), 1.0, padding_free=padding_free)
        logps.sum().backward()
    assert not [w for w in caught if "view" in str(w.message)], [str(w.message) for w in caught]
    assert all(p.grad is not None for p in model.parameters())


# ------------------------------------------------------------------------------------------- memory per phase

def test_each_timed_phase_reports_its_peak_memory_and_an_enclosing_phase_keeps_its_inner_peaks():
    """memory/<phase> beside time/<phase>: the most in use during the phase (the allocator's on a GPU, the resident
    set on a CPU), read at its ends and where note_memory() is called inside it; a phase nested in another (forward_backward in training)
    counts in the outer's peak, and a later, smaller phase reports its own."""
    timings = {}
    with metrics.timed(timings, "time/training"):
        with metrics.timed(timings, "time/forward_backward"):
            # 64 MiB of fresh pages, given back to the OS when closed (a freed tensor's may stay in the heap,
            # resident, after a long test session), read where the product reads a forward's activations
            # (pytest's high-water mark is far above them: only the reading can see them)
            big = mmap.mmap(-1, 64 * 2**20)
            for page in range(0, len(big), mmap.PAGESIZE):
                big[page] = 1
            metrics.note_memory()
            big.close()
        with metrics.timed(timings, "time/optimizer"):
            pass
    assert {"memory/training", "memory/forward_backward", "memory/optimizer"} <= set(timings)
    assert timings["memory/forward_backward"] >= timings["memory/optimizer"] + 48
    assert timings["memory/training"] >= timings["memory/forward_backward"]


@pytest.mark.parametrize("rows,syncs", [("distinct", 1), ("repeated", 3), ("colliding", 4)])
def test_the_host_syncs_of_finding_repeated_rows_are_the_ones_its_docstring_counts(rows, syncs, monkeypatch):
    """forward.distinct_rows runs before every training forward: its device-to-host reads (a unique's size, an
    item, a boolean mask's nonzero: each a sync on a GPU), counted as the ops that make them. All rows distinct:
    one (the unique's own size told them apart; a max of its inverse read a second); some repeat: three; a hash
    collision: four. Its docstring says these numbers (it said one or two)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    prompt_ids, completion_ids = torch.randint(0, 50, (8, 5)), torch.randint(0, 50, (8, 6))
    if rows != "distinct":  # row 1 repeats row 0
        prompt_ids[1], completion_ids[1] = prompt_ids[0], completion_ids[0]
    if rows == "colliding":
        monkeypatch.setattr(forward, "row_hashes", lambda key: torch.zeros(len(key), dtype=torch.long))
    batch = types.SimpleNamespace(prompt_ids=prompt_ids, prompt_mask=torch.ones(8, 5, dtype=torch.bool),
                                  completion_ids=completion_ids, completion_mask=torch.ones(8, 6, dtype=torch.bool))
    reads = {"_unique2", "unique_dim", "_local_scalar_dense", "nonzero"}

    class Syncs(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            masked = name == "index" and any(i is not None and i.dtype == torch.bool for i in args[1])
            Syncs.count += name in reads or masked
            return func(*args, **(kwargs or {}))

    with Syncs():
        found = forward.distinct_rows(batch, slice(0, 8))
    assert (found is None) == (rows == "distinct") and Syncs.count == syncs


def test_memory_figures_leave_out_a_colocated_engines_weights_and_kv_cache(monkeypatch):
    """With colocated sleep mode vLLM unmaps its weights and KV cache between samplings, yet their tensors stay
    allocated in torch's pool: every memory/* figure (and memory/run_peak) counted them. What the engine's start
    allocates and keeps is left out of them until it closes: they are the trainer's. The allocator stood in for by
    its figures (MiB): 1000 the trainer's before the engine, 3000 more the engine's, a 500 MiB training peak after."""
    stats = {"current": 1000 * 2**20, "peak": 1000 * 2**20}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: stats["current"])
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda: {"allocated_bytes": {"all": stats}})
    monkeypatch.setattr(metrics, "mark", lambda: 0.0)  # the host's clock, not a CUDA event
    monkeypatch.setattr(metrics, "ENGINE_BYTES", [0])
    with metrics.engine_start() as held:
        stats.update(current=4000 * 2**20, peak=4000 * 2**20)  # weights and KV cache, kept while it sleeps
    assert held == [3000.0] and metrics.memory() == (1000.0, 1000.0)
    timings = {}
    with metrics.timed(timings, "time/forward_backward"):
        stats.update(peak=4500 * 2**20)  # activations, freed by the end
    assert timings["memory/forward_backward"] == 1500.0 and metrics.run_peak() == 1500.0
    metrics.ENGINE_BYTES[0] = 0  # the engine closed
    assert metrics.memory() == (4000.0, 4500.0)


@pytest.mark.stack
def test_compile_decode_on_an_fsdp2_model_is_one_graph_over_two_generations(process_group, monkeypatch):
    """--compile_decode on the bf16 FSDP2 policy (2 layers, one process): the weights are gathered for the whole
    generation and the units run as plain modules, so the step is one Dynamo graph, not one per layer recompiled on
    each layer's index (FSDP2's hooks are dynamo-disabled), and a second generation of the same shape compiles
    nothing and decodes into the same StaticCache (CUDA graphs replay on the buffers they were recorded with)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    monkeypatch.setattr(rollout, "COMPILE_BACKEND", counter)
    torch._dynamo.reset()
    model, tokenizer, _ = data.embedded_task(seed=0)
    cfg = cfg_for(bf16=True, compile_decode=True, max_completion_length=6, num_generations=2)
    model = models.prepare_model(model, cfg, trainable=True)
    rows, caches = {"prompt": ["12=", "345="]}, []
    kv_cache = rollout.kv_cache
    monkeypatch.setattr(rollout, "kv_cache", lambda *args: caches.append(kv_cache(*args)) or caches[-1])
    for seed in (0, 1):
        rollout.generate(model, tokenizer, rows, cfg, torch.device("cpu"), seed=seed)
    assert counter.frame_count == 1, counter.frame_count
    assert len(caches) == 2 and caches[0] is caches[1]
    assert all(isinstance(p, DTensor) for p in model.parameters())  # resharded after each


@pytest.mark.stack
def test_compile_decode_takes_cuda_graphs_only_where_their_static_inputs_stay_put(process_group):
    """CUDA graphs replay on the addresses they were recorded on (cudagraph trees record again for a static input
    that moved). Two generations with an optimizer step between: a plain model's weights (updated in place) and its
    kept static cache stay put, so it gets mode reduce-overhead on a GPU; an FSDP2 model's gathered weights move at
    every generation (rollout.STATIC_INPUTS_MOVED counts it), so it is compiled without CUDA graphs."""
    cuda = torch.device("cuda")  # a device as data: nothing here touches a GPU
    moved = {}
    for bf16 in (False, True):  # one process: bf16 is FSDP2's mixed precision, fp32 a plain model
        model, tokenizer, _ = data.embedded_task(seed=0)
        cfg = cfg_for(bf16=bf16, compile_decode=True, max_completion_length=6, num_generations=2)
        model = models.prepare_model(model, cfg, trainable=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        before, held = rollout.STATIC_INPUTS_MOVED[0], []
        for seed in (0, 1):
            with torch.no_grad():  # the step between two generations, in place
                for p in model.parameters():
                    p.grad = torch.ones_like(p)
            optimizer.step()
            rollout.generate(model, tokenizer, {"prompt": ["12=", "345="]}, cfg, torch.device("cpu"), seed=seed)
            held += [torch.ones(p.shape) for p in model.parameters()]  # what training allocates meanwhile
        moved[bf16] = rollout.STATIC_INPUTS_MOVED[0] - before
        assert rollout.compile_mode(model, cuda)[0] == (None if bf16 else "reduce-overhead")
    assert moved[False] == 0 and moved[True] == 1, moved


@pytest.mark.stack
@pytest.mark.slow
def test_under_torchrun_only_rank_0_holds_the_full_weights_on_the_host_while_loading(tmp_path):
    """Rank 0 reads the directory; rank 1 builds the model on the meta device and receives its shard from rank 0
    (models.fill_from_rank0). Rank 1's resident set grows by at most its half and one tensor; every parameter and
    buffer (rotary inv_freq, which no state dict holds) equals the directory's on both ranks, and the tied head stays
    tied. Every rank reading the full fp32 model (put back) grows rank 1 by the whole model."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=24,
                         num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
                         eos_token_id=1, pad_token_id=0, bos_token_id=None)
    model_dir = tmp_path / "model"
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    data.embedded_task(seed=0)[1].save_pretrained(model_dir)  # any tokenizer whose ids fit 512
    full_mib = sum(p.numel() for p in LlamaForCausalLM(config).parameters()) * 4 / 2**20
    worker = os.path.join(os.path.dirname(__file__), "load_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", worker,
           str(tmp_path / "out"), "--model", str(model_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(2)]
    assert [r["unequal"] for r in ranks] == [[], []]
    assert all(r["tied"] for r in ranks)
    assert ranks[0]["grown_mib"] > 0.9 * full_mib  # the measure sees a full copy where there is one
    assert ranks[1]["grown_mib"] < 0.75 * full_mib, (ranks, full_mib)


@pytest.mark.slow
def test_a_whole_step_grows_by_well_under_the_logits_from_8_to_512_completion_tokens(smollm2_dir, tmp_path):
    """One LoRA step of train.py (generation, rewards, scoring, forward+backward, optimizer) with 2 completions of
    exactly 512 tokens through a 49k vocabulary peaks at most 0.6x their fp32 logits (192 MiB) above the same step
    with 8 tokens: no phase keeps a [b, T, V] tensor (the peaks are each phase's memory/<phase>). Measured: 81 MiB;
    345 MiB with the head's former 64 MB chunks (a chunk's backward holds five [n, V] arrays of that size)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model_dir = tmp_path / "model"
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    peaks = {}
    for tokens in (8, 512):
        out = tmp_path / f"run{tokens}"
        cmd = [sys.executable, os.path.join(os.path.dirname(os.path.dirname(__file__)), "train.py"),
               "--model", str(model_dir), "--dataset", os.path.join(os.path.dirname(__file__), "data",
                                                                     "addition.jsonl"),
               "--reward_funcs", "last_number_reward", "--num_generations", "2", "--per_device_train_batch_size",
               "2", "--max_completion_length", str(tokens), "--generation_kwargs", f'{{"min_tokens": {tokens}}}',
               "--use_peft", "--max_steps", "1", "--logging_steps", "1", "--save_strategy", "no",
               "--output_dir", str(out)]
        # a fixed mmap threshold: glibc returns each freed tensor at once, so the resident set follows the tensors
        # alive (its default keeps freed chunks of the head's size: +170 MiB of RSS at 512 tokens, no tensor)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        logged = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
        assert logged["completions/mean_length"] == tokens
        peaks[tokens] = max(v for k, v in logged.items() if k.startswith("memory/"))
    logits_mib = 2 * 512 * len(tokenizer) * 4 / 2**20
    assert peaks[512] - peaks[8] < 0.6 * logits_mib, (peaks, logits_mib)
