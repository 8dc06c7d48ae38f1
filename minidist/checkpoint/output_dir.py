"""The output folder belongs to one run at a time, and never mixes two runs' checkpoints.

`--output_dir` holds a run's `metrics.jsonl`, its checkpoints, the `latest` pointer and the final
model. Three mistakes would lose or mix them; each is refused at the start, before the model loads,
in one line (`claimed`):

- **Two live runs, one folder.** Both append to `metrics.jsonl` (the lines interleave), each
  deletes the other's `checkpoint-N.tmp` as a save cut short, and the rotation removes the other's
  checkpoints. So rank 0 takes a lock: it writes `minidist.lock` (its host and pid) under a private
  name and hard-links it to the lock's name, which fails if the lock exists: of two runs that try at
  once, exactly one gets it, and a lock is never seen half-written. It is removed when the run
  ends. A lock whose run was killed (SIGKILL leaves no time to remove it) is *stale*, and taken
  over, when its host is this one and no process has its pid any more, or when it names this very
  SLURM job (`SLURM_JOB_ID`): a requeued job keeps its id, may start on another node, and its
  earlier start is gone. (A pid can be reused: then a stale lock looks live, and the message says
  which pid to check.) Any other lock from another host cannot be checked from here: the message
  names it, to be removed by hand if that run is gone.
- **A fresh run into another run's checkpoints.** Its `latest` would name the old run's newest
  checkpoint, and the rotation (`--save_total_limit`) would keep the old run's higher-numbered
  checkpoints and delete the new ones. Refused, unless `--resume` (continue that run) or
  `--overwrite_output_dir` (delete its checkpoints and `latest` first). Only the names minidist
  writes count (`OURS`): a user's `checkpoint-best/` neither blocks a run nor is deleted.
- **A folder that cannot be written**: a file of that name, a read-only file system, no permission.
"""

import json
import os
import re
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from minidist.runtime.errors import UsageError

LOCK = "minidist.lock"
# The names minidist writes in an output folder, and the only ones it ever renames or deletes:
# `checkpoint-<step>` (published), `.tmp` (being written), `.replaced` (an older save of the same
# step, moved aside for a moment), and the `latest` pointer. A user's `checkpoint-best/` or
# `checkpoint-4-backup/` is none of them, and is left alone.
CHECKPOINT = re.compile(r"checkpoint-(\d+)")
OURS = re.compile(r"checkpoint-\d+(\.tmp|\.replaced)?|latest(\.tmp)?")


def checkpoint_step(name: str) -> int | None:
    """The step of a published checkpoint's folder name (`checkpoint-12` -> 12); None for any other name."""
    match = CHECKPOINT.fullmatch(name)
    return int(match[1]) if match else None


@contextmanager
def claimed(output_dir, is_main: bool, resume: str | None = None, overwrite: bool = False):
    """`with claimed(output_dir, is_main, resume, overwrite):` this run owns `output_dir` (see module
    doc); `resume` and `overwrite` are the run's `--resume` and `--overwrite_output_dir`. Every rank
    enters it; rank 0 checks and locks, and tells the others: all of them refuse together, or none."""
    out, problem, locked = Path(output_dir), None, False
    if is_main:
        try:
            problem = _lock(out)
            locked = problem is None
            problem = problem or _other_runs(out, resume, overwrite)
        except (FileExistsError, NotADirectoryError):
            problem = f"--output_dir {out} is (or lies under) a file, not a folder; pass a folder"
        except OSError as err:
            problem = f"cannot write to --output_dir {out} ({err.strerror}); pass a folder this run may write to"
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    try:
        if problem:
            raise UsageError(problem)
        yield
    finally:
        if locked:
            _unlock(out)


def _mine() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID")}


def _lock(out: Path) -> str | None:
    """Take the lock, taking over a stale one; or say who holds it."""
    out.mkdir(parents=True, exist_ok=True)
    lock, private = out / LOCK, out / f"{LOCK}.{socket.gethostname()}.{os.getpid()}"
    if lock.is_dir() or lock.is_symlink():  # not the file minidist writes, and not its to remove
        return (f"{lock} is a {'link' if lock.is_symlink() else 'folder'}, not the lock file minidist writes there; "
                f"remove it, or pass another --output_dir")
    private.write_text(json.dumps(_mine()) + "\n")
    try:
        for _ in range(2):
            try:
                os.link(private, lock)  # atomic, and fails if the lock exists
                return None
            except FileExistsError:
                holder = _holder(lock)
                if holder is not None and _alive(holder) and holder != _mine():
                    where = "this host" if holder["host"] == socket.gethostname() else f"host {holder['host']}"
                    return (f"--output_dir {out} is in use by a live run (pid {holder['pid']} on {where}, "
                            f"{lock}); wait for it, pass another --output_dir, or remove the lock if no run uses it")
                lock.unlink(missing_ok=True)  # stale, or this process's own from an earlier run
        return f"could not take the lock {lock}: another run took it at the same moment; pass another --output_dir"
    finally:
        private.unlink(missing_ok=True)


def _holder(lock: Path) -> dict | None:
    try:
        holder = json.loads(lock.read_text())
        return {"host": str(holder["host"]), "pid": int(holder["pid"]), "job": holder.get("job")}
    except (OSError, ValueError, KeyError, TypeError):
        return None  # gone meanwhile, or not a lock we wrote: nobody holds it


def _alive(holder: dict) -> bool:
    if holder["job"] is not None and holder["job"] == os.environ.get("SLURM_JOB_ID"):
        return False  # an earlier start of this job, requeued (see module doc)
    if holder["host"] != socket.gethostname():
        return True  # cannot tell from here: assume the run is alive (see module doc)
    try:
        os.kill(holder["pid"], 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, and belongs to another user
    return True


def _unlock(out: Path) -> None:
    if _holder(out / LOCK) == _mine():  # never remove a lock that another run took over
        (out / LOCK).unlink(missing_ok=True)


def _other_runs(out: Path, resume, overwrite: bool) -> str | None:
    """Refuse a fresh run into another run's checkpoints, or clear them with --overwrite_output_dir."""
    if resume and overwrite:
        return "--resume continues the run in --output_dir and --overwrite_output_dir deletes it: pass only one"
    # A `.tmp` is a save cut short, removed by the next save: a job killed in its first save restarts
    # without --resume (no `latest` yet), and must not be refused for it.
    found = sorted(p.name for p in out.iterdir() if OURS.fullmatch(p.name) and not p.name.endswith(".tmp"))
    if resume or not found:
        return None
    if not overwrite:
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        return (f"--output_dir {out} holds another run's checkpoints ({shown}); pass --resume to continue that "
                f"run, --overwrite_output_dir to delete them and start afresh, or another --output_dir")
    for name in found:  # a link goes as a link: what it points to is not this run's to delete
        path = out / name
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    return None
