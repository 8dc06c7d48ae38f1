"""Lesson 00's drawing helpers and its memory calculator, imported by `notebooks/00_memory.ipynb`.

They live in a module, not in a notebook cell, so that no later cell can break them: a cell that
names a loop variable `label`, or sets `COLORS` to something else, changes the notebook's names,
never this module's. The calculator's callback runs long after the cell that drew it, on every
change of a control, and finds here exactly the helpers it was written against.

Nothing here estimates a byte of its own: the bars and the text are `minidist.memory.estimator`'s
and `minidist.memory.report`'s.
"""

import ipywidgets as widgets
import matplotlib.pyplot as plt

from minidist.memory import estimator, report
from minidist.memory.estimator import GB
from minidist.strategy.options import STRATEGIES

GPU = 80e9  # an A100-80GB, as `--gpu_memory 80GB` counts it (8e10 bytes; ~5 GB left for CUDA and NCCL)

# One colour per term that `moments.py` names, in whichever moment it appears, and the weight copies the
# measured bars of section 4 split out of the activations.
COLORS = {"parameters": "tab:blue", "gradients": "tab:orange", "optimizer_states": "tab:green",
          "accumulated gradients": "gold", "buckets": "tab:olive", "buckets in flight": "yellowgreen",
          "gathered units": "tab:cyan", "reduce-scatter": "steelblue", "reduce-scatters": "steelblue",
          "all-gather": "lightblue", "activations": "tab:red", "activations still saved": "salmon",
          "logits": "tab:purple", "optimizer step temporary": "tab:gray", "weight_copies": "pink"}


def term_label(term: str) -> str:
    """The report's name for a term where it has one ("gathered units" is its "gathered_units"), else the term's own."""
    return report.LABELS.get(term.replace(" ", "_"), term)


def stacked_bars(ax, labels, shape, setups, limit=GPU, unit=GB):
    """One stacked bar per setup: what is alive at the moment of its peak (`estimator.peak_moment`), the
    moment named on top, the GPU's memory as a dashed line. Returns [(moment, {term: bytes})] per setup."""
    seen, peaks = set(), []
    for x, setup in enumerate(setups):
        moment, alive = estimator.peak_moment(shape, setup)
        peaks.append((moment, alive))
        bottom = 0
        for term, value in alive.items():
            if value:
                ax.bar(x, value / unit, bottom=bottom, color=COLORS.get(term, "lightgray"),
                       label=term_label(term) if term not in seen else None)
                seen.add(term)
                bottom += value / unit
        ax.text(x, bottom, f"{bottom:.1f}\n{moment}", ha="center", va="bottom", fontsize=8)
    top = max([sum(alive.values()) / unit for _, alive in peaks] + [limit / unit if limit else 0])
    ax.set_ylim(0, top * 1.2)  # room for the moments' names
    if limit:
        ax.axhline(limit / unit, color="black", linestyle="--", linewidth=1, label=f"GPU memory ({limit / unit:.0f} GB)")
        ax.text(-0.5, limit / unit, f" {limit / unit:.0f} GB", va="bottom", ha="left", fontsize=8)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    return peaks


def draw_estimate(shapes, model, strategy, world_size, batch, seq, checkpointing, precision, gpu_gb):
    """The calculator's answer for one setting of its controls: the bar of what is alive at the peak per
    GPU, then `report.format_report`'s text (every term, the peak, whether it fits, the largest batch)."""
    shape = shapes[model]
    setup = estimator.setup(strategy=strategy, world_size=world_size, batch_size_per_device=batch, max_seq_length=seq,
                            mixed_precision=precision, gradient_checkpointing=checkpointing)
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    stacked_bars(ax, [f"{setup.options.impl}/{strategy}, {world_size} GPU(s)"], shape, [setup], limit=gpu_gb * GB)
    ax.set_ylabel("GB per GPU (estimated)"); ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    plt.show()
    print(report.format_report(report.report(shape, setup, gpu_gb * GB)))


def calculator(shapes: dict, model: str) -> tuple[dict, widgets.Output]:
    """The calculator's controls, by name, and the output they redraw: `draw_estimate` once now and
    again on every change of a control (`ipywidgets.interactive_output`). `shapes` maps a model's name
    to its `estimator.model_shape`; `model` is the one shown first."""
    controls = dict(
        model=widgets.Dropdown(options=list(shapes), value=model, description="model"),
        strategy=widgets.Dropdown(options=STRATEGIES, value="fsdp", description="strategy"),
        world_size=widgets.Dropdown(options=[1, 2, 4, 8, 16, 32, 64], value=4, description="GPUs"),
        batch=widgets.IntSlider(value=4, min=1, max=64, description="batch/GPU"),
        seq=widgets.Dropdown(options=[128, 256, 512, 1024, 2048, 4096, 8192], value=512, description="seq length"),
        checkpointing=widgets.Checkbox(value=False, description="activation checkpointing"),
        precision=widgets.Dropdown(options=["bf16", "fp32"], value="bf16", description="precision"),
        gpu_gb=widgets.FloatText(value=80.0, description="GPU GB"),
    )

    def redraw(**settings):
        draw_estimate(shapes, **settings)

    return controls, widgets.interactive_output(redraw, controls)
