"""Column- and row-parallel linears: one weight matrix, cut over the tensor-parallel ranks.

A linear layer computes y = x A^T, with A of shape (out, in). There are two ways to cut A over
n ranks so that no rank needs another's slice to do its matmul (Megatron-LM, section 3):

- **By columns of the output** (`ColumnParallelLinear`): rank r keeps rows r of A's out
  dimension, A_r of shape (out/n, in), and computes y_r = x A_r^T, its slice of y's last
  dimension. It needs the whole x; it sends nothing.
- **By rows of the input** (`RowParallelLinear`): rank r keeps A's columns r, of shape
  (out, in/n), and takes x_r, its slice of x's last dimension. x A^T = sum over r of x_r A_r^T,
  so each rank holds a partial sum of the whole y, and the ranks must add them up.

Chaining the two is what makes tensor parallelism cheap: a column-parallel linear's output is
already cut the way the next row-parallel linear wants its input, and whatever runs between them
element by element, or head by head (attention, the MLP's activation), needs no communication.
So a block costs one f at its entry and one g at its exit (`ops.py`), whatever it does inside.
The entry operator belongs to the block, not to each linear: attention's input feeds three
column-parallel linears (q, k, v), and its gradient is their sum, all-reduced once
(`llama.py`). The exit belongs to the row-parallel linear, the block's last.

Both are made from a full `nn.Linear` that every rank holds (the same checkpoint loaded on every
rank), keeping only this rank's slice, and keep PyTorch's names (`weight`, `bias`).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minidist.parallel.tensor import ops


def _slice(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's equal slice of `tensor` along `dim`, as a tensor of its own."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if tensor.shape[dim] % n:
        raise ValueError(f"cannot cut {tensor.shape[dim]} rows into {n} equal slices")
    return tensor.chunk(n, dim=dim)[rank].clone()


class ColumnParallelLinear(nn.Module):
    """y_r = x A_r^T (+ b_r): this rank's slice of the output features. Its input is already
    whole on every rank (the block's entry operator made it so); its output stays cut, for a
    row-parallel linear, or for a vocabulary-parallel loss (`vocab.py`)."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.group = group
        self.in_features, self.out_features = linear.in_features, linear.out_features // dist.get_world_size(group)
        self.weight = nn.Parameter(_slice(linear.weight.data, 0, group), linear.weight.requires_grad)
        self.bias = None if linear.bias is None else nn.Parameter(_slice(linear.bias.data, 0, group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (this rank's)"


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r A_r^T, then + b: this rank's slice of the input features, and the
    block's exit operator. Without sequence parallelism the sum is an all-reduce (g) and every
    rank ends with the whole y; with it, a reduce-scatter, and each rank keeps its chunk of the
    sequence. The bias is added once, after the sum, or it would be counted n times."""

    def __init__(self, linear: nn.Linear, group, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.in_features, self.out_features = linear.in_features // dist.get_world_size(group), linear.out_features
        self.weight = nn.Parameter(_slice(linear.weight.data, 1, group), linear.weight.requires_grad)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        cut = self.sequence_parallel and self.training  # eval mode: no sequence parallelism (llama.EnterBlock)
        y = (ops.reduce_scatter_sequence if cut else ops.reduce_from_tp)(partial, self.group)
        if self.bias is None:
            return y
        # Under sequence parallelism each rank adds the bias to its own chunk, so its gradient here
        # is this chunk's share: f sums the shares over the ranks, as every other rank's chunk used it too.
        return y + (ops.copy_to_tp(self.bias, self.group) if cut else self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this rank's), out_features={self.out_features}, "
                f"sequence_parallel={self.sequence_parallel}")
