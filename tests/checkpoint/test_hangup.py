"""A closed terminal (SIGHUP) and a dead launcher are stops too: a checkpoint, then status 75.

SIGHUP is what a run started from a terminal gets when the terminal goes (an ssh session that
drops). A launcher can die without a word to its ranks: torchrun dies of a SIGUSR1 it was not told
to forward (`--signals_to_handle`, which SLURM scripts must set), or of its own SIGKILL. Its ranks
live on, re-parented, and before this they trained to the end holding the folder's lock, with
nothing saved on the way. The ranks are held after step 2 (MINIDIST_PAUSE_AT) until the signal, or
their launcher's death, lets them go on.
"""

import fcntl
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from minidist.checkpoint import output_dir, preemption
from interrupted import few_games, ROOT, interrupt_with_torchrun

# The full suite only: fault injection: runs under torchrun stopped by a hang-up.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def games(tmp_path_factory) -> Path:
    return few_games(tmp_path_factory.mktemp("games"))


@pytest.fixture
def args(tiny_model, games):
    def make(out):  # four steps, stopped after the second; no evaluation, no model: only the stop matters
        return ["--model", tiny_model, "--impl", "torch", "--data", str(games), "--output_dir", str(out),
                "--max_steps", "4", "--max_seq_length", "48", "--eval_prefixes", "0", "--batch_size_per_device", "2",
                "--warmup_steps", "1", "--seed", "3", "--strategy", "ddp", "--no_save"]
    return make


def saved_step_2_and_left(out: Path) -> None:
    """checkpoint-2 named by `latest`, two steps logged, the lock given back."""
    assert (out / "latest").read_text() == "checkpoint-2\n"
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert not (out / output_dir.LOCK).exists() and not list(out.glob("*.tmp"))


def test_a_closed_terminal_saves_and_exits_75(args, tmp_path):
    """The run's terminal is a pseudo-terminal that the test holds open, as a terminal window does.
    Closing it hangs the terminal up: the kernel sends SIGHUP to the run (the leader of its
    session), and from then on every write to the terminal fails."""
    out = tmp_path / "out"
    window, terminal = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "MINIDIST_PAUSE_AT": "step:2"}
    proc = subprocess.Popen([sys.executable, "-m", "minidist.finetune", *args(out)], stdin=terminal, stdout=terminal,
                            stderr=terminal, env=env, start_new_session=True, preexec_fn=_controlled_by_stdin)
    os.close(terminal)
    try:
        shown = _read_until(window, b"paused at step 2", proc)
        os.close(window)  # the window closes
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == preemption.EXIT_STOPPED, shown[-3000:]
    saved_step_2_and_left(out)


def _controlled_by_stdin() -> None:
    """In the new session's process, before it runs Python: make its stdin its controlling terminal,
    and let SIGHUP do what it does in a terminal's shell. A process inherits an ignored signal across
    exec: under `nohup python -m pytest ...` the run would ignore the hang-up and wait for ever."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _read_until(fd: int, mark: bytes, proc, timeout_s=240) -> str:
    """Read what the run shows on its terminal until `mark` (the terminal must be read, or it fills up)."""
    shown, deadline = b"", time.monotonic() + timeout_s
    while mark not in shown:
        assert proc.poll() is None and time.monotonic() < deadline, shown.decode(errors="replace")[-3000:]
        if select.select([fd], [], [], 0.2)[0]:
            shown += os.read(fd, 65536)
    return shown.decode(errors="replace")


def test_ranks_whose_torchrun_died_of_sigusr1_save_and_exit_75(args, tmp_path):
    """torchrun started without `--signals_to_handle`: SIGUSR1 kills it, and only it."""
    out = tmp_path / "out"
    run = interrupt_with_torchrun(args(out), tmp_path / "torchrun.log", signal.SIGUSR1, "step:2")
    assert run["returncode"] == -signal.SIGUSR1  # torchrun itself died of it
    checkpoint = re.escape(str(out / "checkpoint-2"))
    said = rf"stopped by the death of the launcher \(pid \d+\) after step 2: saved {checkpoint};"
    assert len(re.findall(said, run["log"])) == 1, run["log"][-3000:]
    assert f"exiting with status {preemption.EXIT_STOPPED}" in run["log"]
    saved_step_2_and_left(out)


def test_nohup_and_a_run_started_by_hand_outlive_their_terminal(monkeypatch):
    """`nohup python -m minidist.finetune ... &` asks for a run that outlives its terminal: the SIGHUP
    that nohup ignores stays ignored, and the shell that started the run (no launcher set RANK or
    SLURM_PROCID) may exit without it being a stop."""
    for name in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    with preemption.handlers_kept():  # this process's handlers back afterwards, whatever fails
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        by_hand = preemption.StopSignals()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN and by_hand.launcher is None
        monkeypatch.setenv("RANK", "0")  # torchrun's rank: its launcher's death is a stop
        assert preemption.StopSignals().launcher == os.getppid()
