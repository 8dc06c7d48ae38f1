"""Lesson 11's figures and tables: the operators, the bytes per layer against FSDP's, memory per rank.

`python notebooks/workers_11_figures.py` (from the repository root) draws
`lessons/figures/11_operators.png` and `11_bytes_per_layer.png`, prints the 7B tables of bytes that
`lessons/11_tensor_parallel.md` quotes, and, with `--measure`, measures the whole step's peak of live
tensors per rank of a tiny Llama at tp 1, 2 and 4, with and without sequence parallelism
(`workers_11.steps`: the loop's own `train_step` on a model cut by the strategy, watched by
`memory.measure.step_peak`), and draws `11_memory_per_rank.png`. The notebook
(`notebooks/11_tensor_parallel.ipynb`) may call the drawing functions too.

Nothing here computes a byte by a formula of its own: every byte comes from
`minidist/parallel/tensor/traffic.py`, whose formula `tests/parallel/test_tensor_bytes.py` checks
against what the code sends.
"""

import sys
from pathlib import Path
from types import SimpleNamespace

from minidist.parallel.tensor.traffic import fsdp_bytes_per_layer, tensor_parallel_bytes

FIGURES = Path(__file__).resolve().parents[1] / "lessons" / "figures"

# CodeLlama-7b's config.json (codellama/CodeLlama-7b-hf): no biases, no grouped-query attention.
CODELLAMA_7B = SimpleNamespace(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                               num_key_value_heads=32, vocab_size=32016, attention_bias=False, mlp_bias=False)
LAYER_PARAMS = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096  # attention, MLP, two norms: 202,383,360
ROOT_PARAMS = 2 * 32016 * 4096 + 4096  # embedding, head (untied) and the final norm: 262,279,168


def tp_layer_bytes(tokens: int, tp: int, sequence_parallel: bool = False, element_bytes: int = 2) -> float:
    """What one rank of `tp` sends per decoder layer of CodeLlama-7b for one micro-batch of `tokens`
    tokens (one sequence of that length: only b x s counts), norms included under SP."""
    b = tensor_parallel_bytes(CODELLAMA_7B, 1, tokens, tp, sequence_parallel=sequence_parallel,
                              element_bytes=element_bytes)
    return float(b.per_layer + b.layer_norms)


def fsdp_layer_bytes(n: int, gather_bytes: int = 2, layer_params: int = LAYER_PARAMS) -> float:
    """What one rank of `n` sends per layer under FSDP: bf16 gathers, fp32 reduce-scatter (the
    hand-written FSDP under bf16), or fp32 everything with `gather_bytes=4`."""
    return float(fsdp_bytes_per_layer(layer_params, n, gather_bytes=gather_bytes, reduce_bytes=4))


