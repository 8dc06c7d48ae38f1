"""CPU offload (ZeRO-Offload): the optimizer's half of the model states in host memory, its step on the CPU.

Mixed-precision AdamW holds 16 bytes per parameter (`zero.py`): 2 for the bf16 weight, 2 for
its gradient, 12 for the fp32 master, m and v. Only the 4 bytes of weight and gradient are
needed by forward and backward on the GPU; the 12 are touched once per step, by the optimizer.
ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training",
USENIX ATC, section 4) keeps those 12 bytes, and the step that reads them, on the CPU, whose
memory is several times the GPU's and cheap. `--cpu_offload` does this for the hand-written
ZeRO-1, ZeRO-2 and FSDP (in FSDP's `Unit`, so an FSDP with a replicate group gets it by passing
`cpu_offload` to its wrapper):

    what                                   where     ZeRO-1/2 (bf16)        FSDP (bf16)
    model weights, compute dtype           device    2P (every rank)        2P/N (the shard, to gather)
    gathered units, activations, buckets   device    as without offload
    gradient of this rank's shard          host      ZeRO-2: 2P/N           4P/N (fp32)
      (ZeRO-1 keeps its whole flat gradient on the device, 2P, and copies its shard out at the step)
    fp32 master + Adam m, v                host      12P/N                  12P/N
    AdamW's step and its temporaries       host (the CPU computes them)

Per step each rank moves over PCIe (the host link, ~25 GB/s each way on an A100's Gen4 x16):
its shard's gradient device -> host (ZeRO-2: 2P/N bytes in bf16; FSDP: 4P/N, fp32) and its
updated shard host -> device (2P/N in bf16): `memory/offload_split.pcie_bytes`. CodeLlama-7b,
FSDP on 8 GPUs: 3.4 GB out and 1.7 GB back per rank and step, about 0.2 s at 25 GB/s. FSDP2's
`CPUOffloadPolicy`, PyTorch's reference, moves more: it copies the fp32 shard to the device at
every all-gather, two per step.

**When it pays off.** The GPU gives up the 12P/N bytes of masters and moments and the gradient
shard (ZeRO-2, FSDP), keeping the weights it computes with (ZeRO: 2P; FSDP: 2P/N), so the memory
freed goes to a larger batch or a model that did not fit (CodeLlama-7b, FSDP on one 80 GB GPU: 135
GB without offload, 17 GB with it and 135 GB of host memory, by the estimate). The price is the
CPU's AdamW (a few GB/s of fp32 states, against a GPU's ~1 TB/s) and the PCIe copies, per step and
independent of the batch: worth it when a step computes long (large batches, accumulation), not
when the step is already short. The copies are asynchronous: a gradient shard leaves as soon as
its reduce-scatter finishes (`accumulate_grad`), into pinned (page-locked) host memory that the
GPU's copy engine writes while backward goes on; the end of backward waits for them
(`wait_for_copies`) before the CPU reads them. The updated weights go back the other way
(`to_device`): cast to bf16 by the CPU into pinned memory, then sent without blocking, so bf16
is what crosses PCIe (a non-blocking copy straight from the fp32 master would send fp32 and cast
on the GPU). The CPU's AdamW runs on the rank's share of the node's cores
(`runtime/distributed.use_cores_for_offload`), not on the one thread torchrun leaves it.

**Where each tensor lives, on a CPU-only machine.** With no GPU both sides are the same memory,
so a tensor's device cannot say which side it would be on. Every host tensor is placed by this
module (`host_empty`, which `to_host` calls), and a measurement that needs to tell the two sides
apart subscribes to it (`on_host_placement`): `memory/sides.py` does, and splits a step's live
tensors by side from there.
"""

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

_copying = False  # an asynchronous copy to the host may still be running (`wait_for_copies`)
_host_placement_callbacks = []  # told of every host tensor `host_empty` places (`on_host_placement`)


def _pin() -> bool:
    """Pinned memory, so that copies to and from the GPU can be asynchronous; only with CUDA."""
    return torch.cuda.is_available()


def on_host_placement(callback) -> None:
    """Call `callback(tensor)` with every host tensor placed from now on, as soon as it is
    allocated. For measurement only (`memory/sides.py`): offloading itself never asks where a
    tensor is."""
    _host_placement_callbacks.append(callback)


