"""The models: loading a policy (Hub id or local directory; text or vision-language) or a reward
model, with the checks on what a model directory holds (its files, the weights against the config,
the token ids against the embedding), preparing the policy and the frozen reference for training
(dropout off, train or eval mode, gradient checkpointing, FSDP2 sharding under torchrun), the
optimizer, and the bf16 precision context.

Sampling from a model is rollout.py; the tiny embedded model is built in step/data.py with its task.
"""

import importlib.util
import os
import re
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard,
                                    register_fsdp_forward_method)
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText,
                          AutoModelForSequenceClassification, AutoProcessor, AutoTokenizer,
                          BitsAndBytesConfig, GenerationConfig, PreTrainedModel)

from plumbing import distributed, stack
from plumbing.config import fail
from step.forward import base_of
from plumbing.model_files import load_weights, model_dir_problem, token_id_problem


def load_pretrained(cfg, vision=False):
    """--model with --model_init_kwargs (dtype default fp32 master weights), --trust_remote_code and
    --load_in_4bit -> (model, tokenizer or, with vision, processor)."""
    init_kwargs = dict(cfg.model_init_kwargs or {})
    slow_cpu_kernel = not torch.cuda.is_available() and importlib.util.find_spec("kernels") is None
    if cfg.load_in_4bit and slow_cpu_kernel:
        print("rloo: note: bitsandbytes' fast CPU 4-bit kernel needs `pip install kernels`; "
              "without it 4-bit layers use a slower path", file=sys.stderr)
    if cfg.load_in_4bit:
        init_kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16 if cfg.bf16 else torch.float32)
    # under torchrun only rank 0 reads the weights; the others build the model on the meta device
    # and receive their shards from rank 0 (prepare_model), so no other rank holds a full copy
    on_meta = distributed.rank() > 0 and sharded(cfg)
    model, tokenizer = load_model(cfg.model, vision, init_kwargs, cfg.trust_remote_code, on_meta)
    if cfg.chat_template_path:  # TRL's: a Jinja file, or a tokenizer directory with a template
        tokenizer.chat_template = chat_template_from(cfg.chat_template_path)
    return model, tokenizer


def chat_template_from(path):
    """--chat_template_path: a Jinja file, or a tokenizer directory that has a template (a
    directory without one would leave the model's template silently unset)."""
    if os.path.isfile(path):
        with open(path) as f:
            return f.read()
    problem = model_dir_problem(path, needs=("tokenizer",))
    template = None if problem else AutoTokenizer.from_pretrained(path).chat_template
    if template is None:
        fail(f"--chat_template_path {path!r}: {problem or 'its tokenizer has no chat template'}; "
             "pass a Jinja file, or a tokenizer directory with chat_template.jinja")
    return template


def load_model(name, vision=False, init_kwargs=None, trust_remote_code=False, on_meta=False):
    """Causal LM and tokenizer from a local directory or the Hub, fp32 master weights unless
    init_kwargs sets the dtype; vision=True (a dataset with images): an image-text-to-text model and
    its processor; on_meta: the model's structure without its weights (meta tensors). A clear
    error when it cannot be found, is text-only or needs --trust_remote_code; a directory's files
    and the token ids are checked first (one line naming the directory and the file, not a
    traceback from deep inside transformers or generation)."""
    init_kwargs = init_kwargs or {}
    kwargs = {"dtype": torch.float32, "trust_remote_code": trust_remote_code, **init_kwargs}
    where = "model directory" if os.path.isdir(name) else "model"
    weights = not {"gguf_file", "variant"} & set(init_kwargs)  # other files than model.*
    problem = model_dir_problem(name, ("config", "tokenizer") + ("weights",) * weights)
    if problem:
        fail(f"{where} {name!r}: {problem}")
    auto_class = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    try:
        load = structure_only if on_meta else load_weights
        model, problem = load(auto_class, name, **kwargs)
        auto_tokenizer = AutoProcessor if vision else AutoTokenizer
        tokenizer = auto_tokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, ImportError, RuntimeError) as e:
        if vision and "Unrecognized configuration class" in str(e):
            fail(f"the dataset has images but {name!r} is a text-only model; use a "
                 "vision-language model (e.g. Qwen/Qwen2-VL-2B-Instruct, "
                 "HuggingFaceTB/SmolVLM-256M-Instruct) or drop the image column")
        if "trust_remote_code" in str(e):
            fail(f"{name!r} is defined by custom code in its repository; read it, then pass "
                 "--trust_remote_code")
        where = "local directory" if os.path.isdir(name) else "local directory or Hub model"
        fail(f"cannot load model {name!r} as a {where} with {kwargs}: "
             f"{str(e).strip().splitlines()[0]}")
    if vision and not hasattr(tokenizer, "image_processor"):
        fail(f"the dataset has images but {name!r} has no image processor "
             "(preprocessor_config.json); use a vision-language model or drop the image column")
    problem = problem or token_id_problem(name, model, getattr(tokenizer, "tokenizer", tokenizer))
    if problem:
        fail(f"{where} {name!r}: {problem}")
    # bitsandbytes 4-bit on CPU: an eval-mode forward (our sampling) repacks the weights in place,
    # and later gradients come out wrong
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model, tokenizer


