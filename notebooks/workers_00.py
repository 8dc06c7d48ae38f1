"""Worker functions for lesson 00 (where the memory goes), launched by `minidist.launch.launch`.

They live in a `.py` file because every rank is a *spawned* process that imports its worker by
name; a function defined in a notebook cell cannot be imported. Nothing here measures memory by
itself: each worker runs the real training loop, `minidist.finetune.train`, whose
`minidist.memory_measure.MemoryMeter` records per rank, after every optimizer step, the bytes of
the parameters, gradients and optimizer states, and the peak of the tensors autograd saved for
backward (`memory_bytes` in metrics.jsonl). We hand those records back to the notebook.
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


def train_and_measure(model_dir: str, data: str, runs: list[list[str]], steps: int, seq_len: int,
                      batch: int) -> list[dict]:
    """Train once per entry of `runs` (extra `minidist.finetune` flags, e.g. ["--strategy",
    "fsdp", "--gradient_checkpointing"]), one after the other in the same ranks; return, per run,
    the records the loop logged (rank 0's view of every rank: `memory_bytes` are lists by rank)."""
    # N ranks on a laptop share its cores: one thread pool per rank as wide as the machine would
    # oversubscribe it.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    results = []
    for flags in runs:
        with tempfile.TemporaryDirectory() as out:
            shared = [out]  # every rank needs the same folder for the log: rank 0 picks it
            dist.broadcast_object_list(shared, src=0)
            args = finetune.parse_args([
                "--model", model_dir, "--data", data, "--max_steps", str(steps),
                "--max_seq_length", str(seq_len), "--batch_size_per_device", str(batch),
                "--warmup_steps", "1", "--eval_prefixes", "0", "--no_save", "--output_dir", shared[0], *flags,
            ])
            printed = io.StringIO()  # the loop's log lines, returned rather than printed by every rank
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
                finetune.train(args)
            dist.barrier()  # rank 0 has written and closed metrics.jsonl
            log = Path(shared[0]) / "metrics.jsonl"
            records = [json.loads(line) for line in log.read_text().splitlines()] if dist.get_rank() == 0 else []
            dist.barrier()  # nobody deletes the folder before rank 0 has read it
        results.append({"flags": flags, "records": records, "log": printed.getvalue()})
    return results