def host_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor, pinned where there is a GPU to copy to and from."""
    out = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=_pin())
    for callback in _host_placement_callbacks:
        callback(out)
    return out


def to_host(t: torch.Tensor, dtype: torch.dtype | None = None, non_blocking: bool = False) -> torch.Tensor:
    """A host copy of `t` (always a copy, even on a CPU-only machine). non_blocking: the copy may
    still be running when this returns (on a GPU); read it only after `wait_for_copies`."""
    global _copying
    out = host_empty(t.shape, dtype or t.dtype)
    non_blocking = non_blocking and out.is_pinned() and t.device.type == "cuda"
    out.copy_(t.detach(), non_blocking=non_blocking)
    _copying = _copying or non_blocking
    return out


def to_device(out: torch.Tensor, master: torch.Tensor) -> None:
    """`out` (on the device, in the compute dtype) <- `master` (fp32, on the host), without blocking.

    The cast runs on the CPU, into a host buffer of `out`'s dtype (pinned where there is a GPU),
    and that buffer crosses PCIe: 2 bytes per parameter in bf16. A plain `out.copy_(master,
    non_blocking=True)` would not do this: PyTorch converts a non-blocking copy on the GPU, so it
    sends the 4 fp32 bytes and casts them in an fp32 temporary on the device (and a blocking copy,
    which casts on the CPU, stops the CPU until the copy is done).

    The copy is queued on the current stream, so what reads `out` there (an all-gather) runs
    after it, and it may still run when this returns. The CPU may write `master` at once: the
    copy reads the buffer. And it never writes into a buffer the copy engine still reads: this one
    is freed here, and PyTorch's pinned-memory allocator hands a freed buffer out again only once
    the copies recorded on it have finished. A buffer even where the dtypes match (fp32), so that
    the master itself is never in flight while the optimizer writes it."""
    staged = host_empty(master.shape, out.dtype)
    staged.copy_(master.detach())  # the cast, on the CPU
    out.copy_(staged, non_blocking=True)  # asynchronous from pinned memory; on a CPU-only machine, a plain copy


def wait_for_copies() -> None:
    """Wait for this stream's asynchronous copies (device -> host) before the CPU reads their results.
    Nothing to wait for (no copy started, or none on a GPU): it returns at once."""
    global _copying
    if _copying:
        torch.cuda.current_stream().synchronize()
        _copying = False


def accumulate_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    """A host parameter's `.grad` += a gradient computed on the device (the first one: copied
    out asynchronously; a second one is added at once, on the CPU)."""
    if param.grad is None:
        param.grad = to_host(grad, torch.float32, non_blocking=True)
    else:
        param.grad += to_host(grad, torch.float32)


class DeviceCopy:
    """The device's compute-dtype copy of a host master shard (FSDP: what each all-gather sends).

    Refreshed host -> device only when the master may have changed since the last copy: one copy
    per step however many times the unit is gathered (forward, backward, accumulation). Two
    signs of change: the master's version counter, which every in-place write bumps (a
    checkpoint's load, any optimizer), and a count of optimizer steps, kept by a hook that
    PyTorch calls after every `Optimizer.step` (`register_optimizer_step_post_hook`): a step
    taken under a `TorchDispatchMode` (the memory tracer, `measure.LiveTensors`) can leave the
    version counter as it was."""

    def __init__(self, master: torch.Tensor, device: torch.device, dtype: torch.dtype):
        _count_optimizer_steps()
        self.master = master
        self.tensor = torch.empty(master.numel(), dtype=dtype, device=device)
        self.seen = None  # (version, optimizer steps) at the last copy

    def get(self) -> torch.Tensor:
        now = (self.master._version, _optimizer_steps[0])
        if now != self.seen:
            to_device(self.tensor, self.master)  # cast on the host, sent in bf16; before the all-gather that reads it
            self.seen = now
        return self.tensor


_optimizer_steps = [0, None]  # steps taken by any optimizer in this process; the hook's handle


def _count_optimizer_steps() -> None:
    if _optimizer_steps[1] is None:
        def count(*_):
            _optimizer_steps[0] += 1
        _optimizer_steps[1] = register_optimizer_step_post_hook(count)
