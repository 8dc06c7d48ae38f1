"""Which rows of the GPU check run on this GPU: those whose estimate fits, with room to spare.

A row is built only when `memory.estimator`'s estimate of its setup (what `python -m
minidist.memory` prints for the same flags), plus a reserve for what the estimate leaves out,
is at most the GPU's memory. Otherwise the row says why, with both figures, and the check goes
on. So CodeLlama-7b's FSDP at world size 1 (134.8 GB by the estimate) runs on an H200 and is
skipped on an H100, and no row is lost to an out-of-memory error that the estimate foresaw.
"""

import torch

from minidist.memory.fit import RESERVE  # bytes the estimate does not count, the same room as a run's check


def skip_reason(estimate: float, gpu_memory: int | None) -> str | None:
    """Why a row whose setup is estimated at `estimate` bytes cannot run on a GPU of `gpu_memory`
    bytes (None: it can). No GPU, no gate: the smoke run's tiny rows always run."""
    if gpu_memory is None or estimate + RESERVE <= gpu_memory:
        return None
    return (f"skipped: estimate {estimate / 1e9:.1f} GB + {RESERVE / 1e9:.0f} GB reserve > "
            f"GPU {gpu_memory / 1e9:.1f} GB")


def gpu_memory(device: torch.device) -> int | None:
    """The GPU's memory in bytes, as the driver reports it; None on the CPU."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
