"""Mixed precision: compute in bf16, keep the truth in fp32.

A number in bf16 has fp32's 8 exponent bits (the same range, up to 3e38) but 7 mantissa bits
instead of 23: about 2-3 significant decimal digits, a relative rounding step of 2**-8 = 0.4%.
Matrix multiplies in bf16 run several times faster on tensor cores (an A100: 312 TFLOP/s bf16 vs
19.5 fp32; NVIDIA A100 datasheet) and their inputs take half the memory and bandwidth. Three
things must *not* be bf16 (Micikevicius et al. 2018, "Mixed Precision Training", ICLR):

- **The master weights.** An AdamW update is often smaller than 0.4% of the weight: added to a
  bf16 weight it rounds away and training stalls. So an fp32 copy is what the optimizer updates;
  the bf16 weights are made from it for each forward.
- **The optimizer states.** Adam's second moment is a running mean of squared gradients, which
  spans many orders of magnitude and changes by small fractions each step: kept in fp32 (4 + 4
  bytes per parameter, the figure every estimate here uses).
- **The gradient reduction.** Summing N bf16 gradients rounds after every addition; the sum over
  ranks is done in fp32 (`reduce_dtype`), and only then kept (a bf16 reduction, selectable with
  `--reduce_dtype bf16`, halves the bytes on the wire at the price of that rounding).

The loss and its softmax over the vocabulary are computed in fp32 too (`step.token_loss_sum`).
bf16 has fp32's range, so unlike fp16 it needs no loss scaling.

How each strategy applies the policy (one `MixedPrecision`, three mechanisms):

- DDP (`ddp.py`): the model keeps fp32 parameters, which are the masters; `torch.autocast` runs
  the matmuls in bf16 (`autocast` below, which `Strategy.autocast` enters around the forward
  only, for both DDPs: `step.token_loss_sum`). Backward needs no context of its own: autograd
  runs each operator's backward in the dtype its forward ran in, so the matmuls' gradients are
  bf16 too. Gradients come out fp32 (the parameters' dtype); buckets are reduced in
  `reduce_dtype`.
- ZeRO-1/2 (`zero.py`): the model's parameters become bf16 (2 bytes each, what the ZeRO paper
  counts), and each rank keeps an fp32 master copy of its shard only, in the optimizer. After the
  step, the updated shards are cast to bf16 and all-gathered.
- FSDP (`fsdp.py`): the sharded flat parameter is the fp32 master; each unit is all-gathered in
  bf16, so the gathered weights and the communication are half the size, and gradients are
  reduce-scattered in `reduce_dtype` into the fp32 gradient shard. PyTorch's FSDP2 calls this
  `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`.

It all runs on a CPU too: PyTorch has bf16 kernels for CPU matmuls (slow, but the numerics are
the same), which is how the tests hold bf16 runs to fp32 ones.
"""

from contextlib import nullcontext
from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class MixedPrecision:
    """What dtype the forward and backward compute in, and what dtype gradients are summed in.

    The master weights and the optimizer states are always fp32."""

    param_dtype: torch.dtype = torch.float32  # the weights as forward and backward see them
    reduce_dtype: torch.dtype = torch.float32  # gradients as they travel between ranks

    @property
    def enabled(self) -> bool:
        return self.param_dtype != torch.float32


def policy(mixed_precision: str = "fp32", reduce_dtype: str | None = None) -> MixedPrecision:
    """The policy for `--mixed_precision fp32|bf16` and `--reduce_dtype fp32|bf16` (default fp32)."""
    for flag, value in (("--mixed_precision", mixed_precision), ("--reduce_dtype", reduce_dtype or "fp32")):
        if value not in DTYPES:
            raise ValueError(f"{flag} must be one of {', '.join(DTYPES)}, got {value!r}")
    return MixedPrecision(DTYPES[mixed_precision], DTYPES[reduce_dtype or "fp32"])


def autocast(mp: MixedPrecision, device: torch.device):
    """For a model that keeps fp32 parameters (DDP): run matmuls in `param_dtype` under autocast."""
    if not mp.enabled:
        return nullcontext()
    return torch.autocast(device.type, dtype=mp.param_dtype)


def reduction_dtype(grad_dtype: torch.dtype, mp: MixedPrecision) -> torch.dtype:
    """The dtype a gradient is summed in: `reduce_dtype`, but never narrower than the gradient
    itself unless bf16 was asked for (fp64 runs, which the tests use, stay fp64)."""
    if mp.reduce_dtype == torch.float32:
        return torch.promote_types(grad_dtype, torch.float32)
    return mp.reduce_dtype


def for_reduction(grad: torch.Tensor, mp: MixedPrecision) -> torch.Tensor:
    """The gradient in the dtype it is summed in (the tensor itself when it already is)."""
    return grad.to(reduction_dtype(grad.dtype, mp))
