"""The policy's weights as a push to a vLLM server sends them (vLLM's weight-transfer engines read
a WeightSource): the names, dtype and full shapes the server loads, LoRA merged and no tied
alias, declared without gathering a shard, then gathered one at a time on every rank."""

import functools

import torch

from options import lora


def policy_weights(model, dtype):
    """The policy's weights as the source vLLM's weight-transfer engines read: the names, dtype and
    full shapes the server loads (LoRA merged, no tied alias), declared without gathering, then
    gathered one at a time on every rank. vLLM >= 0.33: a WeightSource subclass (metadata a
    cached_property, the weights from iter_full); 0.32: the shape its engines call (metadata(),
    iteration)."""
    from vllm.distributed.weight_transfer import ParamMeta, WeightSource

    def declare():
        return [ParamMeta(name, dtype, shape) for name, shape in declared_shapes(model)]

    def gather():
        for name, tensor in lora.hf_full_weights(model, "parameters"):
            yield name, tensor.to(dtype)

    if hasattr(WeightSource, "iter_full"):
        class Source(WeightSource):
            api = "vLLM >= 0.33 WeightSource.iter_full"
            metadata = functools.cached_property(lambda self: declare())

            def declared(self):
                return self.metadata

            def iter_full(self):
                return gather()
        return Source()

    class Source0_32:
        api = "vLLM 0.32 metadata() and iteration"
        metadata = declared = staticmethod(declare)

        def __iter__(self):
            return gather()
    return Source0_32()


def declared_shapes(model):
    """(name, full shape) of each weight a push sends (LoRA merged, no tied alias), without
    gathering a shard."""
    params = ((name, torch.empty(p.shape, device="meta")) for name, p in model.named_parameters())
    return [(name, tuple(t.shape)) for name, t in lora.hf_weights(params, model)]
