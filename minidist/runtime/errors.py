"""The one kind of error a learner should see as one line, not as a traceback.

A wrong flag, a missing file, a size that does not divide, a damaged checkpoint: these are
mistakes fixed by changing an input, and a 40-line traceback only hides the sentence that says
how. Code anywhere in minidist raises `UsageError` with that sentence; the commands run their
body inside `one_line_errors`, which prints it alone, with exit code 2 (argparse's code for a bad
command line). Bugs stay tracebacks.

Under a launcher (torchrun, srun) every rank usually meets the same mistake, and two more things
matter:

- **Once, and first.** Rank 0 prints the line; the other ranks stay quiet. torchrun stops every
  rank and prints its own 30-line summary as soon as one rank exits, so the other ranks first
  wait (a few seconds at most) until rank 0 says it has printed: the learner's line comes before
  anything torchrun says. A rank whose mistake rank 0 did not share prints its own line.
- **Named as the root cause.** torchrun's summary shows, for the rank that failed first, what
  that rank wrote to its error file (the path is in `TORCHELASTIC_ERROR_FILE`; see
  `torch.distributed.elastic.multiprocessing.errors`). Every failing rank writes the line there,
  in that module's format, so the summary's "Root Cause" is the line, not "To enable traceback
  see ...".
- **The others follow in silence.** A mistake only one rank meets (rank 0 alone writes
  `metrics.jsonl`: a full disk there) ends that rank while the others wait in a collective for it;
  its exit closes their connections, and gloo raises "Connection closed by peer" in each. That
  error only repeats the one already told, so a rank whose command fails after another rank has
  printed its line (every rank that prints sets a key in the group's store before it exits) exits
  with status 2 and prints nothing; its torchelastic error file says why it stopped. A failure with
  no line printed before it is a bug, and stays a traceback.
"""

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from datetime import timedelta

_SAID = "minidist/usage_error_printed"  # the key rank 0 sets in the process group's store
_TOLD = "minidist/a_rank_printed_its_line"  # the key every rank that printed sets (the others follow quietly)
WAIT_FOR_RANK_0_S = 5.0


class UsageError(Exception):
    """A mistake the learner fixes by changing a flag, a file or a size: told in one line."""


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")).strip()
    size = os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")).strip()
    if rank.isdigit() and size.isdigit() and int(rank) < int(size):
        return int(rank)
    return 0  # numbers no launcher writes (RANK=abc, RANK=2 of 2) are the mistake: this process tells it itself


def _store():
    """The process group's key-value store (torchrun's own, or rank 0's), or None before there is a group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()  # no public accessor; stable since PyTorch 1.x


def record_for_torchrun(line: str) -> None:
    """Write `line` to this rank's torchelastic error file, where torchrun's summary reads it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # ErrorHandler.record_exception's format; py_callstack is what the summary prints as "traceback".
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the line itself is still printed; a summary without it is no reason for a traceback


def _rank_0_has_printed() -> bool:
    """On a rank other than 0: wait until rank 0 says it printed its line (True), or a few seconds (False)."""
    store = _store()
    if store is None:  # a mistake on the command line, before the group exists: every rank shares it
        time.sleep(1.0)  # (rank 0 parses the same flags at the same moment; give it that moment)
        return True
    start = time.monotonic()
    try:
        store.wait([_SAID], timedelta(seconds=WAIT_FOR_RANK_0_S))
        return True
    except Exception:  # a timeout; or the store went away with rank 0, which exits only after printing
        return time.monotonic() - start < WAIT_FOR_RANK_0_S * 0.9


def _set(*keys: str) -> None:
    """Set `keys` in the process group's store, if there is one."""
    store = _store()
    if store is None:
        return
    try:
        for key in keys:
            store.set(key, "1")
    except Exception:
        pass  # a store that is gone has nobody waiting on it


def _a_rank_has_printed() -> bool:
    """Has a rank of this group printed its one line already? Asked without waiting; no store
    (no group, or a store that left with its rank) means no."""
    store = _store()
    if store is None:
        return False
    try:
        return store.check([_TOLD])
    except Exception:
        return False


def fail(prog: str, message, usage: str = ""):
    """Say `prog: error: message` once (rank 0), record it for torchrun, and exit with status 2."""
    line = f"{prog}: error: {message}"
    record_for_torchrun(line)
    if _rank() == 0:
        print(usage + line, file=sys.stderr, flush=True)
        _set(_SAID, _TOLD)  # before this rank exits, and its exit breaks the others' collectives
    elif not _rank_0_has_printed():
        print(line, file=sys.stderr, flush=True)
        _set(_TOLD)
    sys.exit(2)


def follow(prog: str):
    """Exit with status 2 without a word: another rank has told the learner why the run stops, and
    this rank's own failure (a collective whose peer left) follows from it. torchrun's summary
    lists this rank with the reason, under the other rank's line."""
    record_for_torchrun(f"{prog}: rank {_rank()} stopped because another rank stopped (its line is printed above)")
    sys.exit(2)


@contextmanager
def one_line_errors(prog: str, *also: type[BaseException]):
    """Run a command's body: a UsageError (and the classes in `also`, where the command knows they
    can only mean bad input) ends as one line and exit status 2 (`fail`). Any other failure after
    another rank printed its line ends this rank quietly (`follow`); else it is raised."""
    try:
        yield
    except (UsageError, *also) as err:
        fail(prog, err)
    except Exception:
        if not _a_rank_has_printed():
            raise  # nobody has said why: a bug, and its traceback
        follow(prog)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose errors go through `fail`: printed by rank 0 alone, named by torchrun."""

    def error(self, message):
        fail(self.prog, message, usage=self.format_usage())
