"""Metrics: what one optimizer step cost, in seconds, tokens and FLOPs (bytes: `memory/measure.py`).

Training FLOPs per token, from Kaplan et al. 2020 ("Scaling Laws for Neural Language Models",
section 2.1) and the Megatron-LM paper (Narayanan et al. 2021, appendix): a forward pass costs
2 FLOPs per parameter per token (one multiply, one add), backward twice that, so 6P; attention
over a context of T tokens adds 12·L·h·T (L layers, hidden size h). Model FLOPs utilisation
(MFU, PaLM paper, Chowdhery et al. 2022, appendix B) is the share of the hardware's peak that
those FLOPs represent: recomputation for activation checkpointing is not counted as useful work.
"""

import json
import os
from pathlib import Path

import torch

from minidist.runtime import tensorboard
from minidist.runtime.errors import UsageError
from minidist.runtime.tensorboard import TensorBoardLog

# Dense bf16 tensor-core peak in FLOP/s, from NVIDIA's data sheets (without sparsity), keyed by a part of the name
# CUDA reports. The H100's PCIe card shares the SXM module's name stem ("NVIDIA H100 PCIe" against "NVIDIA H100 80GB
# HBM3") at 756 against 989, so its key comes first: the lookup takes the first key found in the name.
PEAK_BF16_FLOPS = {"A100": 312e12, "H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12}


def flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_len: float) -> float:
    return 6 * num_params + 12 * num_layers * hidden_size * seq_len


def peak_flops(device: torch.device) -> float | None:
    """The bf16 peak of this GPU if we know it; None on the CPU or an unknown card (the table's first key in its name)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


class MetricsLog:
    """Append one JSON object per step to a file, flushed at once: a crash loses no step.

    `report_to="tensorboard"`: each record also goes to TensorBoard, in the file's folder
    (`runtime/tensorboard.py`); the file stays the source of truth, written first."""

    def __init__(self, path: Path, report_to: str = "none"):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "w", encoding="utf-8")  # noqa: SIM115 (open for the whole run: `close`)
        self.board = TensorBoardLog(path.parent / tensorboard.FOLDER) if report_to == "tensorboard" else None

    def write(self, record: dict) -> None:
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
            os.fsync(self.file.fileno())
        except OSError as err:  # a full disk: one line (rank 0 writes this; the others follow quietly: errors.py)
            raise UsageError(f"could not write {self.file.name}: {err.strerror}; free some space and run again "
                             f"with --resume") from err
        if self.board:
            self.board.write(record)

    def close(self) -> None:
        self.file.close()
        if self.board:
            self.board.close()


class StepRecorder:
    """One record per optimizer step, a line of `metrics.jsonl`: what the step did, took, held and
    sent, and on a GPU whose peak we know, its MFU (module doc). Built once per run with what stays
    the same: the model's size and shape, the device and the number of ranks."""

    def __init__(self, num_params: int, config, device: torch.device, world_size: int):
        self.num_params, self.config, self.device, self.world_size = num_params, config, device, world_size

    def record(self, step: int, loss: float, lr: float, grad_norm, step_time: float, lengths: list[int],
               memory: dict, comm_bytes: dict, token_counts: dict | None = None) -> dict:
        """Step `step`'s record. `lengths`: the token count of each sequence in the global batch;
        `memory`: every rank's figures (`memory/measure.py`, `gather`); `comm_bytes`: what this rank
        sent (`Strategy.take_comm_bytes`); `token_counts`: the real and padded tokens the data-
        parallel ranks computed and the padding's share (`step.step_token_counts`), when given."""
        tokens = sum(lengths)
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                  "step_time_s": step_time, "tokens": tokens, "tokens_per_s": tokens / step_time,
                  # the whole step's peak on the rank that used most (None: a CPU step not traced)
                  "peak_memory_bytes": None if None in memory["peak"] else max(memory["peak"]),
                  "memory_bytes": memory,  # per rank, lists by rank
                  # sent by this rank in the step, in all and within/across nodes (parallel/comm.py,
                  # parallel/across_nodes.py); None for --impl torch
                  **comm_bytes, **(token_counts or {})}
        peak = peak_flops(self.device)
        if peak:  # on a GPU we know: the share of the peak the model's own FLOPs reached
            mean_len = tokens / len(lengths)
            per_token = flops_per_token(self.num_params, self.config.num_hidden_layers, self.config.hidden_size,
                                        mean_len)
            record["mfu"] = record["tokens_per_s"] * per_token / (peak * self.world_size)
        return record


def format_step(record: dict, max_steps: int) -> str:
    line = (f"step {record['step']:>4}/{max_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"{record['step_time_s']:.2f} s | {record['tokens_per_s']:,.0f} tok/s")
    if "mfu" in record:
        line += f" | MFU {record['mfu']:.1%}"
    if record.get("peak_memory_bytes") is not None:
        line += f" | peak {record['peak_memory_bytes'] / 1e6:,.1f} MB"
    return line
