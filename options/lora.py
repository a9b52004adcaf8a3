"""LoRA (Hu et al. 2021) through peft: the adapter on the policy, the reference as the same model
with the adapter off, and the merged weights W + (alpha / r) * B A that a generator or a saved model
needs.

With --use_peft only the adapter's A and B train (and get optimizer state); the base weights stay
frozen, so the reference policy is the base model: no second copy in memory. Checkpoints hold the
adapter only (the base comes from --model again), see plumbing/checkpoint.py.
"""

import os
import warnings
from contextlib import contextmanager

import torch

from plumbing import distributed
from plumbing.config import fail

# the adapted layers we merge: linear ones (full-precision and 4-bit), parameters (MoE experts)
ADAPTED = ("Linear", "Linear4bit", "ParamWrapper")
PREFIX = "base_model.model."  # peft's wrapping of the model's own parameter names


def settings(cfg):
    """The adapter's configuration as saved in trainer_state.json (export rebuilds the adapter from
    it)."""
    if not cfg.use_peft:
        return None
    targets = cfg.lora_target_modules
    return dict(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                target_modules="all-linear" if targets == ["all-linear"] else targets,
                target_parameters=cfg.lora_target_parameters,
                modules_to_save=cfg.lora_modules_to_save, use_rslora=cfg.use_rslora,
                use_dora=cfg.use_dora)


