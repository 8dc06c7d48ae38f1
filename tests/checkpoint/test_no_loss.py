"""Nothing lost: damage, divergence, a second run, a full disk and Ctrl-C each end in one line.

Each fault is made for real: bytes overwritten in a checkpoint, a learning rate that overflows,
a live torchrun holding the folder, a small tmpfs that fills up (mounted by the test: CI runs as
root), SIGINT sent to torchrun's whole process group as a terminal's Ctrl-C is. Every case ends in
`minidist.finetune: error: ...` (one line, exit code 2), and the last good checkpoint stays as it
was: `state.verify` (sizes and checksums) still accepts it. Most runs are in this process, on one
rank, with 64 games: the faults are about files and lines, not about ranks. Ctrl-C and the lock
are about processes, so they run under torchrun.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from minidist import finetune
from minidist.checkpoint import disk_room, output_dir, state
from minidist.chess import jsonl
from minidist.chess.games import bundled_games
from minidist.runtime.distributed import cleanup, get_env, init_distributed
from minidist.runtime.errors import UsageError
from minidist.hf.models import load_model
from minidist.strategy.options import ParallelOptions
from minidist.strategy import get_strategy
from in_process import run_here_in_one_line as run_here  # a run that fails says why in one line

# The full suite only: fault injection: runs stopped and resumed, nothing lost.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def games(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("games") / "games.jsonl"  # tokenizing 3,000 games would dominate
    jsonl.write_games(jsonl.load_games(bundled_games("train"))[:64], path)
    return path


@pytest.fixture
def args(tiny_model, games):
    def make(out, *extra):
        return ["--model", tiny_model, "--impl", "torch", "--data", str(games), "--output_dir", str(out),
                "--max_steps", "2", "--max_seq_length", "48", "--eval_prefixes", "0", "--batch_size_per_device", "4",
                "--warmup_steps", "1", "--seed", "3", "--no_save", *extra]
    return make


def intact(checkpoint: Path) -> bool:
    """Does `state.verify` accept it (every size and checksum, the manifest's own included)?"""
    return state.verify(checkpoint, json.loads((checkpoint / "checkpoint.json").read_text())["run"]) == checkpoint


@pytest.fixture(scope="module")
def saved(tiny_model, games, tmp_path_factory):
    """A 2-step run's checkpoint-2 in each form, written once for the module."""
    root = tmp_path_factory.mktemp("saved")
    for form in ("sharded", "full"):
        argv = ["--model", tiny_model, "--impl", "torch", "--data", str(games), "--output_dir", str(root / form),
                "--max_steps", "2", "--max_seq_length", "48", "--eval_prefixes", "0", "--batch_size_per_device", "4",
                "--warmup_steps", "1", "--seed", "3", "--no_save", "--save_steps", "2", "--checkpoint_format", form]
        finetune.main(argv)  # returns: exit status 0
    return {form: root / form / "checkpoint-2" for form in ("sharded", "full")}


def overwrite(path: Path, offset: int, size=4096) -> None:
    """Overwrite `size` bytes at `offset` in place: the file keeps its size, as on a bad disk or copy."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes(range(256)) * (size // 256))


@pytest.mark.parametrize("form", ["sharded", "full"])
def test_a_damaged_checkpoint_is_refused_in_one_line_before_training(saved, args, tmp_path, capsys, form):
    assert intact(saved[form])
    biggest = max((p for p in saved[form].rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    name = str(biggest.relative_to(saved[form]))
    header = "dcp/.metadata" if form == "sharded" else "model/model.safetensors"
    damages = {  # what is done to a copy -> what the line must say
        "middle": (lambda c: overwrite(c / name, (c / name).stat().st_size // 2), f"{name} does not match its checksum"),
        "header": (lambda c: overwrite(c / header, 0, 1024), f"{header} does not match its checksum"),
        "manifest cut": (lambda c: os.truncate(c / "checkpoint.json", 100), "checkpoint.json is damaged"),
        "manifest step": (lambda c: (c / "checkpoint.json").write_text(
            (c / "checkpoint.json").read_text().replace('"step": 2', '"step": 3')), "checkpoint.json is damaged"),
    }
    for case, (damage, says) in damages.items():
        copy = tmp_path / case.replace(" ", "-") / "checkpoint-2"
        shutil.copytree(saved[form], copy)
        damage(copy)
        code, line = run_here(args(copy.parent, "--resume", str(copy), "--checkpoint_format", form, "--max_steps", "4"), capsys)
        assert code == 2 and says in line, (case, line)
        assert not (copy.parent / "metrics.jsonl").exists(), f"{case}: training started"


def test_a_fresh_run_into_another_runs_checkpoints_refuses_unless_told(saved, args, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(saved["sharded"].parent, out)
    code, line = run_here(args(out), capsys)
    assert code == 2 and f"--output_dir {out} holds another run's checkpoints (checkpoint-2, latest)" in line
    code, line = run_here(args(out, "--resume", "--overwrite_output_dir"), capsys)
    assert code == 2 and "pass only one" in line
    code, _ = run_here(args(out, "--overwrite_output_dir", "--max_steps", "1", "--save_steps", "1"), capsys)
    assert code == 0  # a finished run exits 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    assert (out / "latest").read_text() == "checkpoint-1\n" and not (out / output_dir.LOCK).exists()


@pytest.fixture
def tmpfs(tmp_path):
    """Mount a small tmpfs (a real file system that fills up, or is read-only) at a folder. It needs
    root: elsewhere its tests skip and say why; in CI (CI=true), which runs as root, they must run."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run the full-disk and read-only tests, and mounting a tmpfs needs root")
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mounted = []

    def mount(name, options):
        path = tmp_path / name
        path.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_an_output_dir_that_is_a_file_or_read_only_is_refused_in_one_line(args, tmp_path, tmpfs, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder\n")
    code, line = run_here(args(a_file), capsys)
    assert code == 2 and f"--output_dir {a_file} is (or lies under) a file, not a folder" in line
    read_only = tmpfs("read-only", "ro,size=1m")
    code, line = run_here(args(read_only / "run"), capsys)
    assert code == 2 and f"cannot write to --output_dir {read_only / 'run'} (Read-only file system)" in line


@pytest.fixture
def room_looks_ample(monkeypatch):
    """The disk check after step 1 (`checkpoint/disk_room.py`) sees a large free space: the disk fills
    later, as a shared scratch does when another job writes to it. Told the truth about these small
    tmpfs, it stops the run before any save (`tests/checkpoint/test_disk_room.py`), and the save's own
    failure, which these tests are about, would never come."""
    real = shutil.disk_usage
    monkeypatch.setattr(disk_room.shutil, "disk_usage", lambda path: real(path)._replace(free=10**15))


@pytest.mark.parametrize("form", ["sharded", "full"])
def test_a_full_disk_gives_one_line_removes_the_tmp_and_keeps_the_previous_checkpoint(args, tmpfs, capsys, form,
                                                                                      room_looks_ample):
    out = tmpfs(f"full-{form}", "size=7m")  # a checkpoint of the tiny model is 4.4 MB: the second does not fit
    code, line = run_here(args(out, "--max_steps", "3", "--save_steps", "1", "--checkpoint_format", form), capsys)
    assert code == 2, line
    assert (f"could not save checkpoint-2 in {out}: No space left on device; removed checkpoint-2.tmp, "
            f"and {out / 'latest'} still names checkpoint-1") in line
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"] and intact(out / "checkpoint-1")


def test_a_disk_too_small_for_the_run_is_refused_after_step_1_before_any_save(args, tmpfs, capsys):
    """The same 7 MB tmpfs, the disk check told the truth: three checkpoints of 4.2 MB at once (the
    two kept and the one being written) do not fit, and the run stops after step 1, before saving."""
    out = tmpfs("too-small", "size=7m")
    code, line = run_here(args(out, "--max_steps", "3", "--save_steps", "1"), capsys)
    assert code == 2, line
    assert f"--output_dir {out} has 7.3 MB free, and a checkpoint holds 4.2 MB" in line, line
    assert not list(out.glob("checkpoint-*")), list(out.iterdir())


def test_a_full_disk_at_the_final_model_gives_one_line_and_leaves_no_half_written_model(args, tmpfs, capsys,
                                                                                        room_looks_ample):
    out = tmpfs("full-at-the-end", "size=1m")  # metrics and eval.json fit; the 1.4 MB model does not
    argv = [a for a in args(out) if a != "--no_save"]
    code, line = run_here(argv, capsys)
    assert code == 2, line
    assert (f"could not write the fine-tuned model to {out / 'model'}: No space left on device; removed model.tmp; "
            f"no checkpoint was saved (--save_steps 0), so the training must run again") in line
    assert not (out / "model").exists() and not (out / "model.tmp").exists()


def test_a_full_disk_under_torchrun_is_one_line_and_the_other_rank_stops_quietly(args, tmpfs, tmp_path):
    """Rank 0 alone writes metrics.jsonl: on a full disk it stops in one line while rank 1 waits in
    the step's stop vote, whose connection then closes. Rank 1 follows without a traceback.

    One 4 KiB page: the run's lock takes it, and step 1's record does not fit. torchrun tees each
    rank's stderr to a file of its own (--log-dir), so what each rank wrote is read apart from
    torchrun's summary (a traceback of its own, ChildFailedError, whenever a rank fails)."""
    out, logs = tmpfs("one-page", "size=4k"), tmp_path / "logs"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "--log-dir", str(logs), "--tee", "2", "-m", "minidist.finetune",
                           *args(out / "run", "--batch_size_per_device", "2", "--strategy", "ddp")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    line = (f"minidist.finetune: error: could not write {out / 'run' / 'metrics.jsonl'}: No space left on device; "
            f"free some space and run again with --resume")
    printed, summary = done.stderr.split("Root Cause")  # torchrun's summary names the line as the root cause
    assert done.returncode != 0 and printed.count(line) == 1 and f"traceback : {line}" in summary, done.stderr
    ranks = {int(path.parent.name): path.read_text() for path in logs.glob("*/attempt_0/*/stderr.log")}
    assert sorted(ranks) == [0, 1], done.stderr
    assert line in ranks[0].splitlines() and "Traceback" not in ranks[0], ranks[0]
    assert "Traceback" not in ranks[1] and "error" not in ranks[1].lower(), ranks[1]


def test_a_non_finite_loss_stops_the_run_and_never_replaces_a_good_checkpoint(args, tmp_path, capsys):
    out = tmp_path / "huge-lr"
    # Step 1's update moves every weight by about 1e30 (Adam): still finite, saved; step 2's loss is nan.
    # Those weights gave it: checkpoint-1 is moved aside, not offered to --resume (tests/loop/test_divergence.py).
    code, line = run_here(args(out, "--max_steps", "4", "--save_steps", "1", "--learning_rate", "1e30"), capsys)
    assert code == 2 and "training diverged: the loss was nan at step 2" in line
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1.diverged"]
    assert not (out / "latest").exists()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_weights_that_are_not_finite_are_never_saved(tiny_model, tmp_path):
    """However they got so (an update that overflowed, a fault), nan weights never replace a checkpoint."""
    init_distributed()
    try:
        strategy = get_strategy(ParallelOptions("fsdp", "torch"), get_env())
        model = strategy.wrap(load_model(tiny_model))
        optimizer = strategy.build_optimizer(model, 1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        metrics = tmp_path / "metrics.jsonl"
        metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2)))
        run = {"model": {}, "strategy": "torch/fsdp", "global_batch_size": 4, "seed": 0, "num_examples": 2}
        checkpoints = state.Checkpointer(tmp_path, strategy, model, optimizer, scheduler, run, form="sharded")
        checkpoints.save(1, (0, 4), metrics, {})
        with torch.no_grad():
            next(model.parameters()).to_local()[0, 0] = float("nan")
        with pytest.raises(UsageError, match="the weights after step 2 are not finite"):
            checkpoints.save(2, (0, 8), metrics, {})
    finally:
        cleanup()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]
    assert (tmp_path / "latest").read_text() == "checkpoint-1\n" and intact(tmp_path / "checkpoint-1")


