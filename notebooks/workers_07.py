"""Worker functions for lesson 07 (mixed precision), launched by `minidist.launch.launch`.

They live in a `.py` file because every rank is a *spawned* process that imports its worker by
name; a function defined in a notebook cell cannot be imported. Nothing here re-implements
minidist: each run is the real training loop, `minidist.finetune.train`, with the flags a learner
would type (`--mixed_precision bf16`, `--reduce_dtype bf16`, `--impl torch`, ...), and what comes
back is what that loop wrote to `metrics.jsonl`: per step, the loss, `comm_bytes` (what rank 0
sent, counted by `minidist.comm`; None for `--impl torch`, whose collectives PyTorch runs itself)
and `memory_bytes` (model states and the saved-activation peak, as lists by rank).

One launch runs every configuration one after the other in the same ranks: starting processes and
importing transformers costs more on 2 cores than a few steps of a tiny model.
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


def as_flags(run: dict) -> list[str]:
    """{"strategy": "fsdp", "mixed_precision": "bf16"} -> ["--strategy", "fsdp", "--mixed_precision", "bf16"]."""
    argv = []
    for name, value in run.items():
        if value is True:
            argv.append(f"--{name}")
        elif value not in (False, None):
            argv += [f"--{name}", str(value)]
    return argv


def train_and_measure(model_dir: str, data: str, runs: list[dict], steps: int, seq_len: int) -> list[dict]:
    """Train once per entry of `runs` (finetune flags as a dict), one after the other in the same
    ranks; return, per run, the flags and the records of `metrics.jsonl` (on rank 0; [] elsewhere).

    Every run starts from the same weights and sees the same batches (the data order depends on the
    seed alone), so the loss curves of fp32 and bf16 differ only by how each one rounds."""
    # N ranks on a laptop share its cores: one thread pool per rank as wide as the machine would
    # oversubscribe it (2 ranks x 2 threads on 2 cores run slower than 2 x 1).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    results = []
    for run in runs:
        with tempfile.TemporaryDirectory() as out:
            shared = [out]  # every rank needs the same folder name: rank 0 picks it, the others follow
            dist.broadcast_object_list(shared, src=0)
            args = finetune.parse_args([
                "--model", model_dir, "--data", data, "--max_steps", str(steps), "--max_seq_length", str(seq_len),
                "--warmup_steps", "1", "--eval_prefixes", "0", "--no_save", "--output_dir", shared[0], *as_flags(run),
            ])
            printed = io.StringIO()  # the loop's log lines: returned, so the notebook can show one run's
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
                finetune.train(args)
            dist.barrier()  # rank 0 has written and closed metrics.jsonl
            log = Path(shared[0]) / "metrics.jsonl"
            records = [json.loads(line) for line in log.read_text().splitlines()] if dist.get_rank() == 0 else []
            dist.barrier()  # nobody deletes the folder before rank 0 has read it
        results.append({"run": run, "records": records, "log": printed.getvalue()})
    return results
