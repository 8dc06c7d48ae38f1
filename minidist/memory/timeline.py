"""Live bytes over one training step: the memory timeline, phase by phase, on any device.

`measure.LiveTensors` keeps a running count of the bytes of every tensor alive on this rank
(model states, buckets, gradients, activations, temporaries), as a GPU allocator would count
them, and remembers the highest. `MemoryTimeline` is the same counter, sampled: it notes
(seconds, live bytes) after every operator, every free and every storage resize, so the whole
curve of the step can be drawn, not only its top. The Ultra-Scale Playbook draws these curves
for a GPU from `torch.cuda.memory._record_memory_history`, which only a GPU has; this one runs
on gloo CPU ranks too. The peak of the curve is the peak `LiveTensors` reports: the samples are
taken exactly where it updates its peak.

`step_timeline` runs one step as named phases (forward, backward, optimizer step, zero_grad)
under the timeline, and returns the samples with each phase's start and end; `draw` puts the
curves of several strategies on one figure, each on its own step's time, normalised to 0..1,
because a step traced this way runs slower than an untraced one, and the
strategies' steps differ in length: what a reader compares is the shape and the heights.
"""

import time

import torch

from minidist.memory.measure import LiveTensors


class MemoryTimeline(LiveTensors):
    """`LiveTensors` that keeps every value its counter takes: `samples`, (seconds, bytes)."""

    def __init__(self, device: torch.device, *roots):
        super().__init__(device, *roots)
        self.samples: list[tuple[float, int]] = []
        self.t0 = None

    def _note(self) -> None:
        if self.t0 is not None:
            self.samples.append((time.perf_counter() - self.t0, self.current))

    def __enter__(self):
        entered = super().__enter__()  # counts what the roots hold: the step's starting point
        self.t0 = time.perf_counter()
        self._note()
        return entered

    def __exit__(self, *exc):
        self.t0 = None  # what is freed after the block is not part of the step
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self._note()  # after the operator's outputs are counted, where the peak is updated too
        return out

    def _follow(self, storage) -> None:
        super()._follow(storage)
        self._note()

    def _free(self, key) -> None:
        super()._free(key)
        self._note()


def step_timeline(device: torch.device, model, optimizer, phases: list) -> dict:
    """Run `phases`, a list of (name, function), one after the other under a `MemoryTimeline` of
    `model` and `optimizer`; return {"samples": [(s, bytes)], "phases": [(name, start, end)],
    "peak": bytes, "start": bytes at the start}."""
    marks = []
    with MemoryTimeline(device, model, optimizer) as live:
        t0 = live.t0
        for name, run in phases:
            start = time.perf_counter() - t0
            run()
            marks.append((name, start, time.perf_counter() - t0))
    return {"samples": live.samples, "phases": marks, "peak": live.peak, "start": live.samples[0][1]}


def draw(timelines: dict, png=None, title: str = "", scale: float = 1e6, unit: str = "MB"):
    """One row per strategy ({name: `step_timeline`'s result}): live bytes over its own step
    (time normalised to 0..1), the phases shaded and named, the peak marked. Saves to `png` if
    given; returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 1.2 + 1.7 * len(timelines)), sharex=True,
                             squeeze=False)
    top = max(t["peak"] for t in timelines.values()) / scale
    for ax, (name, t) in zip(axes[:, 0], timelines.items()):
        end = t["phases"][-1][2]
        for i, (phase, a, b) in enumerate(t["phases"]):
            ax.axvspan(a / end, b / end, color=f"C{i}", alpha=0.12, lw=0, label=phase)
        xs = [s / end for s, _ in t["samples"]]
        ys = [b / scale for _, b in t["samples"]]
        ax.step(xs, ys, where="post", color="black", lw=1.2, label="live bytes")
        peak_at = xs[ys.index(max(ys))]
        ax.plot([peak_at], [max(ys)], "v", color="C3", label="peak")
        ax.text(peak_at, max(ys), f" peak {max(ys):.1f} {unit}", va="bottom", fontsize=8)
        ax.set_ylim(0, top * 1.2)
        ax.set_ylabel(f"{name}\n({unit})")
    axes[-1, 0].set_xlabel("fraction of the step (each strategy on its own step's time)")
    handles, labels = axes[0, 0].get_legend_handles_labels()  # above the first row, below the title
    axes[0, 0].legend(handles, labels, loc="lower left", bbox_to_anchor=(0, 1.02), ncol=len(handles), fontsize=8,
                      frameon=False, borderaxespad=0)
    fig.suptitle(title, x=0.01, ha="left", fontsize=10)
    fig.tight_layout()
    if png is not None:
        fig.savefig(png, dpi=100)
    return fig
