"""Exercise 11: the backward of f, tensor parallelism's entry operator (lesson 11, `lessons/11_tensor_parallel.md`).

Fill in `backward` below, then check it from the repository root:

    MINIDIST_EXERCISE=lessons/exercises/11_tensor_parallel.py python -m pytest -q tests/course/test_exercises.py

Everything else is minidist's own: `ops.copy_to_tp` calls your class (the check puts it in the place
of `ops.CopyToTensorParallel`), and the block it enters is a column-parallel linear, an activation and
a row-parallel linear (`minidist/parallel/tensor/linear.py`), whose exit is g. The check runs on 2
gloo ranks, in float64: a linear layer, then f, then the block, on the same batch on every rank; and
the same network whole, in one process, beside it. It compares the gradient f hands back (the block's
input's, which the layer before the block then uses) and the bytes sent in backward. minidist's own
answer is `CopyToTensorParallel` in `minidist/parallel/tensor/ops.py`: read it after.
"""

import torch

from minidist.parallel import comm  # noqa: F401 (you will want it)

EXERCISE = "11_tensor_parallel"  # tells the check which exercise this file answers


class CopyToTensorParallel(torch.autograd.Function):
    """f: y = x on every rank of `group`, forward; what does backward owe x?"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)  # a new tensor for autograd, the same memory: nothing is sent

    @staticmethod
    def backward(ctx, grad):
        """Return the gradient of the loss with respect to x (and None for `group`, which has none).

        Derive it first. Every rank holds the same x, and passes it, unchanged, into its own slice of
        the block: its column-parallel linear's rows, the heads or the inner features that rank owns.
        The loss depends on x through every rank's slice, so by the chain rule dL/dx is the sum, over
        the ranks r, of what rank r's slice contributes. `grad`, here, is only this rank's term: the
        gradient that came back through the slice it holds.

        So: the sum of `grad` over the ranks of `ctx.group`, the same on every rank, and handed back as
        a new tensor (autograd may share `grad` with other parts of the graph; do not write into it).
        `comm.all_reduce(tensor, group=ctx.group)` sums a tensor over the ranks in place and counts the
        bytes it sends, as every collective in minidist does, so the lesson's byte tables can be checked.

        The usual mistakes: returning `grad` as it is (that is g's backward, f's conjugate), and
        averaging instead of summing (DDP averages copies of one gradient; these are parts of one sum).
        """
        raise NotImplementedError("CopyToTensorParallel.backward is yours to write (its docstring says how)")
