"""Worker functions for lesson 03 (gradient accumulation), launched by `minidist.runtime.launch.launch`.

They live in a `.py` file because every rank is a fresh process that imports its worker by
name; a function defined in a notebook cell cannot be imported. Nothing here re-implements
minidist: each run is the real training loop, `minidist.finetune.train`, with the flags a learner
would type (`--batch_size_per_device`, `--gradient_accumulation_steps`), and hands back what the
loop logged. The one experiment the loop has no flag for, accumulating *without* `no_sync`, swaps
the strategy's `no_sync` for a context that does nothing, for that run only, and says so.
"""

import contextlib
from unittest import mock

import torch.distributed as dist

from minidist import strategy

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
