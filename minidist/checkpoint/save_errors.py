"""A checkpoint that cannot be written (a full disk, a quota, a read-only file system), or must not be.

Such a save must fail on every rank alike, leave nothing behind and say why in one line: the
`.tmp` folder is removed (left, it would keep the disk full), the previous checkpoint and `latest`
stay as they were, and the run stops with a `UsageError`. Two things make that harder than a
`try`:

- **Every rank must learn it.** A write fails on one rank (its shard, or rank 0's manifest); the
  others would go on into the next collective and wait there until the timeout. So after the
  writes the ranks compare their outcomes in one `all_gather_object`, and all stop together.
- **The cause is wrapped.** `torch.save` reports a full disk as `RuntimeError: ... unexpected pos`
  (the `OSError` only as its `__context__`), safetensors as a message with "os error 28", and DCP
  gathers each rank's failure into a `CheckpointException` after pickling it, which drops the
  context. So the cause is looked for in the chain first, and else read from the file system itself
  (`os.statvfs`: no space left, or mounted read-only). A failure that is neither is a bug, and
  stays a traceback.

And a checkpoint that must not be written: weights that are nan or infinite. An update can overflow
while the loss that led to it was finite, and a save of that state would rotate a good checkpoint
out for a useless one. So before every save the ranks check their shards of the weights, and vote.
"""

import errno
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from minidist.runtime.errors import UsageError


def reason(err: BaseException, folder: Path) -> str | None:
    """Why writing under `folder` failed, if it is the disk's fault (see module doc); else None."""
    seen = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return os.strerror(seen.errno)
        if match := re.search(r"os error (\d+)", str(seen)):
            return os.strerror(int(match[1]))
        seen = seen.__cause__ or seen.__context__
    try:
        fs = os.statvfs(folder)
    except OSError:
        return None
    if fs.f_flag & os.ST_RDONLY:
        return os.strerror(errno.EROFS)
    if fs.f_bavail * fs.f_frsize < (1 << 20):  # less than 1 MiB left: the write ran out of room
        return os.strerror(errno.ENOSPC)
    return None


def agree(failure: BaseException | None, folder: Path) -> str | None:
    """A collective: every rank passes its own failure (or None) and gets the same answer, the
    first failed rank's reason. A failure that is not the disk's is raised on its own rank."""
    mine = None if failure is None else (reason(failure, folder) or "bug")
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    if mine == "bug":
        raise failure
    failed = [(rank, why) for rank, why in enumerate(everyone) if why is not None]
    if not failed:
        return None
    rank, why = failed[0]
    return why if why != "bug" else f"rank {rank} failed (its traceback is above)"


def give_up_if(why: str | None, tmp: Path, step: int, is_main: bool) -> None:
    """If the save failed (`why`, from `agree`), remove its `.tmp` and stop every rank in one line."""
    if why is None:
        return
    root, latest = tmp.parent, tmp.parent / "latest"
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left, it would keep the disk full
        (root / "latest.tmp").unlink(missing_ok=True)
    if latest.exists():
        kept, again = f"{latest} still names {latest.read_text().strip()}", "run again with --resume"
    else:  # nothing to resume from: --resume would only be refused
        kept, again = "there is no earlier checkpoint", "run again (from the start: there is nothing to resume)"
    raise UsageError(f"could not save checkpoint-{step} in {root}: {why}; removed {tmp.name}, and {kept}; "
                     f"free some space (or lower --save_total_limit) and {again}")


def refuse_non_finite(optimizer, device, step: int) -> None:
    """Stop every rank in one line if any rank's weights (the ones its optimizer updates: its shards
    of the masters) hold a nan or an infinity. A collective vote."""
    local = [p.to_local() if hasattr(p, "to_local") else p for g in optimizer.param_groups for p in g["params"]]
    finite = torch.stack([torch.isfinite(p).all() for p in local]).all() if local else torch.tensor(True)
    vote = finite.to(device=device, dtype=torch.int32).reshape(1)
    if dist.is_initialized():
        dist.all_reduce(vote, op=dist.ReduceOp.MIN)
    if not vote.item():
        # Not always the learning rate: a bf16/fp16 overflow or a batch of bad data end the same way.
        raise UsageError(f"training diverged: the weights after step {step} are not finite (nan or inf), so they were "
                         f"not saved; look at the last steps' loss and grad_norm in metrics.jsonl (a learning rate too "
                         f"high, an overflow in --mixed_precision bf16, or bad data), then resume from an earlier "
                         f"checkpoint (--resume) if there is one, or start again")
