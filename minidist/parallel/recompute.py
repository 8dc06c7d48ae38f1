"""Activation checkpointing: recompute instead of store, one layer at a time.

Backward needs what forward computed: the input of every matmul, every normalisation, every
attention. Autograd keeps those *activations* alive from the forward pass until the backward
pass uses them, and for a transformer they grow with batch x sequence x layers: CodeLlama-7b
saves 193 MB per layer for one sequence of 1,024 tokens in bf16 (`python -m minidist.memory`
counts it tensor by tensor), 6.2 GB over its 32 layers, 49 GB for 8 such sequences: more than
its sharded model states on 4 GPUs (27 GB).

Checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost") keeps only
each layer's *input* (its checkpoint) and throws the rest away. When backward reaches the layer,
it runs the layer's forward again from that input, now recording, and backpropagates through
the recomputed activations at once. Memory: one hidden state per layer plus one layer's worth of
activations at a time, instead of all of them. Cost: one more forward per layer, about a third
more compute for a step (forward is 1/3 of forward + backward), so 33% more time at best.

`checkpoint_layers` wraps the `forward` of every module whose class is in `layer_classes` (the
decoder layers: the same classes FSDP makes units of). The recording and replay themselves are
PyTorch's non-reentrant `torch.utils.checkpoint`: during forward it installs saved-tensor hooks
that keep nothing, and when backward unpacks a tensor it reruns the forward (with the same random
state) to produce it.

Why wrap `forward` and not the module call: module hooks (FSDP's gather and free) run around
`forward`, outside the checkpoint. So when the recomputation runs inside backward it does not
fire FSDP's hooks again: FSDP has already all-gathered the unit for its backward (`fsdp.py`,
the pre-backward hook), and the recomputed forward reads the same gathered weights.
"""

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_layers(model: nn.Module, layer_classes) -> int:
    """Recompute every `layer_classes` module in backward instead of saving its activations.

    `layer_classes` are class names (`{"LlamaDecoderLayer"}`). Returns how many layers were
    wrapped; wrapping twice changes nothing."""
    wrapped = 0
    for module in model.modules():
        if type(module).__name__ in layer_classes and not getattr(module, "_checkpointed", False):
            # An instance attribute shadows the class's forward: only this module is affected.
            module.forward = functools.partial(_checkpointed, module.forward)
            module._checkpointed = True
            wrapped += 1
    if wrapped == 0:
        raise ValueError(f"no module of class {sorted(layer_classes)} in {type(model).__name__}: nothing to checkpoint")
    return wrapped