def test_a_lock_is_taken_over_only_when_stale(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid is now no process's (for the moment this test needs)
    (out / output_dir.LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": gone.pid}))
    with output_dir.claimed(out, is_main=True):
        assert json.loads((out / output_dir.LOCK).read_text())["pid"] == os.getpid()
    assert not (out / output_dir.LOCK).exists()
    # Another host's run cannot be checked from here: refused, and its lock left as it was...
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    (out / output_dir.LOCK).write_text(json.dumps({"host": "another-node", "pid": 1234, "job": "41"}))
    with pytest.raises(UsageError, match="in use by a live run \\(pid 1234 on host another-node"):
        with output_dir.claimed(out, is_main=True):
            pass
    assert json.loads((out / output_dir.LOCK).read_text())["host"] == "another-node"
    # ...unless it is an earlier start of this very job, requeued (on another node, maybe).
    (out / output_dir.LOCK).write_text(json.dumps({"host": "another-node", "pid": 1234, "job": "42"}))
    with output_dir.claimed(out, is_main=True):
        assert json.loads((out / output_dir.LOCK).read_text())["host"] == socket.gethostname()
    # A save cut short (a job killed in its first save restarts without --resume) is no other run's.
    (out / "checkpoint-4.tmp").mkdir()
    with output_dir.claimed(out, is_main=True):
        pass


def test_ctrl_c_under_torchrun_saves_and_stops_every_rank_and_a_second_run_is_refused(args, tmp_path, capsys):
    """The terminal sends SIGINT to the whole foreground process group: torchrun and its ranks."""
    out, log = tmp_path / "out", tmp_path / "torchrun.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "MINIDIST_PAUSE_AT": "step:2"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "minidist.finetune", *args(out, "--max_steps", "8", "--batch_size_per_device", "2",
                                               "--strategy", "ddp")]
    with open(log, "w") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while log.read_text().count("paused at step 2") < 2:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        holder = json.loads((out / output_dir.LOCK).read_text())["pid"]
        code, line = run_here(args(out), capsys)  # a second run, into the folder the first one is using
        assert code == 2 and f"--output_dir {out} is in use by a live run (pid {holder} on this host" in line
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert f"stopped by SIGINT after step 2: saved {out / 'checkpoint-2'}" in text, text[-3000:]
    assert took < 20, f"{took:.0f} s to stop"  # torchrun would SIGKILL the ranks after 30 s
    assert (out / "latest").read_text() == "checkpoint-2\n" and intact(out / "checkpoint-2")
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert not list(out.glob("*.tmp")) and not (out / output_dir.LOCK).exists()