def add_adapter(model, lora_settings):
    """The policy with a fresh adapter: A random, B = 0, so at step 0 the policy is the base model
    exactly."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    try:
        with warnings.catch_warnings():
            # a trained tied head is saved untied (save_adapted), so peft's tying warning is moot
            warnings.filterwarnings("ignore", message="Model has `tie_word_embeddings=True`")
            model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora_settings))
    except (ValueError, TypeError) as e:  # no default targets, no module of that name, ...
        fail(f"cannot add a LoRA adapter: {str(e).splitlines()[0]}; name the layers with "
             "--lora_target_modules (e.g. q_proj v_proj, or all-linear), MoE experts with "
             "--lora_target_parameters")
    other = sorted({type(m).__name__ for m in model.modules()
                    if isinstance(m, LoraLayer) and type(m).__name__ not in ADAPTED})
    if other:
        fail(f"--lora_target_modules adapts {other} layers; only linear layers (and parameters, "
             "with --lora_target_parameters) are supported: name linear ones")
    return model


def is_adapted(model):
    return hasattr(model, "peft_config")


@contextmanager
def reference(model, ref_model):
    """The reference policy: the frozen copy, or with LoRA the policy itself with its adapter
    off."""
    if ref_model is not None:
        yield ref_model
        return
    with model.disable_adapter():
        yield model


def hf_weights(items, model):
    """(name, full tensor) pairs of the model's state dict -> the same in the base architecture's
    names: what vLLM and from_pretrained load. With an adapter each adapted weight or parameter
    becomes its merge (merged), the LoRA pieces are dropped, a module trained in full
    (modules_to_save) replaces the original and peft's prefixes are removed. Without an adapter the
    pairs pass through."""
    if not is_adapted(model):
        yield from items
        return
    plan, pending = merge_plan(model), {}  # state-dict name -> (merged weight's name, part, layer)
    for name, tensor in items:
        if ".original_module." in name:  # modules_to_save: its trained copy is the module
            continue
        if name not in plan:
            yield hf_name(name), tensor
            continue
        target, part, layer = plan[name]
        parts = pending.setdefault(target, {})
        parts[part] = tensor
        if len(parts) == (4 if layer.use_dora[layer.active_adapters[0]] else 3):  # all arrived
            yield hf_name(target), merged(layer, pending.pop(target))


def hf_name(name):
    """peft's state-dict name -> the base model's."""
    name = name.removeprefix(PREFIX).replace(".modules_to_save.default.", ".")
    while ".base_layer." in name:  # nested: a parameter wrapped once per adapted parameter
        name = name.replace(".base_layer.", ".")
    return name


def merge_plan(model):
    """For each adapted layer's weight W (a linear layer's, or the parameter a ParamWrapper adapts)
    and its A, B and DoRA magnitude: {state-dict name: (W's name, "W" | "A" | "B" | "m", layer)}."""
    names = {id(m): name for name, m in model.named_modules()}
    plan = {}
    for name, layer in model.named_modules():
        if not hasattr(layer, "lora_A") or not layer.lora_A:
            continue
        adapter = layer.active_adapters[0]
        if type(layer).__name__ == "ParamWrapper":
            weight = f"{names[id(layer.get_base_layer())]}.{layer.parameter_name}"
        else:
            weight = f"{name}.base_layer.weight"
        parts = {"W": weight, "A": f"{name}.lora_A.{adapter}.weight",
                 "B": f"{name}.lora_B.{adapter}.weight"}
        if layer.use_dora[adapter]:
            parts["m"] = f"{name}.lora_magnitude_vector.{adapter}.weight"
        plan.update({key: (weight, part, layer) for part, key in parts.items()})
    return plan


def merged(layer, parts):
    """W + scaling * B A in W's dtype (Hu et al. 2021, eq. 3; scaling alpha / r, or alpha / sqrt(r)
    with rsLoRA), computed in fp32. A ParamWrapper's A [r * E, in] and B [out, r * E] hold one
    rank-r pair per expert, merged into each expert's slice of the 3-d parameter (peft's
    ParamWrapper.get_delta_weight). DoRA (Liu et al. 2024, eq. 5): m * (W + dW) / ||W + dW||, the
    norm per output row."""
    W, A, B = parts["W"].float(), parts["A"].float(), parts["B"].float()
    scaling = layer.scaling[layer.active_adapters[0]]
    if getattr(layer, "num_experts", 1) > 1:
        A = A.reshape(layer.num_experts, -1, A.shape[-1])  # [E, r, in]
        B = B.reshape(B.shape[0], -1, layer.num_experts)  # [out, r, E]
        pattern = "o r e, e r i -> e o i" if layer._did_swap_in_out_features else \
            "o r e, e r i -> e i o"
        delta = torch.einsum(pattern, B, A) * scaling
    else:
        delta = (B @ A) * scaling
        if getattr(layer, "fan_in_fan_out", False):
            delta = delta.T
    weight = W + delta
    if "m" in parts:
        norm = torch.linalg.norm(weight if not layer.fan_in_fan_out else weight.T, dim=1)
        factor = (parts["m"].float() / norm).view(-1, 1)
        weight = weight * (factor if not layer.fan_in_fan_out else factor.T)
    return weight.to(parts["W"].dtype)


def trains_tied_head(model):
    """The output head trains apart from the input embeddings it is tied to (lm_head in
    --lora_modules_to_save, or adapted): the merged model's head is its own."""
    if not is_adapted(model):
        return False
    base = model.get_base_model()
    head = base.get_output_embeddings()
    tied = getattr(base.config.get_text_config(), "tie_word_embeddings", False)
    return bool(tied) and (hasattr(head, "modules_to_save") or hasattr(head, "lora_A"))


def save_adapted(model, state_dict, path):
    """Rank 0: the merged model in Hugging Face format at path, and the adapter alone (peft's
    format, for PeftModel.from_pretrained over the base) at path/adapter. A head trained apart
    from its tied embeddings is saved untied, or loading would tie the untrained one back."""
    model.save_pretrained(os.path.join(path, "adapter"), state_dict=state_dict)
    merged_state = dict(hf_weights(state_dict.items(), model))
    base = model.get_base_model()
    configs = untied_configs(base) if trains_tied_head(model) else []
    try:
        base.save_pretrained(path, state_dict=merged_state)
    finally:  # the live model stays as it was
        for config in configs:
            config.tie_word_embeddings = True


def untied_configs(model):
    """Set the model's config (and its text config) to untied embeddings; -> those changed."""
    text = model.config.get_text_config()
    configs = [model.config] + ([text] if text is not model.config else [])
    for config in configs:
        config.tie_word_embeddings = False
    return configs


def hf_full_weights(model, tensors="state_dict"):
    """full_weights in the base architecture's names; with LoRA, merged (lora.hf_weights)."""
    return hf_weights(distributed.full_weights(model, tensors), model)
