"""The ranks of test_state.py's first runs that `launch` starts: each runs the training script as
`torchrun ... -m minidist.finetune` would run it in a worker, until MINIDIST_PAUSE_AT holds it, and
the test signals every rank there itself: SIGKILL (the rank never returns) or SIGTERM."""

import os
import sys

from minidist import finetune


def run_until_signalled(argv, pause_at: str, log: str) -> int:
    """`python -m minidist.finetune ARGV` with MINIDIST_PAUSE_AT=`pause_at`, this rank's stdout and
    stderr appended to `log`, where the test reads each rank's pid from the pause's line ("(pid N)
    paused at"); return the status the script exits with (0 when it returns)."""
    os.environ["MINIDIST_PAUSE_AT"] = pause_at  # read when the run reaches the point (preemption.pause_if_asked)
    sys.stdout.flush()
    sys.stderr.flush()
    with open(log, "a") as out:  # append: both ranks write whole lines into the one file
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    try:
        finetune.main(argv)
    except SystemExit as stop:
        return stop.code
    return 0
