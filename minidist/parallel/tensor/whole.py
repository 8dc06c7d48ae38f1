"""A tensor-parallel model made whole again: its weights for the final model, and its gradient's norm.

Each rank of a tensor-parallel group holds a slice of every cut matrix (`llama.split_parameters`
names them, with the dimension each is cut along) and a copy of everything else (the norms). Two
things need the whole: the fine-tuned model written at the end, and the gradient's norm that
clipping scales by. Neither needs a rank to hold the whole model at once during training.
"""

import torch
import torch.distributed as dist

from minidist.parallel.flat import collective_device


def whole_weights(state: dict[str, torch.Tensor], cut: dict[str, tuple[int, int | None]], group) -> dict:
    """Every rank's slices of `state` (this rank's weights, by name, on the CPU) joined along the
    dimension each was cut, the vocabulary's padding dropped: the whole model's weights, on every
    rank of `group`, one tensor at a time. Outside any training step, so not counted as a step's
    bytes (`dist` directly, not `comm`)."""
    n = dist.get_world_size(group)
    whole = {}
    for name, tensor in state.items():
        if name not in cut:
            whole[name] = tensor
            continue
        dim, real = cut[name]
        device = collective_device(tensor, group)  # NCCL gathers GPU tensors only
        slices = tensor.to(device).contiguous()
        gathered = slices.new_empty((n, *slices.shape))
        dist.all_gather_into_tensor(gathered.view(-1), slices.view(-1), group=group)  # flat: as gloo wants
        joined = torch.cat(gathered.unbind(0), dim=dim)
        whole[name] = (joined if real is None else joined.narrow(dim, 0, real)).to(tensor.device)
    return whole


def replicated_ranges(names_and_sizes, start: int, stop: int, cut) -> list[slice]:
    """Where the parameters that every tensor-parallel rank holds alike lie in [start, stop) of a
    flat buffer whose parameters (`names_and_sizes`: name, offset, number of elements) sit one
    after the other: slices of this rank's piece, which begins at `start`."""
    ranges = []
    for name, offset, numel in names_and_sizes:
        if name in cut:
            continue
        lo, hi = max(offset, start), min(offset + numel, stop)
        if lo < hi:
            ranges.append(slice(lo - start, hi - start))
    return ranges


def clip_grad_norm_(pieces: list[tuple[torch.Tensor, list]], max_norm: float, tp_group, dp_group=None,
                    also=()) -> torch.Tensor:
    """Clip by the norm of the whole model's gradient, each rank holding `pieces`: (gradient,
    where in it the parameters every tensor-parallel rank holds alike lie, as indices).

    The squares of a cut parameter's slices add up over the tensor-parallel ranks; a copied one is
    on every rank, so summing over the group would count it T times: each rank counts 1/T of it.
    Then one all-reduce over the data-parallel group (where each rank holds a shard: FSDP) and one
    over the tensor-parallel group give the whole sum, on every rank. A single number each: not
    counted in the step's bytes; one more over each group `also` names (a pipeline's stages, each
    holding other layers). Returns the norm before clipping, a tensor, as torch's does."""
    t = dist.get_world_size(tp_group)
    total = None
    for grad, alike in pieces:
        squares = grad.float().pow(2)
        part = squares.sum() - (1 - 1 / t) * sum((squares[index].sum() for index in alike), squares.new_zeros(()))
        part = part.to(collective_device(grad, tp_group))
        total = part if total is None else total + part
    if dp_group is not None:
        dist.all_reduce(total, group=dp_group)
    dist.all_reduce(total, group=tp_group)
    for group in also:
        dist.all_reduce(total, group=group)
    norm = total.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # the same formula as torch's clip_grad_norm_
    for grad, _ in pieces:
        grad.mul_(scale.to(grad.device, grad.dtype))
    return norm
