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

On gloo CPU ranks there is no GPU, but there are threads: the main thread computes and *issues*
each collective (`c10d::allreduce_`, `c10d::_allgather_base_`: an asynchronous call returns at
once), and gloo's own worker threads *run* it, recorded as `gloo:all_reduce`, `gloo:all_gather`.
`cpu_lanes` sorts a CPU trace into those lanes (and the ranges the caller named), `draw_lanes`
draws them: a bar in the gloo lane under a bar of compute is communication overlapping compute.
`issued_before_compute_ends` and `ran_while_computing` put the two overlaps the lessons show into
numbers: bucketed DDP's all-reduces running while backward still computes, and FSDP's prefetch,
the next unit's all-gather issued before the current unit's forward is over.
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
    record(step, device, trace)
    draw(trace, png, phases)


def record(step, device: torch.device, trace: Path) -> Path:
    """Run `step` once under `torch.profiler` (CPU activities, and CUDA's on a GPU); write its
    Chrome trace to `trace`. Every thread is recorded: on the CPU, gloo's workers too."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profiler(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the kernels the step queued belong in the trace too
    prof.export_chrome_trace(str(trace))
    return Path(trace)


def mark_units(fsdp) -> None:
    """Name FSDP's work in the trace, without changing it: each layer unit's forward becomes a range
    `unit i forward` (a forward pre-hook put before FSDP's own, so the range covers all of the
    unit's turn: the wait for its weights, the prefetch FSDP issues, the compute), and each real
    gather a range `gather unit i` around the asynchronous all-gather call. `gather` is looked up on
    the unit instance by FSDP's hooks, so replacing it there sees every call."""
    from torch.autograd.profiler import record_function

    for i, unit in enumerate(fsdp.units):
        def gather(unit=unit, real=unit.gather, name=f"gather unit {i}"):
            if unit.state != "sharded":
                return real()  # already gathered or in flight: nothing is issued
            with record_function(name):
                real()
        unit.gather = gather
        if unit is fsdp.root:
            continue  # the root's forward holds the whole model's: no lane to read
        open_ranges = []
        unit.module.register_forward_pre_hook(
            lambda *_, name=f"unit {i} forward", ranges=open_ranges: ranges.append(record_function(name).__enter__()),
            prepend=True)
        unit.module.register_forward_hook(
            lambda *_, ranges=open_ranges: ranges.pop().__exit__(None, None, None) and None)


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


LANES = ("phases", "units", "compute (main thread)", "collectives issued (main thread)",
         "collectives running (gloo threads)")


def cpu_lanes(trace: Path, phases: tuple = (), unit_prefix: str = "unit ") -> dict[str, list[tuple]]:
    """The events of a CPU profiler trace by lane, each as (start ms, duration ms, name), the
    time from the first event kept:

    - phases: `record_function` ranges on the main thread whose name is in `phases`;
    - units: ranges whose name starts with `unit_prefix` (FSDP's units, marked by the caller);
    - compute: the main thread's outermost operators that hold no collective call. Autograd
      runs the hooks inside its functions (FSDP gathers a unit, and waits for it, in a hook of
      the function that needs it), so a function that holds a collective is split into its
      parts; the gradient accumulation (`AccumulateGrad`, where the DDP and ZeRO hooks copy
      into buckets and launch) is left out whole;
    - collectives issued: the main thread's calls into c10d (and the caller's `gather unit`
      ranges around FSDP's gathers, which name the unit);
    - collectives running: what gloo's threads ran (`gloo:...`).
    The main thread is the one that ran the most operators."""
    events = [e for e in json.loads(Path(trace).read_text())["traceEvents"] if e.get("ph") == "X"]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    tids = [e["tid"] for e in ops]
    main = max(set(tids), key=tids.count)
    lanes = {lane: [] for lane in LANES}
    kept = []
    for e in events:
        name, on_main = e.get("name", ""), e["tid"] == main
        if e.get("cat") == "user_annotation" and on_main and name in phases:
            kept.append((LANES[0], e))
        elif e.get("cat") == "user_annotation" and on_main and name.startswith(unit_prefix):
            kept.append((LANES[1], e))
        elif name.startswith("gloo:") and not on_main:
            kept.append((LANES[4], e))
        elif on_main and name.startswith(("c10d::", "gather " + unit_prefix)):
            kept.append((LANES[3], e))
    kept += [(LANES[2], e) for e in _compute(sorted((e for e in ops if e["tid"] == main),
                                                    key=lambda e: (e["ts"], -e.get("dur", 0))))]
    start = min(e["ts"] for _, e in kept)
    for lane, e in sorted(kept, key=lambda k: k[1]["ts"]):
        lanes[lane].append(((e["ts"] - start) / 1e3, e.get("dur", 0) / 1e3, e["name"]))
    return lanes


def _compute(ops: list[dict]) -> list[dict]:
    """The outermost of `ops` (sorted by start, longest first) that are compute: see `cpu_lanes`."""
    def is_comm(e):
        return e["name"].startswith("c10d::") or "AccumulateGrad" in e["name"]

    roots, stack = [], []  # the call tree: an event that starts inside another is its child
    for e in ops:
        node = {"e": e, "children": [], "comm": is_comm(e)}
        while stack and e["ts"] >= stack[-1]["e"]["ts"] + stack[-1]["e"].get("dur", 0):
            stack.pop()
        (stack[-1]["children"] if stack else roots).append(node)
        for parent in stack:
            parent["comm"] = parent["comm"] or node["comm"]
        stack.append(node)
    found, todo = [], roots[::-1]
    while todo:
        node = todo.pop()
        if not node["comm"]:
            found.append(node["e"])
        elif not is_comm(node["e"]):
            todo += node["children"][::-1]  # holds a collective: look inside
    return found


def span(lanes: dict, lane: str, name: str) -> tuple[float, float]:
    """(start, end) in ms of the first event called `name` in `lane`."""
    return next((s, s + d) for s, d, n in lanes[lane] if n == name)


def ran_while_computing(lanes: dict, phase: str = "backward") -> list[tuple[float, float]]:
    """The collectives gloo ran during `phase` that began before the phase's last compute
    ended: (start, end) of each. For bucketed DDP in backward, the buckets all-reduced while
    gradients were still being computed; for the naive DDP, none."""
    a, b = span(lanes, "phases", phase)
    last = max((s + d for s, d, _ in lanes[LANES[2]] if a <= s < b), default=a)
    return [(s, s + d) for s, d, _ in lanes[LANES[4]] if a <= s < last]


def issued_before_compute_ends(lanes: dict, pass_name: str = "forward") -> list[tuple[int, int]]:
    """FSDP's prefetch in numbers: (i, j) for each unit j whose gather (`gather unit j`) was
    issued while unit i's `pass_name` was still running, j != i. With prefetch every layer
    unit but the last gathers the next one; without, each unit gathers itself, in its own turn."""
    found = []
    for s, d, name in lanes[LANES[1]]:
        unit, _, what = name.removeprefix("unit ").partition(" ")
        if what != pass_name:
            continue
        for t, _, issued in lanes[LANES[3]]:
            j = issued.removeprefix("gather unit ")
            if issued.startswith("gather unit ") and j != unit and s <= t < s + d:
                found.append((int(unit), int(j)))
    return found


def draw_lanes(lanes: dict, png=None, title: str = "", phases: tuple = ()):
    """One row per non-empty lane of `cpu_lanes`; phases and units named on their bars. Saves
    to `png` if given; returns the figure."""
    import matplotlib.pyplot as plt

    rows = [lane for lane in LANES if lanes[lane]]
    total = max(s + d for lane in rows for s, d, _ in lanes[lane])
    fig, ax = plt.subplots(figsize=(12, 0.9 + 0.55 * len(rows)))
    colour = {LANES[2]: "C7", LANES[3]: "C1", LANES[4]: "C3"}
    label = {LANES[2]: "compute", LANES[3]: "collective issued", LANES[4]: "collective running (gloo)"}
    for y, lane in enumerate(reversed(rows)):
        for i, (s, d, name) in enumerate(lanes[lane]):
            if lane in (LANES[0], LANES[1]):
                c = f"C{phases.index(name) if name in phases else i % 10}"
                ax.broken_barh([(s, d)], (y - 0.38, 0.76), color=c, alpha=0.35)
                if d > 0.02 * total:  # a name only where it fits
                    ax.text(s + d / 2, y, name.replace(" forward", ""), ha="center", va="center", fontsize=7)
            else:
                ax.broken_barh([(s, max(d, 0.02))], (y - 0.38, 0.76), color=colour[lane],
                               label=label[lane] if i == 0 else None)
    ax.set_yticks(range(len(rows)), list(reversed(rows)), fontsize=8)
    ax.set_xlabel("ms from the first event of the step (rank 0)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    if png is not None:
        fig.savefig(png, dpi=100)
    return fig
