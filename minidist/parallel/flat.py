"""The flat layout ZeRO and FSDP share: many parameters in one padded buffer, cut into N shards.

Collectives move one contiguous tensor at a time, and each call has a start-up cost. So the
sharded strategies pack the parameters of a bucket (ZeRO) or a unit (FSDP) end to end into one
flat buffer, pad it with fewer than N zeros so that it splits into N equal shards, and give
rank r shard r:

    parameters  [ q.weight | k.weight | v.weight | ... ]           numel elements
    padded      [ ..................................... |0 0]       padded_numel = N x shard_numel
    shards      [ rank 0 ][ rank 1 ][ rank 2 ][ rank 3 ]           rank r: [r S, (r+1) S)

Each parameter is then a *view* of its slice of the full buffer: writing into the buffer (an
all-gather, say) writes the parameter, with no copy. This is the layout of PyTorch's FSDP1
(whose `FlatParameter` is the flat buffer itself, an `nn.Parameter`); here `FlatLayout` only
*describes* where things sit, and each strategy decides which tensors follow it.

A shard is cut as `torch.chunk` cuts: ceil(numel / N) elements per rank. So a checkpoint can
describe rank r's shard as rows [r S, (r+1) S) of the unpadded flat (`parallel/flat_state.py`).

The helpers below move whole flats between ranks for saving, loading and sharding a model that
only rank 0 has read: not training steps, so they are not counted in the step's bytes.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from minidist.parallel import comm
from minidist.parallel.comm import collective_device


class FlatLayout:
    """Where each of several parameters sits in one flat buffer, padded and cut into N shards."""

    def __init__(self, params: list[torch.Tensor], world_size: int, rank: int):
        self.shapes = [p.shape for p in params]
        self.offsets, offset = [], 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        self.numel = offset
        self.shard_numel = math.ceil(offset / world_size)
        self.padded_numel = self.shard_numel * world_size
        self.shard_slice = slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)

    def flatten(self, tensors, dtype=None) -> torch.Tensor:
        """One padded flat tensor holding `tensors` (in this layout's order)."""
        flat = torch.cat([t.detach().reshape(-1).to(dtype or t.dtype) for t in tensors])
        return nn.functional.pad(flat, (0, self.padded_numel - self.numel))

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's slice of `flat`, in its own shape: writing to one writes to `flat`.

        The pieces come from one `split`, not one slice each. It matters when autograd goes
        through them (FSDP's gathered unit): the gradient of a slice `flat[o:o+n]` is a zeroed
        tensor the size of the whole flat with n elements written into it, and k such gradients
        are then added, k full-size buffers for k weights; the gradient of a split is the pieces'
        gradients concatenated, once. PyTorch's FSDP1 makes its views the same way."""
        sizes = [shape.numel() for shape in self.shapes]
        pieces = torch.split(flat, [*sizes, flat.numel() - self.numel])  # the last piece: padding
        return [piece.view(shape) for piece, shape in zip(pieces, self.shapes)]

    def valid(self, rank: int) -> int:
        """How many of rank `rank`'s shard elements are real parameters (the rest is padding)."""
        return max(0, min(self.shard_numel, self.numel - rank * self.shard_numel))


@dataclass
class Flat:
    """One flat as a wrapper hands it out (`flats()`): to save, load, clip and gather it."""

    layout: FlatLayout
    shard: nn.Parameter  # this rank's fp32 shard: the master weights the optimizer updates
    names: list[tuple[str, ...]]  # the name(s) of each parameter in the layout (a tied one has several)

    @property
    def key(self) -> str:
        return self.names[0][0]


@torch.no_grad()
def gather_flat(layout: FlatLayout, shard: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's fp32 `shard` all-gathered: the whole flat, padded, on every rank."""
    device = collective_device(shard, group)  # a host shard (--cpu_offload) is gathered on the GPU under NCCL
    full = torch.empty(layout.padded_numel, dtype=torch.float32, device=device)
    dist.all_gather_into_tensor(full, shard.detach().to(device, torch.float32).contiguous(), group=group)
    return full


@torch.no_grad()
def scatter_flat(layout: FlatLayout, full: torch.Tensor | None, out: torch.Tensor, group=None) -> None:
    """The group's first rank's `full` (flat, padded or not) cut into shards; this rank's into `out`."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    chunks, device = None, collective_device(out, group)  # a host shard (--cpu_offload): through the GPU on NCCL
    if dist.get_rank() == src:
        padded = nn.functional.pad(full.float().reshape(-1), (0, layout.padded_numel - full.numel()))
        chunks = list(padded.to(device).chunk(layout.padded_numel // layout.shard_numel))
    received = torch.empty(layout.shard_numel, dtype=torch.float32, device=device)
    comm.scatter(received, chunks, src=src, group=group)
    out.copy_(received)


def gather_parameters(flats: list[Flat], keep: bool, group=None) -> dict[str, torch.Tensor]:
    """The fp32 weights by name, in CPU memory, on the ranks that `keep` them (the others get {}).

    Every rank calls it: all take part in each all-gather. One flat at a time is gathered on the
    device, copied out by the keeping ranks and let go before the next, so no rank ever holds
    more than one flat of the model on its GPU (CodeLlama-7b: one 0.8 GB layer, not 27 GB)."""
    full = {}
    for flat in flats:
        gathered = gather_flat(flat.layout, flat.shard, group)
        if keep:
            full.update(_cpu_copies(flat, gathered))
        del gathered  # gone before the next flat is gathered
    return full


def _cpu_copies(flat: Flat, gathered: torch.Tensor) -> dict[str, torch.Tensor]:
    """A CPU copy of each parameter of a gathered flat, under each of its names (a tied weight has
    several), as a plain state_dict holds them. copy=True: on a CPU rank `.cpu()` would hand back
    the view itself, keeping the whole gathered flat alive."""
    return {name: view.to("cpu", copy=True) for names, view in zip(flat.names, flat.layout.views(gathered))
            for name in names}


def clip_sharded_grad_norm_(shards: list[torch.Tensor], max_norm: float, group=None, also=()) -> torch.Tensor:
    """Clip by the norm of the whole gradient when each rank holds a shard of it: each rank sums
    the squares of its own elements (padding is zero), one all-reduce of one number adds them up;
    one more over each group `also` names (a pipeline's stages, each holding other parameters).
    Returns the norm as a tensor, as torch's `clip_grad_norm_` does: clipping needs no number on
    the host, so the CPU goes on queueing the optimizer step (the loop reads the norm at the step's
    end, with the loss: `runtime/host_syncs.py`)."""
    total = sum(g.float().pow(2).sum().to(collective_device(g, group)) for g in shards)  # host and device shards
    for each in (group, *also):
        dist.all_reduce(total, group=each)  # a single number: not counted in the step's bytes
    norm = total.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # the same formula as torch's clip_grad_norm_
    for g in shards:
        g.mul_(scale.to(g.device, g.dtype))
    return norm
