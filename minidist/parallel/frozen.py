"""Frozen parameters in an FSDP unit: sharded and gathered like the rest, never reduced, never stepped.

With LoRA (`minidist/hf/lora.py`) a decoder layer holds both kinds: the frozen base weights
(`q_proj.base_layer.weight`, the norms, ...) and the trainable adapters (`lora_A`, `lora_B`).
A unit (`unit.py`) therefore lays its parameters out in two flats, each by its own
`flat.FlatLayout`:

    trainable  fp32 shard `flat_param` (the optimizer's), gathered in the compute dtype into a
               buffer that requires grad; its gradient is reduce-scattered after backward
    frozen     `FrozenFlat`: a shard kept in the compute dtype (bf16 under --mixed_precision bf16:
               it is never updated, so there is no fp32 master to keep), gathered into a buffer
               that does not require grad; it has no gradient, so nothing is reduced for it

Both are gathered before the unit's forward and again before its backward (backward needs the
frozen weights to pass the gradient down to the layer's input), and freed together when the
trainable flat's gradient has arrived (`Unit._post_backward`). That is late enough: autograd runs
ready operations latest-created first, and the split that makes the trainable views is created
before any of the layer's own operations, so its gradient comes after every backward operation
of the layer that reads a frozen weight (the parity tests would see a weight read after its
storage was freed). A unit with no trainable parameters has no such gradient: the root (the
embeddings, final norm and output layer, all frozen when only the layers are adapted) is freed
when the last layer's backward begins, as its own backward is over by then (`Unit.pre_backward`;
for CodeLlama-7b that is 262M parameters, 0.5 GB in bf16, not held through the whole backward);
a layer unit with nothing to train stays gathered until backward ends. Frozen
weights are not in `flats()` either: checkpoints hold the trainable state only, and a resumed
run reads the frozen base from the model folder, as the first run did.

Memory per rank for a unit of P_f frozen and P_t trainable parameters, N ranks, bf16: 2 P_f / N
for the frozen shard, 16 P_t / N for the trainable ones (4 + 4 + 8), and while gathered 2 (P_f +
P_t). Bytes per rank per step: two all-gathers of each flat, (P_f + P_t) x 2 (N-1)/N x 2 bytes,
and one reduce-scatter of the trainable flat only, P_t (N-1)/N x 4 bytes. PyTorch's FSDP2 does
the same with `requires_grad=False` parameters (they are all-gathered, their gradients not
reduced); FSDP1 needed `use_orig_params=True` for a unit that mixes the two.
"""

import torch

from minidist.parallel import comm
from minidist.parallel.flat import FlatLayout


class FrozenFlat:
    """One unit's frozen parameters: a shard in the compute dtype, and the full flat while gathered."""

    def __init__(self, params: list, dtype: torch.dtype, group, world_size: int, rank: int, device: torch.device,
                 load):
        self.layout = FlatLayout(params, world_size, rank)
        self.group = group
        # `load(layout, out)` is the unit's own loading (`unit.load_shard`): rank 0 flattens its
        # weights and sends shard r to rank r (the others may hold meta tensors), and under HSDP
        # the other copies receive theirs from the first.
        self.shard = torch.empty(self.layout.shard_numel, dtype=dtype, device=device)
        load(self.layout, self.shard)
        self.full = torch.empty(self.layout.padded_numel, dtype=dtype, device=device)
        self.free()
        self.handle = None

    def gather(self, side) -> None:
        """Start the all-gather of the full frozen flat on the unit's gather stream, `side`
        (`streams.SideStream`; asynchronous: `wait` finishes it)."""
        self.full.untyped_storage().resize_(self.layout.padded_numel * self.full.element_size())
        full, shard, group = self.full, self.shard, self.group
        self.handle = side.launch(lambda async_op: comm.all_gather(full, shard, group=group, async_op=async_op),
                                  full, shard)

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None

    def views(self) -> list[torch.Tensor]:
        return self.layout.views(self.full)

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)
