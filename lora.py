"""LoRA (Hu et al. 2021) through peft: the adapter on the policy, the reference as the same model
with the adapter off, and the merged weights W + (alpha / r) * B A that a generator or a saved model
needs.

With --use_peft only the adapter's A and B train (and get optimizer state); the base weights stay
frozen, so the reference policy is the base model: no second copy in memory. Checkpoints hold the
adapter only (the base comes from --model again), see checkpoint.py.
"""

import os
from contextlib import contextmanager

from config import fail

LINEAR = ("Linear", "Linear4bit")  # peft's adapted linear layers, full-precision and 4-bit
PREFIX = "base_model.model."  # peft's wrapping of the model's own parameter names


def settings(cfg):
    """The adapter's configuration as saved in trainer_state.json (export rebuilds the adapter from
    it)."""
    if not cfg.use_peft:
        return None
    targets = cfg.lora_target_modules
    return dict(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                target_modules="all-linear" if targets == ["all-linear"] else targets)


def add_adapter(model, lora_settings):
    """The policy with a fresh adapter: A random, B = 0, so at step 0 the policy is the base model
    exactly."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    try:
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora_settings))
    except ValueError as e:  # no default targets for this architecture, no module of that name
        fail(f"cannot add a LoRA adapter: {str(e).splitlines()[0]}; name the layers with "
             "--lora_target_modules (e.g. q_proj v_proj, or all-linear)")
    other = sorted({type(m).__name__ for m in model.modules()
                    if isinstance(m, LoraLayer) and type(m).__name__ not in LINEAR})
    if other:
        fail(f"--lora_target_modules adapts {other} layers; only linear layers are supported: "
             "name linear ones")
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
    names. With an adapter each adapted weight becomes W + scaling * B @ A (scaling = alpha / r),
    the LoRA pieces are dropped and peft's prefixes removed: what vLLM and from_pretrained load.
    Without an adapter the pairs pass through."""
    if not is_adapted(model):
        yield from items
        return
    layers = {name: module for name, module in model.named_modules() if hasattr(module, "lora_A")}
    pending = {}  # module name -> its weight, A and B until all three have arrived
    for name, tensor in items:
        separator = ".base_layer." if ".base_layer." in name else ".lora_"
        module_name, _, leaf = name.partition(separator)
        if module_name not in layers:
            yield name.removeprefix(PREFIX), tensor
            continue
        if leaf == "bias":
            yield module_name.removeprefix(PREFIX) + ".bias", tensor
            continue
        part = "W" if leaf == "weight" else leaf[0]  # "A.default.weight" -> "A"
        pending.setdefault(module_name, {})[part] = tensor
        if len(pending[module_name]) == 3:
            weight = merged(layers[module_name], pending.pop(module_name))
            yield module_name.removeprefix(PREFIX) + ".weight", weight


def merged(layer, parts):
    """W + scaling * B A in W's dtype (Hu et al. 2021, eq. 3), computed in fp32."""
    delta = (parts["B"].float() @ parts["A"].float()) * layer.scaling[layer.active_adapters[0]]
    if getattr(layer, "fan_in_fan_out", False):
        delta = delta.T
    return (parts["W"].float() + delta).to(parts["W"].dtype)


def save_adapted(model, state_dict, path):
    """Rank 0: the merged model in Hugging Face format at path, and the adapter alone (peft's
    format, for PeftModel.from_pretrained over the base) at path/adapter."""
    model.save_pretrained(os.path.join(path, "adapter"), state_dict=state_dict)
    merged_state = dict(hf_weights(state_dict.items(), model))
    model.get_base_model().save_pretrained(path, state_dict=merged_state)
