"""Lesson 12's figures and tables: the schedules as time diagrams, and the bytes per step at 7B.

`python notebooks/workers_12_figures.py` (from the repository root) draws
`lessons/figures/12_schedules.png` (GPipe and 1F1B on p = 4 stages, m = 8 micro-batches) and
`12_bytes_per_step.png`, and prints the 7B tables of bytes that `lessons/12_pipeline_parallel.md`
quotes. The notebook (`notebooks/12_pipeline_parallel.ipynb`) may call the same functions.

**The diagrams are drawn from the executor's own lists.** Each rank's row is
`schedules.table(name, m, pp)[rank]`, the list `executor.Executor.step` runs, checked first by
`executor.check`. Only the time of each action is added here (`play`): a forward takes one unit, a
backward two (it computes the gradients of the inputs and of the weights, about twice a forward's
FLOPs), and an action starts when its rank has finished the one before it and its input has arrived
(the stage before has finished the same micro-batch's forward, or the stage after its backward).
Messages take no time. That is arithmetic on the table, not a measurement: the measured timeline of a
CPU run is the notebook's.

**The bytes** of the data- and tensor-parallel layouts come from lesson 11's `step_bytes` (and so
from `minidist/parallel/tensor/traffic.py`); a pipeline's from `pipeline_bytes` below, which is the
rule `tests/parallel/test_pipeline.py` checks against `comm.counter`: each cut carries every token's
hidden state forward and its gradient back, once per step.
"""

import sys
from pathlib import Path

from minidist.memory.pipeline import held_micro_batches
from minidist.bench import bubble
from minidist.parallel.pipeline import executor, schedules
from minidist.parallel.tensor.traffic import fsdp_bytes_per_layer

FIGURES = Path(__file__).resolve().parents[1] / "lessons" / "figures"
HIDDEN_7B = 4096  # CodeLlama-7b's hidden size (its config.json)


