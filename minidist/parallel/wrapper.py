"""What the hand-written data-parallel wrappers share, written once. Every one of DDP, ZeRO and
FSDP is a `DataParallelWrapper` and registers its hooks with `weak_hook`; DDP and ZeRO also pack
buckets and count gradients. (FSDP needs neither: its unit of communication is a layer, and a
unit's flat buffer tells it when the unit's backward is done.)

- **Start equal**: rank 0's parameters and buffers are broadcast to every rank when the model is
  wrapped (`broadcast_from_first_rank`; FSDP broadcasts its buffers only, and scatters the
  weights). Ranks may have initialised or loaded different weights.
- **Accumulate without talking**: inside `no_sync()` a backward pass only adds into the local
  gradients; the strategy's hooks look at `require_sync` and send nothing.
- **Buckets** (DDP, ZeRO): parameters are packed, in the order backward produces their gradients,
  into groups of about `bucket_cap_mb`, so that a few large messages replace many small ones
  (`pack_buckets`).
- **Every gradient arrives** (DDP, ZeRO): a hook per parameter counts the gradients of a
  backward; when the count is complete, the backward is over. A parameter that never gets one
  would stall the count, so the next forward names it (`GradientCount`).
- **Hooks that let go**: a hook stored on a tensor is held by PyTorch's C++ side, where Python's
  cycle collector cannot follow it. A hook that refers to its wrapper (a bound method does) would
  keep the wrapper alive for as long as the parameter lives, and with it the process group and
  the group's threads, into interpreter shutdown (see `distributed.py`, "Leaving cleanly"). So
  the wrappers register `weak_hook(self.method)`, which refers to the wrapper only weakly.

The flat layout that ZeRO and FSDP share, and its gathers and scatters, are in `flat.py`.
"""

import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from minidist.parallel import comm
from minidist.parallel.flat import Flat


class DataParallelWrapper(nn.Module):
    """The base of `ddp.py`'s, `zero.py`'s and `fsdp.py`'s wrappers: the model in `.module`, a
    process group, and `no_sync`."""

    def __init__(self, module: nn.Module, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.src = dist.get_global_rank(group, 0) if group is not None else 0  # the group's first rank
        self.require_sync = True

    @contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate local gradients; nothing is sent."""
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True

    @torch.no_grad()
    def broadcast_from_first_rank(self, tensors) -> None:
        """The group's first rank's `tensors` on every rank, in place. Once, at wrap time: not
        part of a training step's count."""
        for tensor in tensors:
            comm.broadcast(tensor.data, src=self.src, group=self.group)

    def flats(self) -> list[Flat]:
        """The flat shards this rank holds (ZeRO, FSDP), for checkpoints; none for DDP."""
        return []


def weak_hook(method):
    """`method` as a tensor hook that does not keep its object alive (see the module docstring)."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        target = ref()
        return None if target is None else target(*args)

    return hook


def pack_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Cut `params` (in order) into runs of at most `cap_bytes` (a larger parameter alone), starting
    a new one where the dtype or device changes: one collective carries one dtype on one device."""
    buckets, current, size = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > cap_bytes or p.dtype != current[0].dtype or p.device != current[0].device):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


class GradientCount:
    """Counts the parameters whose gradient arrived in this backward; says when all of them have.

    Like PyTorch's DDP with its default `find_unused_parameters=False`, every trainable parameter
    must get a gradient in every backward. One that does not leaves the count short, and the next
    forward says which ones."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], name: str):
        self.module, self.params, self.name = module, params, name
        self.arrived: set[int] = set()

    def add(self, param: nn.Parameter) -> bool:
        """Count `param`'s gradient; True when it was the last one of this backward (and restart)."""
        self.arrived.add(id(param))
        if len(self.arrived) < len(self.params):
            return False
        self.arrived.clear()
        return True

    def check_complete(self) -> None:
        """Raise if the last backward stopped short of some parameters (call before a forward)."""
        if self.arrived:
            missing = [n for n, p in self.module.named_parameters() if p.requires_grad and id(p) not in self.arrived]
            raise RuntimeError(f"{self.name}: the last backward gave no gradient to {missing[:3]}; every trainable "
                               "parameter must be used in the loss (freeze the others with requires_grad=False)")
