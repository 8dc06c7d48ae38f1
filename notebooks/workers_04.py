"""Worker functions for lesson 04 (ZeRO-1 and ZeRO-2), launched by `minidist.launch.launch`.

They live in a `.py` file because every rank is a *spawned* process that imports its worker by
name; a function defined in a notebook cell cannot be imported. Nothing here re-implements
minidist: each worker runs the real training loop, `minidist.finetune.train`, with the flags a
learner would type, and hands back what that loop measured.
"""

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from minidist import finetune


def train_and_measure(model_dir: str, data: str, runs: list[dict], steps: int, seq_len: int, batch: int) -> list[dict]:
    """Train once per entry of `runs` ({"strategy", "mixed_precision"}), one after the other in
    the same ranks, and return, per run, what the loop logged each step (rank 0's view of every
    rank: `memory_bytes` are lists by rank, `comm_bytes` what rank 0 sent).

    Each run starts from the same weights and sees the same batches (the data order depends only
    on the seed), so their losses can be compared step by step."""
    # N ranks on a laptop share its cores: one thread pool per rank as wide as the machine would
    # oversubscribe it (4 ranks x 2 threads on 2 cores run several times slower than 4 x 1).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    results = []
    for run in runs:
        with tempfile.TemporaryDirectory() as out:
            # Every rank needs the same folder name for the log: rank 0 picks it, the others follow.
            shared = [out]
            dist.broadcast_object_list(shared, src=0)
            args = finetune.parse_args([
                "--model", model_dir, "--data", data, "--impl", "minidist", "--strategy", run["strategy"],
                "--mixed_precision", run["mixed_precision"], "--max_steps", str(steps),
                "--max_seq_length", str(seq_len), "--batch_size_per_device", str(batch),
                "--warmup_steps", "1", "--eval_prefixes", "0", "--no_save", "--output_dir", shared[0],
            ])
            printed = io.StringIO()  # the loop's log lines: returned, so the notebook shows one run's, not all of them
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
                finetune.train(args)
            dist.barrier()  # rank 0 has written and closed metrics.jsonl
            log = Path(shared[0]) / "metrics.jsonl"
            records = [json.loads(line) for line in log.read_text().splitlines()] if dist.get_rank() == 0 else []
            dist.barrier()  # nobody deletes the folder before rank 0 has read it
        results.append({**run, "world_size": dist.get_world_size(), "records": records, "log": printed.getvalue()})
    return results