def play(actions_by_rank: list[list[tuple[str, int]]], forward: float = 1, backward: float = 2) -> list[list[tuple]]:
    """Each rank's actions as (kind, i, start, end), in the rank's own order, when a forward takes
    `forward` and a backward `backward` (module doc). The table is checked first, so it finishes."""
    pp = len(actions_by_rank)
    executor.check(actions_by_rank, len(actions_by_rank[0]) // 2)
    done = {}  # (rank, kind, i) -> when it ends
    timed = [[] for _ in range(pp)]
    while any(len(timed[r]) < len(actions_by_rank[r]) for r in range(pp)):
        for rank in range(pp):
            while len(timed[rank]) < len(actions_by_rank[rank]):
                kind, i = actions_by_rank[rank][len(timed[rank])]
                # The input: the stage before's forward of i, or the stage after's backward of i.
                peer = rank - 1 if kind == "F" else rank + 1
                needs = (peer, kind, i) if 0 <= peer < pp else None
                if needs is not None and needs not in done:
                    break  # not computed yet: the peer's row has to get there first
                free = timed[rank][-1][3] if timed[rank] else 0
                start = max(free, done[needs] if needs else 0)
                end = start + (forward if kind == "F" else backward)
                done[rank, kind, i] = end
                timed[rank].append((kind, i, start, end))
    return timed


def idle(timed: list[list[tuple]]) -> list[float]:
    """Each rank's idle share of the played step (it starts at 0 and ends with the last action), by
    the measurement's own arithmetic (`bench/bubble.idle_fraction`)."""
    span = max(row[-1][3] for row in timed)
    return [bubble.idle_fraction(row, span) for row in timed]


def pipeline_bytes(tokens: int, pp: int, hidden: int = HIDDEN_7B, element_bytes: int = 2) -> float:
    """What the busiest rank of a pipeline of `pp` stages sends per step, for `tokens` tokens through
    the pipeline (all its micro-batches): the hidden states forward and, for a middle stage, their
    gradients back too, b x s x h x `element_bytes` each way. The first stage sends only forward, the
    last only backward."""
    directions = 2 if pp > 2 else 1
    return float(directions * tokens * hidden * element_bytes)


def print_tables() -> None:
    """The tables lesson 12 quotes (GB = 1e9 bytes, MB = 1e6), and the played bubble."""
    import workers_11_figures

    for name in ("gpipe", "1f1b"):
        table = schedules.table(name, 8, 4)
        print(f"{name}, p = 4, m = 8:\n{schedules.show(table)}")
        print(f"  idle share by rank (played, F = 1, B = 2): {[round(x, 4) for x in idle(play(table))]}; "
              f"formula (p-1)/(m+p-1) = {3 / 11:.4f}; held: {[held_micro_batches(name, 8, 4, r) for r in range(4)]}")
    for seq in (512, 4096):
        tokens = 32 * seq
        print(f"\nBytes per GPU per step, CodeLlama-7b, global batch 32 sequences of {seq} tokens (GB), bf16:")
        for gpus in (4, 8):
            fsdp = workers_11_figures.step_bytes(gpus, 1, 32, seq)["total"]
            tp = workers_11_figures.step_bytes(gpus, gpus, 32, seq)["total"]
            pp = pipeline_bytes(tokens, gpus)
            print(f"  {gpus} GPUs: FSDP {gpus} {fsdp / 1e9:6.2f} | TP {gpus} {tp / 1e9:7.2f} | PP {gpus} {pp / 1e9:6.3f}")
        # 2 nodes of 4 GPUs: pp 2 across the nodes, FSDP 4 inside each over its stage's 16 layers (the
        # embedding or the head left out). FSDP gathers a layer again for every micro-batch: m = 1 and 8.
        inside = [16 * float(fsdp_bytes_per_layer(workers_11_figures.LAYER_PARAMS, 4, gather_bytes=2, reduce_bytes=4,
                                                  micro_batches=m)) for m in (1, 8)]
        across = pipeline_bytes(tokens // 4, 2)  # each GPU's share of the batch crosses the cut once
        print(f"  8 GPUs, pp 2 across 2 nodes x FSDP 4 inside: across the nodes {across / 1e6:.1f} MB per GPU "
              f"(one NIC each, each way); inside a node (NVLink) {inside[0] / 1e9:.1f} GB per GPU in 1 micro-batch, "
              f"{inside[1] / 1e9:.1f} GB in 8")


# ------------------------------------------------------------------------------------------ figures
def draw_schedules(m: int = 8, pp: int = 4, png: Path | None = None):
    """GPipe above 1F1B: one row per rank, time to the right, each box an action of the rank's list,
    coloured by micro-batch (forwards light, backwards dark)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, axes = plt.subplots(2, 1, figsize=(12, 5.6), sharex=True)
    colors = plt.get_cmap("tab10")
    for ax, name in zip(axes, ("gpipe", "1f1b")):
        table = schedules.table(name, m, pp)
        timed = play(table)
        for rank, row in enumerate(timed):
            for kind, i, start, end in row:
                ax.add_patch(Rectangle((start, pp - 1 - rank), end - start, 0.9, ec="black", lw=0.6,
                                       fc=colors(i % 10), alpha=0.45 if kind == "F" else 0.95))
                ax.text((start + end) / 2, pp - 1 - rank + 0.45, f"{kind}{i}", ha="center", va="center", fontsize=8)
        shares = idle(timed)
        ax.set_xlim(0, max(row[-1][3] for row in timed))
        ax.set_ylim(-0.1, pp)
        ax.set_yticks([pp - 1 - r + 0.45 for r in range(pp)])
        ax.set_yticklabels([f"rank {r}\nholds {held_micro_batches(name, m, pp, r)}" for r in range(pp)], fontsize=8)
        ax.set_title(f"{'GPipe' if name == 'gpipe' else '1F1B'}: schedules.table({name!r}, m={m}, pp={pp}); "
                     f"each rank idle {shares[0]:.1%} of the step, (p-1)/(m+p-1) = {(pp - 1) / (m + pp - 1):.1%}",
                     fontsize=10, loc="left")
    axes[-1].set_xlabel("time (a forward takes 1 unit, a backward 2; played from the lists, not measured)")
    fig.tight_layout()
    if png:
        fig.savefig(png, dpi=100)
    return fig


def draw_bytes_per_step(png: Path | None = None):
    """Bytes per GPU per step of CodeLlama-7b on 4 GPUs against the tokens of the global batch:
    FSDP's are flat (weights), TP's and PP's grow with the tokens, PP's from far lower."""
    import matplotlib.pyplot as plt
    import workers_11_figures

    seqs = [512, 1024, 2048, 4096, 8192, 16384]
    tokens = [32 * s for s in seqs]
    fig, ax = plt.subplots(figsize=(8, 4.6))
    ax.plot(tokens, [workers_11_figures.step_bytes(4, 1, 32, s)["total"] / 1e9 for s in seqs], "-o", ms=3,
            color="C3", label="FSDP 4 (bf16 gathers, fp32 reduce-scatter): the weights")
    ax.plot(tokens, [workers_11_figures.step_bytes(4, 4, 32, s)["total"] / 1e9 for s in seqs], "-o", ms=3,
            color="C0", label="TP 4: four all-reduces of b x s x h per layer")
    ax.plot(tokens, [pipeline_bytes(t, 4) / 1e9 for t in tokens], "-o", ms=3, color="C2",
            label="PP 4 (a middle stage): b x s x h at its two cuts")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per step (32 sequences of 512 to 16,384 tokens)")
    ax.set_ylabel("GB sent per GPU per step")
    ax.set_title("CodeLlama-7b on 4 GPUs, bytes per GPU per step (arithmetic, bf16)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    if png:
        fig.savefig(png, dpi=100)
    return fig


def main() -> None:
    print_tables()
    draw_schedules(png=FIGURES / "12_schedules.png")
    draw_bytes_per_step(png=FIGURES / "12_bytes_per_step.png")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # workers_11_figures, imported by name
    main()
