"""Gradient clipping, one function for every strategy and axis: the norm of the whole model's
gradient, with no rank ever holding the whole gradient.

Each rank holds pieces of the gradient: all of it (DDP), a shard (ZeRO, FSDP, FSDP2), a slice of
each cut matrix (tensor parallelism), one stage's parameters (a pipeline). The squared norm is a
sum of squares, so each rank sums the squares of its own pieces, and one all-reduce of that one
number over each group whose ranks hold different pieces adds them up: the data-parallel shard
group (where sharded), the tensor-parallel group, the pipeline's stages. The strategy names the
pieces and the groups (`Strategy.clip_grad_norm_`); this function does the arithmetic.

One catch: a parameter that the ranks of a group hold alike (a norm's weight, copied on every
tensor-parallel rank) would be counted once per rank by that group's sum. So each piece says
where in it such parameters lie, and their squares are counted `alike_share` times (1/T).
"""

import torch
import torch.distributed as dist

from minidist.parallel import comm


def alike_ranges(names_and_sizes, start: int, stop: int, alike) -> list[slice]:
    """Where the parameters that `alike(name)` says every rank of a group holds alike lie in
    [start, stop) of a flat buffer whose parameters (`names_and_sizes`: name, offset, number of
    elements) sit one after the other: slices of this rank's piece, which begins at `start`."""
    ranges = []
    for name, offset, numel in names_and_sizes:
        if not alike(name):
            continue
        lo, hi = max(offset, start), min(offset + numel, stop)
        if lo < hi:
            ranges.append(slice(lo - start, hi - start))
    return ranges


def clip_grad_norm_(pieces: list[tuple[torch.Tensor, list]], max_norm: float, groups=(),
                    alike_share: float = 1.0, device=None) -> torch.Tensor:
    """Clip by the norm of the whole model's gradient, each rank holding `pieces`: (gradient, where
    in it the parameters held alike lie, as indices), summed over each of `groups` (a single number
    each: not counted in the step's bytes). Returns the norm before clipping, a tensor on the
    device, as torch's `clip_grad_norm_` does: clipping needs no number on the host, so the CPU goes
    on queueing the optimizer step (the loop reads the norm with the loss, `runtime/host_syncs.py`)."""
    first = groups[0] if groups else None
    total = None
    for grad, alike in pieces:
        squares = grad.float().pow(2)
        part = squares.sum()
        if alike and alike_share != 1.0:
            part = part - (1 - alike_share) * sum((squares[index].sum() for index in alike), squares.new_zeros(()))
        part = part.to(comm.collective_device(grad, first))  # host shards (--cpu_offload) and device ones
        total = part if total is None else total + part
    if total is None:  # nothing to clip here (a rank whose pieces have no gradient yet)
        total = torch.zeros((), dtype=torch.float32, device=device)
    for group in groups:
        dist.all_reduce(total, group=group)
    norm = total.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # the same formula as torch's clip_grad_norm_
    with torch.no_grad():
        for grad, _ in pieces:
            grad.mul_(scale.to(grad.device, grad.dtype))
    return norm
