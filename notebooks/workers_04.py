"""Worker functions for lesson 04 (ZeRO-1 and ZeRO-2), launched by `minidist.launch.launch`.

They live in a `.py` file because every rank is a *spawned* process that imports its worker by
name; a function defined in a notebook cell cannot be imported. Nothing here re-implements
minidist: each worker runs the real training loop, `minidist.finetune.train`, with the flags a
learner would type, and hands back what that loop measured.
"""

import torch.distributed as dist

import training


def train_and_measure(model_dir: str, data: str, runs: list[dict], steps: int, seq_len: int, batch: int) -> list[dict]:
    """Train once per entry of `runs` ({"strategy", "mixed_precision"}), one after the other in
    the same ranks, and return, per run, what the loop logged each step (rank 0's view of every
    rank: `memory_bytes` are lists by rank, `comm_bytes` what rank 0 sent).

    Each run starts from the same weights and sees the same batches (the data order depends only
    on the seed), so their losses can be compared step by step."""
    training.share_cores()
    results = []
    for run in runs:
        done = training.run([
            "--model", model_dir, "--data", data, "--impl", "minidist", "--strategy", run["strategy"],
            "--mixed_precision", run["mixed_precision"], "--max_steps", str(steps),
            "--max_seq_length", str(seq_len), "--batch_size_per_device", str(batch),
            "--warmup_steps", "1", "--eval_prefixes", "0", "--no_save",
        ])
        results.append({**run, "world_size": dist.get_world_size(), "records": done["records"], "log": done["log"]})
    return results
