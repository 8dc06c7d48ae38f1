"""The training script under torchrun on 2 CPU ranks, stopped by a signal at a moment the test
chooses (`MINIDIST_PAUSE_AT`, checkpoint/preemption.py's hook): used by tests/checkpoint and
tests/parallel (LoRA's resume)."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository: the ranks import minidist from here


def wait_for_pauses(proc, log: Path, ranks: int, timeout_s=240) -> list[int]:
    """The pids of the ranks that reached MINIDIST_PAUSE_AT, once all of them have."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = [int(pid) for pid in re.findall(r"\(pid (\d+)\) paused at", log.read_text())]
        if len(pids) == ranks:
            return pids
        assert proc.poll() is None, f"torchrun ended before the pause:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"no pause within {timeout_s} s:\n{log.read_text()[-3000:]}")


def interrupt_with_torchrun(argv, log: Path, how: signal.Signals, pause_at: str) -> dict:
    """Run `torchrun -m minidist.finetune ARGV` on 2 ranks, send `how` at `pause_at`; return its end."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "MINIDIST_PAUSE_AT": pause_at}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "minidist.finetune", *argv]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    workers = []
    try:
        workers = wait_for_pauses(proc, log, ranks=2)
        if how == signal.SIGKILL:  # everything dies at once, workers included, as in a crash
            for pid in workers:
                os.kill(pid, signal.SIGKILL)
        os.kill(proc.pid, how)  # SIGTERM: torchrun forwards it to its workers and waits for them
        proc.wait(timeout=120)
    finally:
        for pid in [*workers, proc.pid]:  # nothing outlives the test, whatever failed
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    return {"returncode": proc.returncode, "log": log.read_text()}
