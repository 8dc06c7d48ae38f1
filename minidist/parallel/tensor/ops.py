"""The conjugate operators of tensor parallelism: what crosses the ranks, forward and backward.

Tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", section 3) splits each weight matrix of a
layer over the `tp` ranks of a group, and every rank sees the same tokens. Two operators carry a
block's activations in and out of the split, and each is the other's mirror:

- **f**, at a block's entry (`copy_to_tp`): forward is the identity, every rank needs the whole
  input; backward is an all-reduce, because each rank's part of the block produced only its part
  of the input's gradient.
- **g**, at a block's exit (`reduce_from_tp`): forward is an all-reduce, since each rank holds a
  partial sum of the output; backward is the identity, because the sum's gradient with respect to
  each term is the output's gradient itself.

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4.2.2) keeps what lies between the blocks (the residual stream, the
norms) cut along the sequence instead of repeated on every rank. The all-reduce of g becomes a
reduce-scatter along the sequence, and f's identity an all-gather; their backwards swap the two:

- `gather_sequence` (the paper's g, taking f's place): all-gather forward, reduce-scatter
  backward;
- `reduce_scatter_sequence` (the paper's g-bar, taking g's place): reduce-scatter forward,
  all-gather backward;
- `split_sequence`: keep this rank's chunk forward, all-gather backward, where a full sequence
  enters the sequence-parallel region (`llama.py`: at the first layer).

An all-reduce is a reduce-scatter followed by an all-gather, so the two ways send the same
bytes; sequence parallelism saves memory, not traffic.

Every collective goes through `parallel/comm.py`, so the bytes are counted. The sequence is
dimension 1 of (batch, sequence, hidden), as in Hugging Face models, and must be a multiple of
the group's size.
"""

import torch

from minidist.parallel import comm

SEQUENCE_DIM = 1  # (batch, sequence, hidden)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over ranks, in a new tensor: a gradient handed to backward may be shared."""
    out = x.contiguous().clone()
    comm.all_reduce(out, group=group)
    return out


def _check_divides(x: torch.Tensor, n: int) -> None:
    if x.shape[SEQUENCE_DIM] % n:
        raise ValueError(f"sequence parallelism cuts the sequence into {n} equal chunks, but it has "
                         f"{x.shape[SEQUENCE_DIM]} tokens: pad the batch to a multiple of --tp_size")


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's chunk, concatenated along the sequence. `comm.all_gather` fills a flat buffer
    rank after rank (dimension 0), so the chunks are stacked first and laid side by side after."""
    n = torch.distributed.get_world_size(group)
    out = x.new_empty((n, *x.shape))
    comm.all_gather(out.view(-1), x.contiguous().view(-1), group=group)
    return torch.cat(out.unbind(0), dim=SEQUENCE_DIM)


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over ranks of `x`, of which this rank keeps its chunk of the sequence."""
    n = torch.distributed.get_world_size(group)
    _check_divides(x, n)
    chunks = torch.stack(x.chunk(n, dim=SEQUENCE_DIM))  # rank r's chunk at row r, as comm cuts it
    out = x.new_empty(chunks.shape[1:])
    comm.reduce_scatter(out.view(-1), chunks.view(-1), group=group, input_is_scratch=True)
    return out


def _split(x: torch.Tensor, group) -> torch.Tensor:
    n, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    _check_divides(x, n)
    return x.chunk(n, dim=SEQUENCE_DIM)[rank].contiguous()


class CopyToTensorParallel(torch.autograd.Function):
    """f: y = x on every rank. Each rank's part of the block uses y, so the loss L depends on x
    through all of them: dL/dx = sum over ranks r of dL_r/dy, an all-reduce."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)  # a new tensor for autograd, the same memory

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: y = sum over ranks r of x_r. dy/dx_r is the identity for every r, so each rank's x_r gets
    dL/dy unchanged, and every rank already holds it: nothing to send."""

    @staticmethod
    def forward(ctx, x, group):
        # x is the row-parallel matmul's fresh output, used nowhere else: summed in place, no copy
        # (mark_dirty tells autograd so).
        if not x.is_contiguous():
            return _all_reduce(x, group)
        comm.all_reduce(x, group=group)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherSequence(torch.autograd.Function):
    """y = [x_0, x_1, ..., x_{n-1}] along the sequence. Each rank's block then uses all of y, so
    dL/dy is a sum over ranks; rank r's x_r only needs its chunk of that sum: a reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group), None


class ReduceScatterSequence(torch.autograd.Function):
    """y_r = chunk r of (sum over ranks of x). Every x_s holds a whole sequence, and its gradient is
    dL/d(sum) there: the chunks every rank's y_r got, gathered."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group), None


class SplitSequence(torch.autograd.Function):
    """y_r = chunk r of x, where x is the same on every rank. x's gradient is its chunks' gradients
    side by side: each rank has its own, so they are gathered."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group), None


def copy_to_tp(x, group):
    """f: identity forward, all-reduce backward."""
    return CopyToTensorParallel.apply(x, group)


def reduce_from_tp(x, group):
    """g: all-reduce forward, identity backward."""
    return ReduceFromTensorParallel.apply(x, group)


def gather_sequence(x, group):
    """Sequence parallelism's f: all-gather forward, reduce-scatter backward."""
    return GatherSequence.apply(x, group)


def reduce_scatter_sequence(x, group):
    """Sequence parallelism's g: reduce-scatter forward, all-gather backward."""
    return ReduceScatterSequence.apply(x, group)


def split_sequence(x, group):
    """Into the sequence-parallel region: this rank's chunk forward, all-gather backward."""
    return SplitSequence.apply(x, group)