def step_bytes(gpus: int, tp: int, sequences: int, seq: int, sequence_parallel: bool = False) -> dict:
    """Bytes one GPU sends per optimizer step of `sequences` x `seq` tokens (the global batch), on
    `gpus` = tp x dp GPUs: tensor parallelism inside each group of tp (every micro-batch of its dp
    rank, one sequence at a time), FSDP over the dp ranks of each tp slice (bf16 gathers, fp32
    reduce-scatter), and the root's FSDP bytes (gathered once, as its unit stays gathered)."""
    dp = gpus // tp
    per_dp_rank = sequences // dp
    tp_total = 0.0
    if tp > 1:
        tp_total = float(tensor_parallel_bytes(CODELLAMA_7B, 1, seq, tp, sequence_parallel=sequence_parallel,
                                               element_bytes=2, micro_batches=per_dp_rank).total)
    fsdp = 0.0
    if dp > 1:
        layers = CODELLAMA_7B.num_hidden_layers * fsdp_layer_bytes(dp, layer_params=LAYER_PARAMS // tp)
        root = (2 + 4) * (ROOT_PARAMS // tp) * (dp - 1) / dp  # one bf16 gather, one fp32 reduce-scatter
        fsdp = layers + root
    return {"tp": tp_total, "fsdp": fsdp, "total": tp_total + fsdp}


def print_tables() -> None:
    """The tables lesson 11 quotes (GB = 1e9 bytes, MB = 1e6)."""
    print("Bytes per rank per decoder layer of CodeLlama-7b, one micro-batch (MB):")
    print(f"{'tokens b x s':>12} | {'TP 2':>7} {'TP 4':>7} {'TP 8':>7} | {'TP 4 + SP':>9} | "
          f"{'FSDP 4 bf16':>11} {'FSDP 4 fp32':>11} {'FSDP 8 bf16':>11}")
    for tokens in (512, 2048, 4096, 8192, 32768):
        tps = " ".join(f"{tp_layer_bytes(tokens, t) / 1e6:7.1f}" for t in (2, 4, 8))
        print(f"{tokens:>12} | {tps} | {tp_layer_bytes(tokens, 4, True) / 1e6:9.1f} | "
              f"{fsdp_layer_bytes(4) / 1e6:11.0f} {fsdp_layer_bytes(4, 4) / 1e6:11.0f} {fsdp_layer_bytes(8) / 1e6:11.0f}")
    for seq in (512, 4096):
        print(f"\nBytes per GPU per step, global batch 32 sequences of {seq} tokens (GB): TP | FSDP | total")
        for gpus, tp in ((4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4), (8, 8)):
            b = step_bytes(gpus, tp, 32, seq)
            print(f"  {gpus} GPUs, tp {tp} x dp {gpus // tp}: {b['tp'] / 1e9:6.2f} | {b['fsdp'] / 1e9:6.2f} | "
                  f"{b['total'] / 1e9:6.2f}")


# ------------------------------------------------------------------------------------------ figures
def draw_operators(png: Path | None = None):
    """Where f and g sit in a block, and what each does forward and backward; below, the same block
    under sequence parallelism. A schematic of `ops.py`, not a measurement."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    fig, axes = plt.subplots(2, 1, figsize=(11, 6.4))
    rows = [
        ("Tensor parallelism (Megatron-LM): every rank holds the whole x and the whole y",
         ("x\nwhole", "f", "column-parallel\nA_r: out/t rows", "row-parallel\nB_r: in/t columns", "g", "y\nwhole"),
         ("identity", "all-reduce"), ("all-reduce (sum of partial y)", "identity")),
        ("Sequence parallelism (Korthikanti et al.): x and y cut along the sequence between blocks",
         ("x\nseq. chunk r", "all-\ngather", "column-parallel\nA_r", "row-parallel\nB_r", "reduce-\nscatter",
          "y\nseq. chunk r"),
         ("all-gather", "reduce-scatter"), ("reduce-scatter", "all-gather")),
    ]
    for ax, (title, boxes, entry, exit_) in zip(axes, rows):
        ax.set_xlim(0, 12)
        ax.set_ylim(0, 3)
        ax.axis("off")
        ax.set_title(title, fontsize=11, loc="left")
        xs = [0.3, 2.2, 3.8, 6.4, 9.0, 10.6]
        widths = [1.2, 1.1, 2.2, 2.2, 1.1, 1.2]
        for i, (x, w, text) in enumerate(zip(xs, widths, boxes)):
            operator = i in (1, 4)
            color = "#f4b183" if operator else ("#bdd7ee" if i in (2, 3) else "#e2efda")
            ax.add_patch(FancyBboxPatch((x, 1.0), w, 1.0, boxstyle="round,pad=0.05", fc=color, ec="black"))
            ax.text(x + w / 2, 1.5, text, ha="center", va="center", fontsize=9, weight="bold" if operator else None)
            if i < len(boxes) - 1:
                ax.add_patch(FancyArrowPatch((x + w + 0.05, 1.5), (xs[i + 1] - 0.05, 1.5), arrowstyle="->",
                                             mutation_scale=12))
        for (x, w), (forward, backward) in zip(((xs[1], widths[1]), (xs[4], widths[4])), (entry, exit_)):
            ax.text(x + w / 2, 2.35, f"forward: {forward}", ha="center", fontsize=8.5, color="#1f4e79")
            ax.text(x + w / 2, 0.45, f"backward: {backward}", ha="center", fontsize=8.5, color="#833c0b")
        ax.text(6.2, 0.45, "nothing sent inside: rank r's heads, its slice of the MLP",
                ha="center", fontsize=8.5, color="dimgray")
    fig.text(0.01, 0.01, "Same bytes both ways: an all-reduce is a reduce-scatter followed by an all-gather. "
             "f and g are conjugate: each one's backward is the other's forward.", fontsize=9)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    if png:
        fig.savefig(png, dpi=100)
    return fig


def draw_bytes_per_layer(png: Path | None = None):
    """Bytes per rank per layer of CodeLlama-7b: TP's grow with the tokens of a micro-batch, FSDP's
    do not (traffic.py)."""
    import matplotlib.pyplot as plt

    tokens = [2 ** k for k in range(8, 17)]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for t, style in ((2, ":"), (4, "-"), (8, "--")):
        ax.plot(tokens, [tp_layer_bytes(x, t) / 1e6 for x in tokens], style, color="C0", marker="o", ms=3,
                label=f"TP {t} (bf16 activations; the same with SP)")
    for n, gather, color in ((4, 2, "C3"), (4, 4, "C1"), (8, 2, "C2")):
        ax.axhline(fsdp_layer_bytes(n, gather) / 1e6, color=color, lw=1.5,
                   label=f"FSDP {n} ({'bf16' if gather == 2 else 'fp32'} gathers, fp32 reduce-scatter)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per micro-batch, b x s")
    ax.set_ylabel("MB sent per rank per layer (one micro-batch)")
    ax.set_title("CodeLlama-7b, one decoder layer: tensor parallelism sends activations, FSDP weights")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    if png:
        fig.savefig(png, dpi=100)
    return fig


# ------------------------------------------------------------------------------------------ memory, measured
def rank_params(config, tp: int) -> int:
    """Parameters one of `tp` ranks holds of a Llama cut by `parallelize_llama`: every matrix / tp,
    the vocabulary padded to a multiple of tp, the norms whole."""
    h, hd = config.hidden_size, config.hidden_size // config.num_attention_heads
    attention = 2 * h * config.num_attention_heads * hd + 2 * h * config.num_key_value_heads * hd
    layer = (attention + 3 * h * config.intermediate_size) // tp
    vocab = -(-config.vocab_size // tp) * h * (1 if config.tie_word_embeddings else 2)  # this rank's rows
    return config.num_hidden_layers * (layer + 2 * h) + vocab + h


def measure_memory(batch: int = 8, seq_len: int = 128) -> list[dict]:
    """The whole step's peak of live tensors on each rank, tp 1, 2, 4, with and without sequence
    parallelism, on the tiny Llama (256 wide, 4 layers, 4 heads), fp32, AdamW. Slow-ish: about 2
    minutes on 2 cores (LiveTensors watches every tensor)."""
    import tempfile

    import workers_11

    from minidist.hf import models
    from minidist.runtime.launch import launch

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        model_dir = str(models.write_tiny_llama(folder, hidden_size=256, num_layers=4, num_heads=4))
        for tp in (1, 2, 4):
            variants = [False] if tp == 1 else [False, True]
            by_rank = launch(workers_11.steps, tp, model_dir, variants, batch=batch, seq_len=seq_len)
            for sp in variants:
                result = by_rank[0][sp]
                states = 16 * rank_params(result["config"], tp)  # fp32 weights, gradients, AdamW's two moments
                rows.append({"tp": tp, "sp": sp, "peaks": [r[sp]["peak"] for r in by_rank], "states": states,
                             "shape": result["shapes"][-1][0], "losses": result["losses"]})
    return rows


def draw_memory(rows: list[dict], png: Path | None = None):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    labels = [f"tp {r['tp']}" + (" + SP" if r["sp"] else "") for r in rows]
    peaks = [max(r["peaks"]) / 1e6 for r in rows]
    states = [r["states"] / 1e6 for r in rows]
    ax.bar(labels, states, color="C0", label="weights, gradients, AdamW (16 bytes x this rank's parameters)")
    ax.bar(labels, [p - s for p, s in zip(peaks, states)], bottom=states, color="C1",
           label="the rest of the peak: activations, logits, temporaries")
    for i, p in enumerate(peaks):
        ax.text(i, p + 2, f"{p:.1f}", ha="center", fontsize=9)
    b, s = rows[0]["shape"]
    ax.set_ylabel("MB, the step's peak of live tensors (largest rank)")
    ax.set_title(f"Tiny Llama (256 wide, 4 layers), {b} x {s} tokens, fp32: measured on CPU ranks", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    if png:
        fig.savefig(png, dpi=100)
    return fig


def main(argv: list[str]) -> None:
    print_tables()
    draw_operators(FIGURES / "11_operators.png")
    draw_bytes_per_layer(FIGURES / "11_bytes_per_layer.png")
    if "--measure" in argv:
        rows = measure_memory()
        for r in rows:
            print(f"tp {r['tp']}{' + SP' if r['sp'] else ''}: peaks by rank (MB) "
                  f"{[round(p / 1e6, 2) for p in r['peaks']]}, states {r['states'] / 1e6:.2f} MB, last step's "
                  f"batch {r['shape']}, losses {[round(x, 6) for x in r['losses']]}")
        draw_memory(rows, FIGURES / "11_memory_per_rank.png")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # workers_11 and training, imported by name
    main(sys.argv[1:])
