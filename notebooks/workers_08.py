"""Worker functions for lesson 08 (checkpoints and preemption), launched by `minidist.runtime.launch.launch`.

They live in a `.py` file because every rank is a fresh process that imports its worker by
name. Nothing here re-implements minidist: every run is the real training script,
`minidist.finetune.train`, with the flags a learner would type (`--save_steps`,
`--checkpoint_format`, `--resume`), and the stop is a real SIGUSR1, the signal SLURM sends
before a time limit, delivered to one rank only.
"""

import contextlib
import io
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minidist import finetune


def _train(argv: list[str]) -> dict:
    """One run of the training script on these ranks; what it returned plus what it printed."""
    printed = io.StringIO()  # the loop's log lines (stdout and stderr), returned to the notebook
    started = time.perf_counter()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        result = finetune.train(finetune.parse_args(argv))
    dist.barrier()  # every rank has left the run (and its saves) before the next one starts
    return {**result, "log": printed.getvalue(), "seconds": time.perf_counter() - started}


def _send_usr1_after(step: int, metrics: Path) -> None:
    """Hold this rank after `step` and send it SIGUSR1 once `step` is logged: a preemption
    warning that reaches one rank, at a moment we choose, so the lesson does not race the loop.

    `MINIDIST_PAUSE_AT=step:N` (minidist/checkpoint/preemption.py's test hook) makes this rank wait after
    step N, before the ranks vote, until a signal comes; the other rank waits in the vote. When
    rank 0 has written step N to metrics.jsonl, this rank is past step N-1's vote, so the signal
    is counted at step N's, on every rank."""
    os.environ["MINIDIST_PAUSE_AT"] = f"step:{step}"

    def send():
        while not metrics.exists() or metrics.read_text().count("\n") < step:  # whole lines only
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)

    threading.Thread(target=send, daemon=True).start()


def interrupt_and_resume(common: list[str], out: str, steps: int, save_steps: int, stop_after: int) -> dict:
    """Three runs of the same training in these ranks, all with the flags `common`:

    1. `reference`: `steps` steps without a stop, saving a *full* checkpoint every `save_steps`;
    2. `stopped`: the same, saving *sharded* checkpoints, but rank 1 gets SIGUSR1 after step
       `stop_after`: every rank saves that step and the run returns early;
    3. `resumed`: the same command with `--resume`: it goes on from `latest` to `steps`.

    Returns, on every rank, each run's losses and log; rank 0 also returns the final weights
    (a full state dict) of runs 1 and 3 and the files of the output folders."""
    # N ranks on a laptop share its cores: one thread pool per rank as wide as the machine would
    # oversubscribe it.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    rank, out = dist.get_rank(), Path(out)
    base = [*common, "--max_steps", str(steps), "--save_steps", str(save_steps)]
    runs = {}
    runs["reference"] = _train([*base, "--checkpoint_format", "full", "--output_dir", str(out / "reference")])
    stopped_dir = out / "stopped"
    if rank == 1:
        _send_usr1_after(stop_after, stopped_dir / "metrics.jsonl")
    runs["stopped"] = _train([*base, "--checkpoint_format", "sharded", "--output_dir", str(stopped_dir)])
    os.environ.pop("MINIDIST_PAUSE_AT", None)
    # What the folder holds when the stopped run has exited: what the next start will find.
    files_after_stop = sorted(str(p.relative_to(stopped_dir)) for p in stopped_dir.rglob("*") if p.is_file())
    dist.barrier()  # listed before the resumed run adds to it
    runs["resumed"] = _train([*base, "--checkpoint_format", "sharded", "--output_dir", str(stopped_dir), "--resume"])
    summary = {name: {"losses": r["losses"], "log": r["log"], "seconds": r["seconds"],
                      "stopped": {k: str(v) for k, v in r.get("stopped", {}).items()}}
               for name, r in runs.items()}
    if rank == 0:
        for name in ("reference", "resumed"):
            summary[name]["parameters"] = runs[name]["parameters"]
    summary["files_after_stop"] = files_after_stop
    return summary


def resume_elsewhere(argv: list[str]) -> dict:
    """Resume a checkpoint on however many ranks this launch has (DCP reshards the flat shards)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    result = _train(argv)
    return {"losses": result["losses"], "log": result["log"], "parameters": result.get("parameters")}
