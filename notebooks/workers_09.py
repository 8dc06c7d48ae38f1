"""Worker function for lesson 09 (the capstone), launched by `minidist.launch.launch`.

It lives in a `.py` file because every rank is a *spawned* process that imports its worker by
name. Nothing here re-implements minidist: each run is the real training script,
`minidist.finetune.train`, with the command-line flags a learner would pass to
`slurm/chess_finetune.sh`, and what comes back is what that script measured and logged.
"""

import contextlib
import io
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minidist import finetune


def run_all(common: list[str], runs: dict[str, list[str]]) -> dict:
    """Run the training script once per entry of `runs` (name -> extra flags, added after
    `common`), one after the other in these ranks. Returns, by name, rank 0's view: the records of
    `metrics.jsonl` (one per step; memory lists by rank), the legal-move rates before and after
    training (None with `--eval_prefixes 0`), the lines the script printed, and its wall time."""
    # N ranks on a laptop share its cores: one thread pool per rank as wide as the machine would
    # oversubscribe it.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    results = {}
    for name, extra in runs.items():
        with tempfile.TemporaryDirectory() as out:
            shared = [out]  # every rank needs the same output folder: rank 0 picks it
            dist.broadcast_object_list(shared, src=0)
            args = finetune.parse_args([*common, *extra, "--no_save", "--output_dir", shared[0]])
            printed = io.StringIO()  # the loop's log lines, returned so the notebook shows them
            started = time.perf_counter()
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
                result = finetune.train(args)
            seconds = time.perf_counter() - started  # the whole run: loading, evaluations, steps
            dist.barrier()  # rank 0 has written and closed metrics.jsonl
            log = Path(shared[0]) / "metrics.jsonl"
            records = [json.loads(line) for line in log.read_text().splitlines()] if dist.get_rank() == 0 else []
            dist.barrier()  # nobody deletes the folder before rank 0 has read it
        results[name] = {"flags": extra, "records": records, "rate_before": result["rate_before"],
                         "rate_after": result.get("rate_after"), "log": printed.getvalue(), "seconds": seconds}
    return results