def structure_only(auto_class, name, **kwargs):
    """The model from_pretrained would build, on the meta device: its config (and generation
    config) are read, its weights are not. -> (model, None)"""
    config_keys = ("trust_remote_code", "gguf_file", "revision", "subfolder")
    config = AutoConfig.from_pretrained(name, **{k: kwargs[k] for k in config_keys if k in kwargs})
    build_keys = ("dtype", "attn_implementation", "trust_remote_code")
    with torch.device("meta"):
        model = auto_class.from_config(config, **{k: kwargs[k] for k in build_keys if k in kwargs})
    if os.path.isfile(os.path.join(name, "generation_config.json")) or not os.path.isdir(name):
        try:  # what from_pretrained reads too (EOS and pad ids, sampling defaults)
            model.generation_config = GenerationConfig.from_pretrained(name)
        except OSError:
            pass
    return model, None


def load_reward_model(path):
    """A sequence-classification model and its tokenizer (right-padded: the model scores the last
    non-pad token), checked as the policy is: the directory's files, the weights against the
    config, the pad id. -> (model, tokenizer); a ValueError of one line naming the file."""
    problem = model_dir_problem(path)
    if problem:
        raise ValueError(problem)
    architectures = AutoConfig.from_pretrained(path).architectures or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(f"it is a {', '.join(architectures) or 'model'} with no "
                         "sequence-classification head (one would be initialised at random); "
                         "pass a reward model")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model, problem = load_weights(AutoModelForSequenceClassification, path, dtype=torch.float32)
    problem = problem or token_id_problem(path, model, tokenizer, generates=False)
    if problem:
        raise ValueError(problem)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


# What a model directory must hold, and the JSON files from_pretrained reads when they are there.
# The tokenizer: tokenizer.json (fast), or a vocabulary its tokenizer_config.json's class reads.
def disable_dropout(model):
    """Dropout off everywhere: it would make the sampler and the trainer different policies. Modules
    copy their rates at construction (an attention layer keeps its config's attention_dropout as
    its own), so setting the config afterwards changes nothing: zero the modules'
    own rates, and the configs for code that reads them at forward."""
    for name, module in model.named_modules():
        if "lora_dropout" in name:  # the adapter's own dropout is --lora_dropout's to set
            continue
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for owner in (module, getattr(module, "config", None)):
            for key, value in list(vars(owner).items()) if owner is not None else []:
                if "dropout" in key and isinstance(value, float):
                    setattr(owner, key, 0.0)


def sharded(cfg):
    """FSDP2 for N processes, and for one process under --bf16: its MixedPrecisionPolicy (bf16
    parameters and activations, fp32 master weights and gradients) is then the one precision scheme
    at every world size. Not for a 4-bit base, whose packed weights FSDP2 cannot shard (bitsandbytes
    computes in bf16 itself)."""
    wanted = distributed.world_size() > 1 or cfg.bf16
    return dist.is_initialized() and wanted and not cfg.load_in_4bit


