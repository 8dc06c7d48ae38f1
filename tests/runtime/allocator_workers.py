"""Worker functions for tests/runtime/test_allocator.py, run in each rank by `launch` (after
`init_distributed`, which sets up the heap for a CPU rank, or leaves it with MINIDIST_GLIBC_DEFAULTS=1)."""

import ctypes

import torch

from minidist.runtime.allocator import minor_page_faults


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2`: the heap's figures, in bytes."""

    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mmapped_bytes() -> int:
    """Bytes glibc holds in blocks of their own from `mmap` (mallinfo2's hblkhd)."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2().hblkhd


def remake_tensor(megabytes: int, rounds: int, measured: int) -> dict:
    """Make, fill and free a tensor of `megabytes` MB `rounds` times; return the page faults of each of
    the last `measured` rounds, and how many bytes glibc mapped with `mmap` for the first round's tensor.

    The first rounds may fault even with freed blocks kept: PyTorch's aligned request is a little
    larger than the block freed before it, and the heap grows until its free blocks fit (allocator.py)."""
    numel = megabytes * 2**20 // 4
    faults, mmapped, mmapped_before = [], None, _mmapped_bytes()  # blocks mapped before: not ours
    for round_ in range(rounds):
        before = minor_page_faults()
        tensor = torch.empty(numel)
        tensor.fill_(1.0)  # first touch of every page
        faults.append(minor_page_faults() - before)
        if mmapped is None:
            mmapped = _mmapped_bytes() - mmapped_before
        del tensor
    return {"faults": faults[-measured:], "mmapped_while_alive": mmapped, "pages": numel * 4 // 4096}


def fsdp_gather_faults(hidden_size: int, gathers: int, measured: int) -> dict:
    """Wrap a one-layer Llama `hidden_size` wide with the hand-written FSDP (a unit per layer: the
    layer's full flat buffer is one allocation), then gather and free the layer's unit `gathers` times,
    as forward and backward do every step; return this rank's page faults of each of the last
    `measured` gathers, and the unit's gathered size in bytes."""
    from transformers import LlamaForCausalLM

    from minidist.hf import models
    from minidist.strategy.options import ParallelOptions
    from minidist.strategy import get_strategy
    from minidist.runtime.distributed import get_env

    torch.manual_seed(0)
    config = models.tiny_llama_config(hidden_size=hidden_size, num_layers=1, num_heads=hidden_size // 64)
    strategy = get_strategy(ParallelOptions(impl="minidist", strategy="fsdp"), get_env())
    unit = strategy.wrap(LlamaForCausalLM(config)).layer_units[0]
    faults = []
    for _ in range(gathers):
        before = minor_page_faults()
        unit.gather()
        unit.wait()
        unit.full.data.sum()  # the gathered weights are read, as a forward reads them
        unit.free()
        faults.append(minor_page_faults() - before)
    return {"faults": faults[-measured:], "all_faults": faults, "unit_bytes": 4 * unit.layout.padded_numel}


def remake_then_gather(remake: dict, gather: dict) -> dict:
    """`remake_tensor(**remake)`, then `fsdp_gather_faults(**gather)`, in the same ranks: one start-up
    for both (a launch costs more than either). Both run with the heap set up alike (the project's
    settings), and what the first leaves in the heap can only spare the second faults it would have
    had anyway in its first, unmeasured gathers: with glibc's defaults each still maps its blocks
    afresh every time (test_allocator.py's docstring: run that way, the tests fail)."""
    return {"remake": remake_tensor(**remake), "gather": fsdp_gather_faults(**gather)}
