"""Worker functions for lesson 03 (gradient accumulation), launched by `minidist.runtime.launch.launch`.

They live in a `.py` file because every rank is a fresh process that imports its worker by
name; a function defined in a notebook cell cannot be imported. Nothing here re-implements
minidist: each run is the real training loop, `minidist.finetune.train`, with the flags a learner
would type (`--batch_size_per_device`, `--gradient_accumulation_steps`), and hands back what the
loop logged. The one experiment the loop has no flag for, accumulating *without* `no_sync`, swaps
the strategy's `no_sync` for a context that does nothing, for that run only, and says so.

`draw_packing_mask`, section 5's figure (`lessons/figures/03_packing_mask.png`), runs in the
notebook's own process, not on ranks: the mask of a packed row as `packing.document_mask` makes it,
beside the causal mask of the same row without it.
"""

import contextlib
from unittest import mock

import torch
import torch.distributed as dist

from minidist import packing, strategy

import training


def _run(model_dir, data_path, steps, seq_len, batch, accumulation, lr):
    """One `finetune.train` on these ranks; rank 0 returns its metrics.jsonl records and weights."""
    done = training.run([  # without --no_save: the full weights come back on rank 0
        "--model", model_dir, "--data", data_path, "--impl", "minidist", "--strategy", "ddp",
        "--max_steps", str(steps), "--max_seq_length", str(seq_len), "--batch_size_per_device", str(batch),
        "--gradient_accumulation_steps", str(accumulation), "--learning_rate", str(lr),
        "--warmup_steps", "1", "--eval_prefixes", "0",
    ])
    return done["records"], done["result"]["parameters"], done["log"]


def splits(model_dir: str, data_path: str, total_batch: int, batch_sizes: list[int], steps: int, seq_len: int,
           without_no_sync: list[int], rounds: int = 1, lr: float = 3e-3) -> list[dict]:
    """Train once per batch size per device b, the global batch fixed at `total_batch`: the loop
    accumulates total_batch / (b x ranks) micro-batches per step. Then, for each b in
    `without_no_sync`, once more with every micro-batch all-reducing (the wrong way to accumulate:
    same result, more bytes).

    Every run starts from the same weights and sees the same global batches (the data order
    depends only on the seed). Rank 0 compares each run's final weights with the first run's
    and returns the differences (the largest, and the norm relative to the weights' norm), not
    the weights.

    For the times, the whole plan runs `rounds` times, in alternating order, as a benchmark
    takes turns: on a laptop other programs come and go, and a slow minute should not fall on
    one batch size only. `timings` collects (seconds, tokens) of every step but each run's first
    (which pays for warm-up) over all rounds; the records and weights are the first round's."""
    training.share_cores()
    n = dist.get_world_size()
    plan = [(b, True) for b in batch_sizes] + [(b, False) for b in without_no_sync]
    out, first = [], None
    for b, sync_once in plan:
        out.append(_one(model_dir, data_path, total_batch, b, sync_once, steps, seq_len, lr, n))
        params = out[-1].pop("parameters")
        if params is not None:  # rank 0: compare with the first run's weights
            first = first or params
            out[-1]["max_weight_diff"] = max((params[k] - first[k]).abs().max().item() for k in first)
            out[-1]["relative_weight_diff"] = (sum((params[k] - first[k]).pow(2).sum() for k in first)
                                               / sum(first[k].pow(2).sum() for k in first)).sqrt().item()
    for r in range(1, rounds):  # more turns, for the times only
        for i in (reversed if r % 2 else iter)(range(len(plan))):
            b, sync_once = plan[i]
            again = _one(model_dir, data_path, total_batch, b, sync_once, steps, seq_len, lr, n)
            out[i]["timings"] += again["timings"]
    return out


def _one(model_dir, data_path, total_batch, b, sync_once, steps, seq_len, lr, n) -> dict:
    """One run with b sequences per device, with or without `no_sync`."""
    accumulation = total_batch // (b * n)
    # Without no_sync: the strategy's no_sync becomes a context that does nothing, so the
    # bucketed DDP's hooks all-reduce after every micro-batch's backward.
    patch = (contextlib.nullcontext() if sync_once else
             mock.patch.object(strategy.MinidistDDP, "no_sync", lambda self, model: contextlib.nullcontext()))
    with patch:
        records, params, log = _run(model_dir, data_path, steps, seq_len, b, accumulation, lr)
    return {"batch_size_per_device": b, "accumulation": accumulation, "no_sync": sync_once,
            "records": records, "parameters": params, "log": log,
            "timings": [(r["step_time_s"], r["tokens"]) for r in records[1:]]}


