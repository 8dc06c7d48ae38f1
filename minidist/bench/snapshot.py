"""What the CUDA allocator holds: the reserved peak beside the allocated one, and a snapshot of one step.

`torch.cuda.max_memory_allocated` counts the bytes of live tensors, which is what the estimate
(`minidist.memory`) predicts. A job meets more: the caching allocator keeps freed blocks for
reuse and carves tensors out of larger segments, so what it has taken from the GPU,
`max_memory_reserved`, is what runs out first (and what `nvidia-smi` shows, plus the CUDA context
and NCCL's buffers). The gap between the two is fragmentation and cache; a row whose allocated
peak fits while its reserved peak does not is one a job will see fail.

Where the bytes go, moment by moment, the allocator can record itself: with
`torch.cuda.memory._record_memory_history` on, every allocation and free keeps its stack, and
`_dump_snapshot` writes them to a pickle that https://pytorch.org/memory_viz draws as the
timeline the Ultra-Scale Playbook shows (parameters, gradients, optimizer states and activations
as coloured bands). The functions are private in name but documented
(pytorch.org/docs/stable/torch_cuda_memory.html). Neither exists on the CPU: there both give None.

The stacks are Python's only (`stacks="python"`). By default the allocator records C++ frames too,
and symbolising them at the dump is what takes the time: torchtitan measured a snapshot's dump at
461 s with C++ stacks against 4 s with Python's (pytorch/torchtitan#3628), longer than a lent
GPU's whole call. The Python frames name the module and line that allocated, which is what the
viewer is read for.
"""

from pathlib import Path

import torch

VIEWER = "https://pytorch.org/memory_viz"
MAX_ENTRIES = 100_000  # allocations and frees kept: one step of a 1B Llama makes tens of thousands


def reserved_peak(device: torch.device) -> int | None:
    """The most bytes the caching allocator held since its peak counters were last reset (as
    `memory.measure.step_peak` does before the step it watches); None on the CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_reserved(device)


def record_step(step, device: torch.device, path: Path, max_entries: int = MAX_ENTRIES) -> Path | None:
    """Run `step` once with the allocator's history on and write its snapshot to `path`, for
    https://pytorch.org/memory_viz. The history is turned off again whatever the step does: left
    on, every later allocation would pay for its stack trace. None on the CPU (nothing written)."""
    if device.type != "cuda":
        return None
    from torch.cuda import memory

    memory._record_memory_history(max_entries=max_entries, stacks="python")  # module doc: not C++'s
    try:
        step()
        memory._dump_snapshot(str(path))
    finally:
        memory._record_memory_history(enabled=None)
    return Path(path)
