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

SIGHUP too: it is what a run started from a terminal gets when the terminal closes (an ssh
session that drops), and what torchrun passes on when it gets one. A closed terminal fails every
write to it, so the handler also points stdout and stderr at /dev/null when they were that
terminal: the stop's line is lost, its checkpoint is not. A SIGHUP ignored from the start stays
ignored: that is `nohup`, asking for a run that outlives its terminal.

A launcher can also die without a word to its ranks: torchrun dies of a SIGUSR1 it was not told
to forward (`--signals_to_handle`), or of a SIGKILL. Its ranks live on, re-parented to an
ancestor that reaps orphans, and would train to the end holding the output folder's lock, with
nothing saved on the way. So the vote counts a rank's parent gone as a signal too: each rank keeps
its parent's pid from the start (`os.getppid()`), and a different one at a step boundary means its
parent is dead. Only a launcher's (torchrun and `runtime/launch.py` set RANK, srun SLURM_PROCID):
a run started by hand may outlive the shell that started it, on purpose (`nohup`, `disown`). (Linux can instead send the child a signal when its parent dies,
`prctl(PR_SET_PDEATHSIG)`; but that is Linux alone, it must be set in the child by code running
right after the fork, which is the launcher's, and it fires when the *thread* that started the
child ends, not its process. A system call per step costs nothing beside a step.) It sees only a
death after the stop signals were caught: a rank that was orphaned before keeps its new parent.

Ctrl-C (SIGINT) is handled the same way. The terminal sends it to the whole foreground process
group, torchrun and every rank, and torchrun sends it on once more. Python's own handler would
raise KeyboardInterrupt wherever the rank happens to be, and where that is a `__del__` (autograd
frees saved tensors through them, `memory/measure.py`), Python prints the exception and carries on:
one rank trained on alone until torchrun's SIGKILL, 30 s later, with nothing saved.

The price: a rank stuck in a collective no longer dies of SIGTERM or Ctrl-C. The collective timeout
(`distributed.py`) ends it, or the SIGKILL that torchrun and SLURM send after their grace period.
"""

import errno
import os
import signal
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

STOP_FILE = "MINIDIST_STOP_FILE"  # the variable naming a file whose existence asks for a stop, like a signal
EXIT_STOPPED = 75  # stopped by a signal (or the stop file, or a dead launcher) after saving: run again with --resume
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGINT", "SIGHUP")
                     if hasattr(signal, name))

_received = None  # the stop signal this process got, if any: all a handler can safely do is set it


def _on_signal(signum, frame):
    global _received
    _received = signum
    if signum == getattr(signal, "SIGHUP", None):
        _leave_a_closed_terminal()


def _leave_a_closed_terminal() -> None:
    """After SIGHUP, stdout and stderr may be a terminal that is gone: every write to it fails
    (EIO), and the next `print`, the step's line, would end the run before its save. Such a
    descriptor is pointed at /dev/null, as `nohup` does; a file or a pipe (a log, torchrun's) stays."""
    import termios  # Unix only, as SIGHUP is

    for fd in (1, 2):
        try:
            termios.tcgetattr(fd)
        except termios.error as err:
            if err.args[0] == errno.EIO:  # a terminal, hung up (a file or a pipe says ENOTTY)
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)


class StopSignals:
    """While installed, SIGTERM, SIGUSR1, SIGINT and SIGHUP (or the file MINIDIST_STOP_FILE names,
    once it exists, or the death of this rank's launcher) ask for a checkpoint and a stop at the
    next step boundary."""

    def __init__(self):
        global _received
        _received = None
        nohup = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN if hasattr(signal, "SIGHUP") else False
        self._previous = {signum: signal.signal(signum, _on_signal) for signum in STOP_SIGNALS
                          if not (nohup and signum == signal.SIGHUP)}
        self.stop_file = os.environ.get(STOP_FILE) or None
        self._file_seen = False
        launched = "RANK" in os.environ or "SLURM_PROCID" in os.environ  # else started by hand (see above)
        self.launcher = os.getppid() if launched else None  # while the launcher lives, this stays its pid

    def received(self) -> str | None:
        """The name of the signal this rank got (or the stop file it saw, or its launcher's death), if any."""
        if _received:
            return signal.Signals(_received).name
        if self._file_seen:
            return f"the stop file {self.stop_file}"
        return f"the death of the launcher (pid {self.launcher})" if self._orphaned() else None

    def _orphaned(self) -> bool:
        """Is this rank's launcher dead? Then the rank was re-parented, and its parent changed (see above)."""
        return self.launcher is not None and os.getppid() != self.launcher

    def agreed(self, device, diverged: bool = False) -> tuple[bool, bool]:
        """Did any rank get a stop signal, and did any rank see its run diverge (`diverged`, from
        `runtime/divergence.Watch`)? A collective: every rank calls it at every step boundary.

        Divergence rides on the same vote, because a gradient norm can be one rank's own, and every
        rank must stop after the same step, before its save: that update has spoiled the weights, and
        every step and save after it would only spread them (the session keeps the last good checkpoint)."""
        self._file_seen = self._file_seen or bool(self.stop_file and os.path.exists(self.stop_file))
        asked = bool(_received) or self._file_seen or self._orphaned()
        vote = torch.tensor([int(asked), int(diverged)], device=device)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        anyone_asked, anyone_diverged = vote.tolist()  # one read of both: one wait for the device, not two
        return bool(anyone_asked), bool(anyone_diverged)

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


def say_stopped(signal_name: str, step: int, checkpoint, during: str | None = None, kept: bool = False) -> None:
    """One line on stderr: what stopped the run, where (after a step, or `during` the final evaluation
    or model write), and the checkpoint that holds it (saved now, or `kept`: saved before for that step)."""
    where = f"during {during} after step {step}" if during else f"after step {step}"
    print(f"stopped by {signal_name} {where}: {'kept' if kept else 'saved'} {checkpoint}; exiting with status "
          f"{EXIT_STOPPED} (run again with --resume to continue)", file=sys.stderr, flush=True)


def pause_if_asked(where: str, step: int) -> None:
    """Fault injection for tests: MINIDIST_PAUSE_AT=save:8 holds every rank in the middle of step
    8's save (its own files written, nothing published), step:3 after step 3, eval:8 before the
    final evaluation, write:8 before the final model write, until a signal comes (at most 2
    minutes) or the launcher dies: SIGKILL is then a crash at exactly that point; SIGTERM or
    SIGUSR1 let it go on."""
    if os.environ.get("MINIDIST_PAUSE_AT") != f"{where}:{step}":
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    print(f"minidist: rank {rank} (pid {os.getpid()}) paused at {where} {step} (MINIDIST_PAUSE_AT); "
          f"waiting for a signal", flush=True)
    parent, deadline = os.getppid(), time.monotonic() + 120
    # A launcher that was killed sends no signal: its death too lets the rank go on.
    while _received is None and os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.05)
