"""Preemption: when the cluster says stop, every rank stops at the same step, with a checkpoint.

Clusters end jobs: a time limit, a job of higher priority, maintenance. They warn first, with a
signal: SLURM sends the one `#SBATCH --signal=B:USR1@300` names, 300 s before the time limit, to the
batch script (which passes it on, see `slurm/chess_finetune.sh`); most schedulers send SIGTERM
some seconds before SIGKILL. torchrun forwards SIGTERM to its workers, and from torch 2.9 the
other signals listed in `--signals_to_handle` (or PET_SIGNALS_TO_HANDLE), SIGUSR1 among them.

A signal interrupts one process at an arbitrary point, maybe while it waits in a collective for
the other ranks, and each rank gets it at a slightly different moment. So the handler only sets a
flag. At every step boundary the ranks vote, an all-reduce of their flags with MAX: if any rank
was signalled, all of them learn it after the same step, save one checkpoint together (`state.py`)
and exit with status 75, EXIT_STOPPED ("EX_TEMPFAIL" in sysexits.h: try again later). Running
the same command with `--resume` continues.

A signal can be lost on its way, though. `srun` passes a signal on only to the tasks it has
already started, so a warning that reaches the batch script in the second between `srun`'s start
and its tasks' start is dropped, and the run would train on until the time limit kills it. So the
batch script also writes a file, MINIDIST_STOP_FILE, before it passes the signal on, and the vote
counts that file's existence as a signal: whichever arrives, the run stops at the next step
boundary (the script deletes the file at each start).

Ctrl-C (SIGINT) is handled the same way. The terminal sends it to the whole foreground process
group, torchrun and every rank, and torchrun sends it on once more. Python's own handler would
raise KeyboardInterrupt wherever the rank happens to be, and where that is a `__del__` (autograd
frees saved tensors through them, `memory/measure.py`), Python prints the exception and carries on:
one rank trained on alone until torchrun's SIGKILL, 30 s later, with nothing saved.

The price: a rank stuck in a collective no longer dies of SIGTERM or Ctrl-C. The collective timeout
(`distributed.py`) ends it, or the SIGKILL that torchrun and SLURM send after their grace period.
"""

import math
import os
import signal
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from minidist.runtime.errors import UsageError

STOP_FILE = "MINIDIST_STOP_FILE"  # the variable naming a file whose existence asks for a stop, like a signal
EXIT_STOPPED = 75  # stopped by SIGTERM/SIGUSR1/SIGINT after saving a checkpoint: run again with --resume
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGINT") if hasattr(signal, name))

_received = None  # the stop signal this process got, if any: all a handler can safely do is set it


def _on_signal(signum, frame):
    global _received
    _received = signum


class StopSignals:
    """While installed, SIGTERM, SIGUSR1 and SIGINT (or the file MINIDIST_STOP_FILE names, once it
    exists) ask for a checkpoint and a stop at the next step boundary."""

    def __init__(self):
        global _received
        _received = None
        self._previous = {signum: signal.signal(signum, _on_signal) for signum in STOP_SIGNALS}
        self.stop_file = os.environ.get(STOP_FILE) or None
        self._file_seen = False

    def received(self) -> str | None:
        """The name of the signal this rank got (or the stop file it saw), if it got one."""
        if _received:
            return signal.Signals(_received).name
        return f"the stop file {self.stop_file}" if self._file_seen else None

    def agreed(self, device, record: dict | None = None) -> bool:
        """Did any rank get a stop signal? A collective: every rank calls it at every step boundary.

        The same vote stops the run on a step whose loss or gradient norm (`record`) is nan or
        infinite: that update has spoiled the weights, and every step and save after it would only
        spread them (the newest checkpoints rotate the good ones out). So every rank raises, before
        this step's save, one line. They vote because a gradient norm can be one rank's own."""
        loss, norm = (record["loss"], float(record["grad_norm"])) if record else (0.0, 0.0)
        self._file_seen = self._file_seen or bool(self.stop_file and os.path.exists(self.stop_file))
        asked = bool(_received) or self._file_seen
        diverged = not (math.isfinite(loss) and math.isfinite(norm))
        vote = torch.tensor([int(asked), int(diverged)], device=device)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        if vote[1].item():
            raise UsageError(f"training diverged: step {record['step']} has loss {loss} and gradient norm {norm}; "
                             f"it was not saved, and the checkpoints before it are intact; lower --learning_rate "
                             f"(or raise --warmup_steps) and start again, or --resume from an earlier checkpoint")
        return bool(vote[0].item())

    def restore(self) -> None:
        """Put back the handlers there were before."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


@contextmanager
def handlers_kept():
    """`with handlers_kept():` the handlers of the stop signals are put back on the way out, even when
    an error ends the run between `StopSignals()` and its `restore()` (a process that lives on, a
    notebook or a test, must get its own Ctrl-C back)."""
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def say_stopped(signal_name: str, step: int, checkpoint) -> None:
    print(f"stopped by {signal_name} after step {step}: saved {checkpoint}; exiting with status "
          f"{EXIT_STOPPED} (run again with --resume to continue)", file=sys.stderr, flush=True)


def pause_if_asked(where: str, step: int) -> None:
    """Fault injection for tests: MINIDIST_PAUSE_AT=save:8 holds every rank in the middle of step
    8's save (its own files written, nothing published), step:3 after step 3, until a signal
    comes (at most 2 minutes): SIGKILL is then a crash at exactly that point; SIGTERM or SIGUSR1
    let it go on."""
    if os.environ.get("MINIDIST_PAUSE_AT") != f"{where}:{step}":
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    print(f"minidist: rank {rank} (pid {os.getpid()}) paused at {where} {step} (MINIDIST_PAUSE_AT); "
          f"waiting for a signal", flush=True)
    parent, deadline = os.getppid(), time.monotonic() + 120
    while _received is None and time.monotonic() < deadline:
        if os.getppid() != parent:  # the launcher was killed: no signal will come through it
            os._exit(1)
        time.sleep(0.05)