def draw_packing_mask(rows: list[list[list[int]]], pad_token_id: int, row: int = 0, png=None):
    """Row `row` of the micro-batch `packing.collate_packed(rows, pad_token_id)` makes, as two 2-D
    masks, query positions down, key positions across, each cell filled where the query may attend
    to the key. Left, `packing.document_mask` of the row's document ids: one causal triangle per
    game, and each padding token seeing itself. Right, the causal mask of the whole row over its real
    tokens, which is what the model computes with the position ids reset and no document mask: the
    cells where a game sees the games before it are red. The lines are the games' boundaries."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    batch = packing.collate_packed(rows, pad_token_id)
    docs, positions = batch["document_ids"][row], batch["position_ids"][row]
    mask = packing.document_mask(batch["document_ids"])[row, 0]
    s = docs.numel()
    real = docs != packing.PADDING
    causal = torch.ones(s, s, dtype=torch.bool).tril() & real[:, None] & real[None, :]
    other_game = causal & (docs[:, None] != docs[None, :])
    # 0: no attention, 1: attends within its game, 2: attends to another game, 3: padding sees itself, 4: padding
    padding = ~real[:, None] | ~real[None, :]
    left = torch.where(mask, torch.where(real[:, None], 1, 3), torch.where(padding, 4, 0))
    right = torch.where(other_game, 2, torch.where(causal, 1, torch.where(padding, 4, 0)))
    colors = ListedColormap(["white", "tab:blue", "tab:red", "lightsteelblue", "0.88"])
    games = [(int(d), int((docs == d).nonzero()[0]), int((docs == d).nonzero()[-1]) + 1)
             for d in docs.unique().tolist() if d != packing.PADDING]
    fig, axes = plt.subplots(1, 2, figsize=(12, 7.2))
    titles = ("packing.document_mask: block-diagonal causal",
              "position ids reset, no document mask: causal over the row")
    for ax, cells, title in zip(axes, (left, right), titles):
        ax.imshow(cells.numpy(), cmap=colors, vmin=-0.5, vmax=4.5)
        ax.set_xticks(range(s), [str(int(p)) if real[k] else "pad" for k, p in enumerate(positions)], fontsize=7)
        ax.set_yticks(range(s), [str(int(p)) if real[k] else "pad" for k, p in enumerate(positions)], fontsize=7)
        ax.set_xticks([k - 0.5 for k in range(s + 1)], minor=True)
        ax.set_yticks([k - 0.5 for k in range(s + 1)], minor=True)
        ax.grid(which="minor", color="0.75", lw=0.4)
        ax.tick_params(which="minor", length=0)
        for d, start, end in games:
            for edge in (start, end):
                ax.axvline(edge - 0.5, color="black", lw=1.4)
                ax.axhline(edge - 0.5, color="black", lw=1.4)
        ax.set_xlabel("key position j (its position id)")
        ax.set_ylabel("query position i (its position id)")
        top = ax.secondary_xaxis("top")
        top.set_xticks([(start + end - 1) / 2 for _, start, end in games], [f"game {d}" for d, _, _ in games],
                       fontsize=9)
        top.tick_params(length=0)
        ax.set_title(title, fontsize=10)
    fig.legend(handles=[Patch(fc="tab:blue", label="attends (its own game, j <= i)"),
                        Patch(fc="tab:red", label="attends to another game: the leak the mask prevents"),
                        Patch(fc="lightsteelblue", label="padding sees itself alone (no softmax over nothing)"),
                        Patch(fc="0.88", ec="0.7", label="padding (labels -100: no loss)")],
               loc="lower center", ncol=2, fontsize=9, frameon=False)
    fig.suptitle(f"one packed row: {len(games)} games of {', '.join(str(e - b) for _, b, e in games)} tokens, "
                 f"then {int((~real).sum())} padding tokens (row {row} of collate_packed's micro-batch)", fontsize=11)
    fig.tight_layout(rect=(0, 0.1, 1, 0.96))
    if png:
        fig.savefig(png, dpi=100)
    return fig
