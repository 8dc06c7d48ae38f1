"""One run of the training script inside ranks that `minidist.runtime.launch` started.

Every lesson's workers (workers_NN.py) run the real training script, `minidist.finetune.train`,
with the flags a learner would type. `run` here is the plumbing around that call, written once:
an output folder all ranks agree on, the loop's log kept instead of printed by every rank, and
the records of metrics.jsonl read back on rank 0, before the folder is deleted.
"""

import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minidist import finetune


def share_cores() -> None:
    """N ranks on a laptop share its cores: one thread pool per rank as wide as the machine would
    oversubscribe it (2 ranks x 2 threads on 2 cores run slower than 2 x 1), and step times would
    measure the contention."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))


# What kineto (torch.profiler's C++ core) writes to the process's stderr at every start and stop of a
# recording ("USDT:... profiler_start", "STAGE:... Completed Stage"), whatever KINETO_LOG_LEVEL says.
PROFILER_NOTICES = ("USDT:", "STAGE:")


@contextlib.contextmanager
def without_profiler_notices():
    """Run the block with this process's stderr (file descriptor 2, where C++ writes) caught, then pass
    on every line but kineto's notices. A rank's stderr is the notebook's: there those notices come out
    red under the cell, like an error, on every run. Anything else written meanwhile still appears."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            for line in caught.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith(PROFILER_NOTICES):
                    sys.stderr.write(line)
            sys.stderr.flush()


def progress(message: str) -> None:
    """Print `message` on rank 0 at once. A rank writes to the notebook kernel's own output, which
    ipykernel forwards to the running cell: so the learner sees the ranks get on while the launch
    lasts, one line per finished piece of work, not silence until every rank is done."""
    if dist.get_rank() == 0:
        print(message, flush=True)


def shown(argv: list[str]) -> str:
    """The flags of a run as a learner would compare them: every flag but those that name a path
    (the model, the data, an output folder), which say nothing about the run and differ by machine."""
    kept, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg.startswith("--") and i + 1 < len(argv) and "/" in argv[i + 1]:
            skip = True
        elif "/" not in arg:
            kept.append(arg)
    return " ".join(kept)


def as_flags(run: dict) -> list[str]:
    """{"strategy": "fsdp", "gradient_checkpointing": True} -> ["--strategy", "fsdp", "--gradient_checkpointing"]."""
    argv = []
    for name, value in run.items():
        if value is True:
            argv.append(f"--{name}")
        elif value not in (False, None):
            argv += [f"--{name}", str(value)]
    return argv


def run(argv: list[str], around_train_step=None, announce: bool = True) -> dict:
    """`finetune.train` with ARGV and a fresh `--output_dir`, on every rank. Returns what it
    returned (`result`: losses, and the full weights on rank 0 unless `--no_save`), the records of
    its metrics.jsonl (`records`, on rank 0; [] on the others), the lines it printed on this rank
    (`log`) and its wall time (`seconds`: loading, evaluations and steps). `around_train_step` is
    passed on to `finetune.train`: a measurement's way into every step (`workers_06.py`). With
    `announce`, rank 0 prints one line when the run is done (`progress`): its flags and seconds."""
    with tempfile.TemporaryDirectory() as out:
        shared = [out]  # every rank needs the same folder name: rank 0 picks it, the others follow
        dist.broadcast_object_list(shared, src=0)
        args = finetune.parse_args([*argv, "--output_dir", shared[0]])
        printed = io.StringIO()  # returned, so the notebook shows one run's log, not every rank's
        started = time.perf_counter()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
            result = finetune.train(args, around_train_step)
        seconds = time.perf_counter() - started
        dist.barrier()  # rank 0 has written and closed metrics.jsonl
        log = Path(shared[0]) / "metrics.jsonl"
        records = [json.loads(line) for line in log.read_text().splitlines()] if dist.get_rank() == 0 else []
        dist.barrier()  # nobody deletes the folder before rank 0 has read it
    if announce:
        progress(f"  ranks: trained {shown(argv)} in {seconds:.1f} s")
    return {"result": result, "records": records, "log": printed.getvalue(), "seconds": seconds}


def run_each(common: list[str], runs: dict[str, list[str]]) -> dict:
    """`run` once per entry of `runs` (name -> extra flags, added after `common`, with `--no_save`),
    one after the other in the same ranks. By name, rank 0's view: the flags, the records of
    `metrics.jsonl` (one per step; `memory_bytes` holds lists by rank), the legal-move rates before
    and after training (None with `--eval_prefixes 0`), the lines the script printed, its wall time."""
    results = {}
    for name, extra in runs.items():
        done = run([*common, *extra, "--no_save"])
        result = done["result"]
        results[name] = {"flags": extra, "records": done["records"], "rate_before": result["rate_before"],
                         "rate_after": result.get("rate_after"), "log": done["log"], "seconds": done["seconds"]}
    return results
