"""A profiler trace as a picture: one training step, what ran when, on the host and on the GPU.

`torch.profiler` records every operator the host runs (`cpu_op` events), the ranges a program
names with `record_function` (`user_annotation`), and on a GPU every kernel, copy and memset the
GPU ran (`kernel`, `gpu_memcpy`, `gpu_memset`), each with its start and duration. The Chrome trace
it exports holds all of them (open it in chrome://tracing or ui.perfetto.dev); the PNG drawn here
keeps the rows a lesson needs, each a row of bars over the step's time:

- the step's phases, the ranges the caller named (forward and backward, clipping, the optimizer);
- backward on the host: the autograd engine's functions; within forward and backward, the gaps
  between them are mostly forward;
- communication: the host's calls into c10d (gloo or NCCL), and on a GPU the NCCL kernels;
- copies: the host's `copy_` and casts, the GPU's memcpy and memset;
- the GPU's compute kernels.

The CPU rows show when the host issued the work (on the CPU, also when it was done), the GPU rows
when the GPU ran it. On a GPU the host runs ahead, queueing kernels, until something makes it
wait (a value read back, such as the gradient norm); a gap in the GPU's rows is the GPU waiting,
for the host or for a collective.
"""

import json
from pathlib import Path

import torch

COMM = ("nccl", "c10d::", "gloo", "all_gather", "allgather", "reduce_scatter", "all_reduce", "allreduce", "broadcast")
ROWS = ["CPU: step phases", "CPU: backward (autograd engine)", "CPU: communication calls", "CPU: copies",
        "GPU: compute kernels", "GPU: communication kernels", "GPU: memory copies and sets"]


def profile(step, device: torch.device, trace: Path, png: Path, phases: tuple) -> None:
    """Run `step` once under `torch.profiler` (CPU activities, and CUDA's on a GPU); write the
    Chrome trace to `trace` and its timeline to `png`. `phases` are the `record_function` names
    the step marks its parts with."""
    from torch.profiler import ProfilerActivity, profile as profiler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profiler(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the kernels the step queued belong in the trace too
    prof.export_chrome_trace(str(trace))
    draw(trace, png, phases)


def row_of(event: dict, phases: tuple) -> str | None:
    """Which row a trace event belongs to, by where it ran and what it is (None: no row)."""
    name, category = event.get("name", ""), event.get("cat", "")
    communication = any(word in name.lower() for word in COMM)
    if category in ("kernel", "gpu_memcpy", "gpu_memset"):  # what the GPU itself ran
        return ROWS[5] if communication else ROWS[4] if category == "kernel" else ROWS[6]
    if category == "user_annotation" and name in phases:
        return ROWS[0]
    if category != "cpu_op":
        return None  # CUDA runtime calls, the profiler's own step markers
    if name.startswith("autograd::engine::evaluate_function"):
        return ROWS[1]
    return ROWS[2] if communication else ROWS[3] if name in ("aten::copy_", "aten::_to_copy") else None


def draw(trace: Path, png: Path, phases: tuple) -> None:
    """The timeline of a Chrome trace as a PNG: one row of bars per kind of event (see above)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    rows = {row: [] for row in ROWS}
    for event in json.loads(Path(trace).read_text())["traceEvents"]:
        if event.get("ph") == "X" and (row := row_of(event, phases)):  # "X": an event with a duration
            rows[row].append(event)
    rows = {row: found for row, found in rows.items() if found}
    start = min(e["ts"] for found in rows.values() for e in found)
    fig, ax = plt.subplots(figsize=(14, 1 + 0.6 * len(rows)))
    for y, (row, found) in enumerate(reversed(rows.items())):
        spans = [((e["ts"] - start) / 1e3, max(e.get("dur", 0), 1) / 1e3) for e in found]  # ms, from µs
        if row == ROWS[0]:  # the phases, each its own colour and name
            for span, event in zip(spans, found):
                colour = f"C{phases.index(event['name'])}"
                ax.broken_barh([span], (y - 0.35, 0.7), color=colour, label=event["name"])
        else:
            ax.broken_barh(spans, (y - 0.35, 0.7), color="C7" if row.startswith("CPU") else "C3")
    ax.set_yticks(range(len(rows)), list(reversed(rows)))
    ax.set_xlabel("time in the step (ms)")
    ax.set_title(f"One training step ({Path(trace).name})")
    handles, labels = ax.get_legend_handles_labels()
    if handles:  # outside the axes, where it hides no bar
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
