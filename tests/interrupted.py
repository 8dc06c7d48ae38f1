"""The training script under torchrun on 2 CPU ranks, or in one process of its own, stopped by a
signal at a moment the test chooses (`MINIDIST_PAUSE_AT`, checkpoint/preemption.py's hook): used
by tests/checkpoint and tests/parallel (LoRA's resume)."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository: the ranks import minidist from here


def few_games(folder: Path) -> Path:
    """64 of the bundled games in `folder`/games.jsonl: tokenizing all 3,000 would dominate a short run."""
    from minidist.chess import jsonl
    from minidist.chess.games import bundled_games

    path = folder / "games.jsonl"
    jsonl.write_games(jsonl.load_games(bundled_games("train"))[:64], path)
    return path


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
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "minidist.finetune", *argv]
    return _interrupt(command, log, how, pause_at, ranks=2)


def interrupt_one_process(argv, log: Path, how: signal.Signals, pause_at: str) -> dict:
    """Run `python -m minidist.finetune ARGV` in a process of its own, send `how` at `pause_at`; return its end."""
    return _interrupt([sys.executable, "-m", "minidist.finetune", *argv], log, how, pause_at, ranks=1)


def _interrupt(command, log: Path, how: signal.Signals, pause_at: str, ranks: int) -> dict:
    """Start `command`, wait until its `ranks` ranks paused at `pause_at`, send `how` to the process it
    started, and wait until it and its ranks are gone: `returncode` is the started process's."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "MINIDIST_PAUSE_AT": pause_at}
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    workers = []
    try:
        workers = wait_for_pauses(proc, log, ranks=ranks)
        if how == signal.SIGKILL:  # everything dies at once, workers included, as in a crash
            for pid in workers:
                os.kill(pid, signal.SIGKILL)
        os.kill(proc.pid, how)  # SIGTERM: torchrun forwards it to its workers and waits for them
        proc.wait(timeout=120)
        wait_until_gone(workers)  # ranks whose torchrun died go on alone: give them time to end
    finally:
        for pid in [*workers, proc.pid]:  # nothing outlives the test, whatever failed
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    return {"returncode": proc.returncode, "log": log.read_text()}


def wait_until_gone(pids, timeout_s=120) -> None:
    """Wait until none of `pids` runs any more (they need not be this process's children; a zombie,
    dead but not yet reaped by its new parent, counts as gone)."""
    deadline = time.monotonic() + timeout_s
    while any(_running(pid) for pid in pids):
        assert time.monotonic() < deadline, f"ranks {[pid for pid in pids if _running(pid)]} still run"
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # the state follows the command's name in brackets