def prepare_model(model, cfg, trainable, device=torch.device("cpu")):
    """Dropout off, train mode (from_pretrained returns a model in eval mode, and Hugging Face
    layers checkpoint only in train mode) with gradient checkpointing, or frozen in eval mode; on
    the device, FSDP2-sharded.

    Frozen weights under --bf16 are stored in bf16 (a reference, reward models, a LoRA base):
    autocast or a mixed-precision policy would cast them again on every forward. Sharded models go
    to the device one layer at a time, inside fully_shard, so no rank ever holds the whole model on
    its GPU."""
    disable_dropout(model)
    if trainable:
        model.train()
        if cfg.gradient_checkpointing:
            stack.enable_activation_checkpointing(model)
    else:
        model.requires_grad_(False).eval()
    head = lm_head_in_fp32(model) if cfg.cast_lm_head_to_fp32 else None
    head_params = set(head.parameters()) if head is not None else set()
    if cfg.bf16 and not cfg.load_in_4bit:
        for param in model.parameters():
            if not param.requires_grad and param.is_floating_point() and param not in head_params:
                param.data = param.data.to(torch.bfloat16)
    if not sharded(cfg):
        return model.to(device)
    # rank 0's weights (the others' are meta tensors: load_pretrained), in the dtype kept
    full_state = model.state_dict() if distributed.rank() == 0 else {}
    # Shard each decoder layer, then the root (embeddings, head, tied weights). Params and compute
    # in bf16, gradient reduction in fp32 (memory: docs/checkpoints.md 'Checkpoints, resume,
    # multi-node').
    options = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cfg.bf16 else None,
                                                  reduce_dtype=torch.float32))
    # params, grads and optimizer state live in CPU memory; the optimizer steps on the CPU
    if cfg.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    # the decoder layers' class names; a VLM's towers list their own
    layer_types = {name for m in model.modules() if isinstance(m, PreTrainedModel)
                   for name in getattr(m, "_no_split_modules", None) or ()}
    for module in model.modules():
        if type(module).__name__ in layer_types:
            fully_shard(module, **options)
    if head is not None:  # its own group: gathered and computed in fp32, kept from forward to
        # backward as the root's (LogpsHead calls it once per micro-batch)
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        fully_shard(head, **{**options, "mp_policy": fp32}, reshard_after_forward=not trainable)
    # the root keeps its weights gathered after forward for the backward that follows; a frozen
    # model has none, so its root reshards too (else its embeddings and head stay gathered)
    fully_shard(model, **options, reshard_after_forward=None if trainable else True)
    # the policy's generate() is a root forward too: VLMs encode images (in sharded towers); it is
    # registered before the root's own first forward, which must come first
    if trainable:
        register_fsdp_forward_method(model, "generate")
    if distributed.world_size() > 1:
        fill_from_rank0(model, full_state, device, cfg.cpu_offload)
    return model


def fill_from_rank0(model, full_state, device, cpu_offload=False):
    """Every rank's shards from rank 0's full state dict, one tensor at a time (torch's
    broadcast_from_rank0), and the buffers a state dict leaves out (rotary inv_freq). A rank with
    meta tensors gets storage first: its host never holds more than its shard and one tensor."""
    if any(p.is_meta for p in model.parameters()):  # offloaded shards live on the host
        model.to_empty(device=torch.device("cpu") if cpu_offload else device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full_state, options=options)
    for module in model.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = buffer.to(device)
                dist.broadcast(module._buffers[key], src=0)


def lm_head_in_fp32(model):
    """--cast_lm_head_to_fp32: the head's weights in fp32 and its input cast to fp32, so the logits
    are fp32 (as TRL's GRPO does). A head tied to the input embeddings would turn every activation
    fp32: refused."""
    base = base_of(model)
    if base.config.get_text_config().tie_word_embeddings:
        fail("--cast_lm_head_to_fp32 needs a model whose LM head is not tied to its input "
             "embeddings (tie_word_embeddings is true for this one); drop the flag")
    head = base.get_output_embeddings().float()
    head.register_forward_pre_hook(lambda module, args: (args[0].float(), *args[1:]))
    return head


NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)", re.IGNORECASE)


def make_optimizer(model, cfg):
    """AdamW with the Hugging Face Trainer's (so TRL's) groups: no weight decay on biases and
    normalisation weights. fused: one kernel over all parameters instead of a loop of small ops per
    tensor (6x faster step on CPU)."""
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for name, p in params if not NO_DECAY.search(name)],
               "weight_decay": cfg.weight_decay},
              {"params": [p for name, p in params if NO_DECAY.search(name)], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.learning_rate, fused=True,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)


def router_aux_coef(cfg, model):
    """Mixture-of-experts models whose forward computes the router's load-balancing loss
    (output_router_logits; Fedus et al. 2021, Switch Transformer eq. 4): its weight in the loss,
    --router_aux_loss_coef or the model config's. 0 for every other model (GLM-4-MoE balances
    its experts without one)."""
    text = model.config.get_text_config()
    has_loss = hasattr(text, "output_router_logits") and hasattr(text, "router_aux_loss_coef")
    if cfg.router_aux_loss_coef and not has_loss:
        fail(f"--router_aux_loss_coef {cfg.router_aux_loss_coef}: this model "
             f"({type(text).__name__}) computes no router load-balancing loss; drop the flag")
    if not has_loss:
        return 0.0
    return text.router_aux_loss_coef if cfg.router_aux_loss_coef is None else \
        cfg.router_aux_loss_coef


@torch.no_grad()
def sync_reference(cfg, model, ref_model, step):
    """TR-DPO (Gorbatovski et al. 2024), TRL's sync_ref_model: every ref_model_sync_steps optimizer
    steps, ref <- alpha * pi + (1 - alpha) * ref, shard by shard (both are sharded alike)."""
    if cfg.sync_ref_model and step % cfg.ref_model_sync_steps == 0:
        for ref, param in zip(ref_model.parameters(), model.parameters(), strict=True):
            ref.lerp_(param.to(ref.dtype), cfg.ref_model_mixup_alpha)  # ref + alpha (pi - ref)
