"""Training state: save all of it, atomically, and resume from it exactly.

A run that is killed (a time limit, a preemption, a crash) must continue *exactly* where it
stopped: same weights, same Adam moments, same learning-rate step, same next batch, same random
numbers. So a checkpoint holds the whole training state, not just the model:

- the model's and the optimizer's `state_dict`, keyed by parameter name;
- the LR scheduler's `state_dict` (its step count);
- every rank's random number generators (torch's CPU and CUDA ones, Python's `random`; numpy's
  is not used here, add it if your data pipeline draws from it);
- the step, and with it the data position (epoch, offset): `GlobalBatchSampler` makes global
  batch k a function of the seed and k alone, so the step *is* the position, and the run's seed,
  global batch and data size are saved to refuse a resume that would read other data;
- the metrics so far, so that `metrics.jsonl` goes on with no step lost or repeated.

**Two forms.** A *full* checkpoint gathers the model to rank 0 and writes it as a Hugging Face
folder (`checkpoint-N/model`, which `from_pretrained` loads), with the optimizer consolidated
into one `optimizer.pt`: portable, but rank 0 must hold everything (for 7B with AdamW: 81 GB of
CPU memory). Under LoRA that folder is the adapter alone (`PeftModel.from_pretrained` loads it);
a resume takes the frozen base from the model it loaded, as the first run did (`lora.py`). A
*sharded* checkpoint lets each rank write only its own shard with PyTorch's distributed
checkpoint (DCP, `torch.distributed.checkpoint`): no rank ever holds the full state, all ranks
write at once, and DCP records which slice of which tensor each file holds, so a different world
size reads the slices it needs (resharding). To get one file out of it anyway:
`python -m torch.distributed.checkpoint.format_utils dcp_to_torch CHECKPOINT/dcp state.pt`.

Both forms get and set the state through `strategy.get_state_dict` / `set_state_dict`, which
default to PyTorch's `torch.distributed.checkpoint.state_dict` helpers (they understand plain
modules, DDP and FSDP2; FSDP2 saves one DTensor per parameter). The hand-written ZeRO and FSDP
hand out their flat shards instead (`parallel/flat_state.py`): one DTensor per *flat* (a bucket
or a unit, `DTensor.from_local`, `Shard(0)`), and take them back; DCP then saves and reshards
them like FSDP2's, and nothing here changes.

**Atomic.** A save writes `checkpoint-N.tmp/`; every rank fsyncs its files; the ranks compare
outcomes (a full disk fails the save on all of them, and the `.tmp` goes: `save_errors.py`); the
ranks hash the files together (`checksums.py`); then rank 0 writes `checkpoint.json` (the
manifest: what the checkpoint holds, every file's size and checksum, and a checksum of the
manifest itself) and publishes with one `os.rename` to `checkpoint-N`, then replaces the `latest`
pointer (a text file naming the folder) by the same write-then-rename. A rename is atomic within
one file system; that is why nothing is ever published by writing in place. Only the newest K
checkpoints are kept (`--save_total_limit`), removed after `latest` moved on, manifest first.

**Safe at every instant.** A kill can come between any two of those system calls, and the
requeued job must go on by itself. `latest` names a complete checkpoint at every instant but one:
after the run's first checkpoint is renamed into place and before `latest` exists. And a run
resumed from an older checkpoint can reach a step it had saved before: its save points `latest`
at the newest other complete checkpoint first, then renames the old `checkpoint-N` aside to
`checkpoint-N.replaced` and the new one to `checkpoint-N`. So `find` never trusts `latest` alone:
when it is missing, or names a folder that is gone or incomplete, `--resume` goes on from the
newest complete checkpoint and says so in a line (`tests/checkpoint/test_kill_at_every_step.py`
resumes the folder a kill at every rename and fsync leaves). A checkpoint is complete when its
manifest is intact and every file has its size; `verify` then checks every byte of the one chosen.
Rotation, the clean-up of `.tmp` folders and `--overwrite_output_dir` touch only the names minidist
writes (`output_dir.OURS`): a user's `checkpoint-best/` is left alone. A link under one of those
names (an archived checkpoint linked in to resume from) is not minidist's folder: it is removed as
a link, never followed, and what it names keeps every file. The manifest's paths are plain relative
names of regular files inside the checkpoint (`_manifest`), and so are DCP's (`data_only.py`): minidist
never writes, deletes or reads through a path it did not create inside `--output_dir`.

**Data, never code.** DCP's `.metadata` is a pickle, and so are a sharded checkpoint's non-tensor
entries: read by PyTorch's own reader they run whatever they name. They are read through
`data_only.py`, which admits the checkpoint's own types alone; the checksums would not stop a
planted payload, since whoever hands over a folder can recompute them.

On several nodes, `--output_dir` must be a file system they all share, as DCP assumes too.

When a save happens is the session's business (`session.py`), asked by the loop after every step:
every `--save_steps`, and when the cluster asks the run to stop (`preemption.py`).
"""

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from minidist.checkpoint import checksums, data_only, save_errors
from minidist.checkpoint.output_dir import checkpoint_step
from minidist.checkpoint.preemption import pause_if_asked
from minidist.hf import lora
from minidist.runtime.errors import UsageError
from minidist.strategy.state import check_recorded_layouts


def model_fingerprint(name_or_path: str) -> dict:
    """What fixes the shape of every weight, read from the config before the model loads: its
    `model_type` and every whole number in it (and every unset one), whatever the config calls it.
    Llama names its width `hidden_size`, GPT-2 `n_embd` (and `n_inner` None means 4 x `n_embd`): a
    list of names would miss one architecture or the other, and a checkpoint of another width would
    pass, to die in a traceback while loading."""
    from minidist.hf.models import load_config

    config = load_config(name_or_path).to_dict()
    sizes = {key: value for key, value in sorted(config.items())
             if value is None or (isinstance(value, int) and not isinstance(value, bool))}
    return {"model_type": config.get("model_type"), **sizes}


def data_fingerprint(games: list[str]) -> str:
    """A hash of the training games, in order (global batch k is a function of their order): another
    file with as many games is other data. Hashing the bundled 3,000 games takes about 10 ms."""
    digest = hashlib.sha256()
    for game in games:
        digest.update(game.encode())
        digest.update(b"\0")  # two games are never read as one
    return f"sha256:{digest.hexdigest()[:16]}"


# What a resume must share with the run that saved the checkpoint: the key in the run's fingerprint
# (finetune._check), the words naming it, and how to put it right. The data, its order and the
# sequence length fix the batches; warm-up and step count fix the learning-rate schedule's shape.
# Two changes are honoured and announced instead (finetune._resumed): the schedule's peak (an
# explicit --learning_rate rescales it) and --max_steps (train on to another step count, or stop
# sooner). The cosine decays towards max_steps, so another count changes the rate from the resume
# on: the line says so. Both are recorded (`run`), so the resumed run can tell what changed.
RESUMED_AS_SAVED = (
    ("model", "model", "pass the --model it was trained from"),
    ("strategy", "strategy", "resume with the same --impl, --strategy and --lora_* flags"),
    ("global_batch_size", "global batch", "keep batch x ranks x accumulation the same"),
    ("seed", "seed", "pass its --seed"),
    ("num_examples", "number of training games", "pass its --data"),
    ("data", "training data", "pass its --data (the same games, in the same order)"),
    ("max_seq_length", "--max_seq_length", "pass its --max_seq_length"),
    ("warmup_steps", "--warmup_steps", "pass its --warmup_steps (only the peak, --learning_rate, may change)"),
)


# ---------------------------------------------------------------- files, written durably
def _fsync(path: Path) -> None:
    """Ask the OS to put a file (or a folder's list of names) on disk, not just in its cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            _fsync(Path(folder) / name)
        _fsync(Path(folder))


def _remove(checkpoint: Path) -> None:
    """Delete a checkpoint folder, its manifest first: cut short by a kill, what is left is never
    taken for a complete checkpoint (`complete`). A link of that name is not minidist's folder: the
    link goes, and nothing it points to (an archived checkpoint linked in to resume from)."""
    if checkpoint.is_symlink():
        checkpoint.unlink()
    elif checkpoint.exists():
        (checkpoint / "checkpoint.json").unlink(missing_ok=True)
        _fsync(checkpoint)
        shutil.rmtree(checkpoint)


def _named_by_latest(root: Path) -> str | None:
    latest = root / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def _write(path: Path, content, text=False) -> None:
    """torch.save (or write text) and fsync: the file is on disk when this returns."""
    with open(path, "w" if text else "wb") as f:
        f.write(content) if text else torch.save(content, f)
        f.flush()
        os.fsync(f.fileno())


def _manifest_checksum(meta: dict) -> str:
    """checkpoint.json's own checksum, of everything else in it: a damaged step number is refused too."""
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()


def _load_data(path: Path):
    """`torch.load(path, weights_only=True)`, its refusal of a pickled object one line that says the
    file is not plain data (torch's own message advises `weights_only=False`, which would run it)."""
    import pickle

    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        named = [line.strip() for line in str(err).splitlines() if "GLOBAL" in line]
        raise UsageError(data_only.refusal(path, f"it names {named[0] if named else 'an object'}")) from None


def _rng_state(device) -> dict:
    version, state, gauss = random.getstate()
    rng = {"torch": torch.get_rng_state(), "python": (version, torch.tensor(state), gauss)}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def _set_rng_state(rng: dict, device) -> None:
    torch.set_rng_state(rng["torch"])
    version, state, gauss = rng["python"]
    random.setstate((version, tuple(state.tolist()), gauss))
    if device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], device)


# ---------------------------------------------------------------- finding and checking a checkpoint
def find(resume: str, output_dir) -> Path:
    """`--resume` alone means the checkpoint `output_dir/latest` names; a path is a checkpoint folder
    or an output folder. Every rank calls it.

    `latest` names a complete checkpoint at every instant but two, both a kill in the middle of a
    save (see the module doc): after the first checkpoint is published and before `latest` exists,
    and while an older save of the same step is moved aside. Then, and whenever the checkpoint it
    names is missing or incomplete, the newest complete checkpoint is resumed instead, in a line
    that says so: a requeued job goes on by itself. A `latest` minidist cannot have written (a
    folder, a name outside the output folder) is refused in one line."""
    path = Path(output_dir if resume == "latest" else resume)
    if resume != "latest" and not path.is_dir():  # a typo, or the checkpoint.json itself
        what = "a file" if path.exists() else "not there"
        raise ValueError(f"--resume {path} is {what}; pass a checkpoint folder (checkpoint-<step>) or an output "
                         f"folder, or drop the path to resume the newest checkpoint of --output_dir")
    if (path / "checkpoint.json").exists() or path.name.startswith("checkpoint-"):
        return path
    latest = path / "latest"
    if latest.is_dir():
        raise ValueError(f"{latest} is a folder, not the one-line file minidist writes there; remove it, "
                         f"or pass a checkpoint folder to --resume")
    named = latest.read_text().strip() if latest.exists() else None
    if named is not None and checkpoint_step(named) is None:  # "../run/checkpoint-3", "/x", "checkpoint-best"
        raise ValueError(f"{latest} names {named!r}, which is not a checkpoint of this output folder "
                         f"(checkpoint-<step>); fix or remove it, or pass a checkpoint folder to --resume")
    if named is not None and complete(path / named):
        return path / named
    newest = newest_complete(path)
    if newest is None and named is None:
        raise ValueError(f"--resume: no checkpoint in {path} (no {latest}); drop --resume to start afresh, "
                         f"or pass a checkpoint folder")
    if newest is None:
        raise ValueError(f"{latest} names {named}, which does not exist or is incomplete, and {path} holds no "
                         f"other complete checkpoint; pass another checkpoint to --resume")
    if not dist.is_initialized() or dist.get_rank() == 0:
        why = f"{latest} names {named}, which is missing or incomplete" if named else f"there is no {latest}"
        print(f"{why} (a save was cut short); resuming from the newest complete checkpoint, {newest.name}", flush=True)
    return newest


def complete(path: Path) -> bool:
    """Is `path` a whole checkpoint: its manifest intact, every file it lists there at its full size?
    (What a kill can leave half done; `verify` then checks every byte of the one chosen.)"""
    try:
        _manifest(path)
        return True
    except ValueError:
        return False


def newest_complete(root: Path, besides: Path | None = None, aside_too: bool = True) -> Path | None:
    """The complete checkpoint of the highest step in `root` (`checkpoint-<step>`, not `besides`; a
    `.replaced` one, an older save moved aside, only if `aside_too` and no other is complete), or None."""
    found = [(not name.endswith(".replaced"), step, root / name) for name in os.listdir(root)
             if (step := checkpoint_step(name.removesuffix(".replaced" if aside_too else ""))) is not None
             and root / name != besides and (root / name).is_dir() and not (root / name).is_symlink()]
    return next((path for *_, path in sorted(found, reverse=True) if complete(path)), None)


def _manifest(path: Path) -> dict:
    """`path/checkpoint.json`, if intact (its own checksum) and every file it lists has its size;
    else ValueError, one line."""
    manifest = path / "checkpoint.json"
    try:
        meta = json.loads(manifest.read_text())
        files, sums = meta["files"], meta["checksums"]
        intact = meta.pop("manifest_checksum") == _manifest_checksum(meta) and files.keys() == sums.keys()
    except FileNotFoundError:
        raise ValueError(f"{path} is not a complete checkpoint (no checkpoint.json: a save that never finished?); "
                         f"resume from another one") from None
    except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, or not our manifest
        intact = False
    if not intact:
        raise ValueError(f"{manifest} is damaged (it does not match its own checksum, or is not a minidist "
                         f"manifest); resume from another checkpoint or start afresh without --resume")
    for name, size in files.items():
        if not data_only.plain_relative(name) or type(size) is not int:  # "../../../etc/hostname", "/x"
            raise ValueError(f"{manifest} lists {name!r}, which is not a file inside the checkpoint; resume from "
                             f"another checkpoint or start afresh without --resume")
        found = os.lstat(path / name) if os.path.lexists(path / name) else None
        if found and data_only.regular_file_inside(path, name) is None:  # a FIFO would block the checksum forever
            raise ValueError(f"checkpoint {path} is damaged: {name} is not a regular file of its own (a link, a "
                             f"pipe, a socket or a device); resume from another checkpoint or start afresh without "
                             f"--resume")
        have = found.st_size if found else 0
        if have != size:  # a truncated copy, a full disk: sizes catch it without reading everything
            raise ValueError(f"checkpoint {path} is damaged: {name} has {have} of its {size} bytes; "
                             f"resume from another checkpoint or start afresh without --resume")
    position = meta.get("position")
    if type(meta.get("step")) is not int or meta.get("form") not in ("sharded", "full") or not isinstance(
            position, dict) or not all(type(position.get(k)) is int for k in ("epoch", "offset")):  # edited, resealed
        raise ValueError(f"{manifest} is damaged: its step, form or position is not what minidist writes; resume "
                         f"from another checkpoint or start afresh without --resume")
    return meta


def verify(path: Path, run: dict) -> Path:
    """Refuse, in one sentence and before any training, a checkpoint that is incomplete, damaged,
    not plain data or written by another kind of run (each entry of `RESUMED_AS_SAVED` that `run`
    holds, named with both values), or by an older minidist that did not record one of them; return
    its path. Every rank calls it (it hashes the files)."""
    meta = _manifest(path)
    files, sums = meta["files"], meta["checksums"]
    found = checksums.file_checksums(path, list(files))  # every rank hashes its share of the pieces
    for name in files:
        if found[name] != sums[name]:  # bytes overwritten in place: only a checksum sees it
            raise ValueError(f"checkpoint {path} is damaged: {name} does not match its checksum (its bytes "
                             f"changed since the save); resume from another checkpoint or start afresh "
                             f"without --resume")
    if meta["form"] == "sharded":  # DCP's metadata is a pickle: read it as data, or refuse it (data_only.py)
        unlisted = sorted(f"dcp/{name}" for name in data_only.check(path / "dcp") if f"dcp/{name}" not in files)
        if unlisted:  # every byte read must be one the checksums vouch for
            raise ValueError(f"checkpoint {path} is damaged: its dcp/.metadata reads {unlisted[0]}, which its "
                             f"manifest does not list; resume from another checkpoint or start afresh without --resume")
    missing = [key for key, *_ in RESUMED_AS_SAVED if key in run and key not in meta["run"]]
    if missing:  # written before every setting above was recorded: it cannot be checked, so it is refused
        raise ValueError(f"checkpoint {path} was written by an older minidist, which did not record its "
                         f"{', '.join(missing)}; it cannot be resumed safely: start afresh (--overwrite_output_dir)")
    for key, what, fix in (row for row in RESUMED_AS_SAVED if row[0] in run):
        theirs, ours = meta["run"][key], run[key]
        if theirs != ours:
            if isinstance(ours, dict):  # a model: name only the config entries that differ
                keys = [k for k in sorted(theirs.keys() | ours.keys()) if theirs.get(k) != ours.get(k)]
                theirs = ", ".join(f"{k} {theirs.get(k)}" for k in keys)
                ours = ", ".join(f"{k} {ours.get(k)}" for k in keys)
            raise ValueError(f"checkpoint {path} was written with another {what} ({theirs}; this run: {ours}); "
                             f"{fix}, or use another --output_dir")
    return path


# ---------------------------------------------------------------- save and load
class Checkpointer:
    """Save and load the whole training state of one run under `output_dir` (see module doc)."""

    def __init__(self, output_dir, strategy, model, optimizer, scheduler, run: dict, form="sharded",
                 keep=2, tokenizer=None):
        self.root, self.strategy, self.model = Path(output_dir), strategy, model
        self.optimizer, self.scheduler, self.run, self.form = optimizer, scheduler, run, form
        self.keep, self.tokenizer, self.env = keep, tokenizer, strategy.env

    def save(self, step: int, position, metrics_path: Path, extra: dict) -> Path:
        """Every rank calls this at the same step boundary. Returns the published folder. A full
        disk fails it on every rank at once, in one line, with the `.tmp` removed (`save_errors.py`)."""
        save_errors.refuse_non_finite(self.optimizer, self.env.device, step)  # never a nan state over a good one
        self._refuse_if_gone(step)
        final, rank = self.root / f"checkpoint-{step}", self.env.rank
        tmp = final.with_name(final.name + ".tmp")
        failure = None  # this rank's first failed write; the ranks compare them before publishing

        def attempt(write) -> None:  # not after a failure; and a collective never inside one
            nonlocal failure
            if failure is None:
                try:
                    write()
                except Exception as err:  # noqa: BLE001 (save_errors.agree tells the disk's faults from bugs)
                    failure = err

        if self.env.is_main:
            attempt(lambda: [_remove(self.root / name) for name in os.listdir(self.root)  # cut short (a link: unlinked)
                             if name.endswith(".tmp") and checkpoint_step(name.removesuffix(".tmp")) is not None])
            attempt(lambda: tmp.mkdir(parents=True))
        dist.barrier()
        attempt(lambda: _write(tmp / f"rng-{rank}.pt", _rng_state(self.env.device)))
        if self.form == "sharded":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.api import CheckpointException

            model_sd, optim_sd = self.strategy.get_state_dict(self.model, self.optimizer, full=False)
            try:  # Each rank writes its own shard file (and fsyncs it); rank 0 adds DCP's .metadata.
                dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp / "dcp"))
            except (Exception, CheckpointException) as err:  # DCP raises on every rank if one failed
                failure = failure or err
        else:
            model_sd, optim_sd = self.strategy.get_state_dict(self.model, self.optimizer, full=True)
            if self.env.is_main:  # the others got empty dicts: the whole state is on rank 0's CPU
                attempt(lambda sd=model_sd: self.strategy.model_to_save(self.model).save_pretrained(tmp / "model", state_dict=sd))
                if self.tokenizer is not None:
                    attempt(lambda: self.tokenizer.save_pretrained(tmp / "model"))
                attempt(lambda sd=optim_sd: _write(tmp / "optimizer.pt", sd))
        del model_sd, optim_sd
        if self.env.is_main:
            lines = [line for line in metrics_path.read_text().splitlines() if json.loads(line)["step"] <= step]
            attempt(lambda: _write(tmp / "scheduler.pt", self.scheduler.state_dict()))
            attempt(lambda: _write(tmp / "metrics.jsonl", "".join(line + "\n" for line in lines), text=True))
        pause_if_asked("save", step)
        # Every rank has written (or failed): only if all succeeded may rank 0 publish.
        save_errors.give_up_if(save_errors.agree(failure, self.root), tmp, step, self.env.is_main)
        sums = checksums.folder_checksums(tmp)  # every rank hashes its share of the pieces
        failure = None
        if self.env.is_main:
            attempt(lambda: self._publish(tmp, final, step, position, extra, sums))
        # Nobody leaves (and maybe exits) before the checkpoint is published, or learns it was not.
        save_errors.give_up_if(save_errors.agree(failure, self.root), tmp, step, self.env.is_main)
        return final

    def _refuse_if_gone(self, step: int) -> None:
        """Stop every rank in one line if the output folder was removed during the run (rank 0 looks,
        and tells the others): a save would make a new, empty one and find no metrics.jsonl in it."""
        gone = [not self.root.is_dir()]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(gone, src=0)
        if gone[0]:
            raise UsageError(f"--output_dir {self.root} is gone (removed during the run), and with it this run's "
                             f"checkpoints and metrics.jsonl; nothing was saved at step {step}: start again, with an "
                             f"--output_dir nothing else removes")

    def _publish(self, tmp: Path, final: Path, step: int, position, extra: dict, sums: dict) -> None:
        files = {name: (tmp / name).stat().st_size for name in sums}
        meta = {"step": step, "form": self.form, "world_size": self.env.world_size,
                "position": {"epoch": position[0], "offset": position[1]}, "run": self.run,
                "extra": extra, "files": files, "checksums": sums}
        meta["manifest_checksum"] = _manifest_checksum(meta)
        _write(tmp / "checkpoint.json", json.dumps(meta, indent=1), text=True)  # last: "complete"
        _fsync_tree(tmp)
        old = final.with_name(final.name + ".replaced")
        if final.exists():  # a run resumed from an older checkpoint meets its former future
            _remove(old)  # a .replaced left by a save killed earlier
            if _named_by_latest(self.root) == final.name:  # never let latest name a folder moved aside
                self._point_latest_to(newest_complete(self.root, besides=final, aside_too=False))
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync(self.root)
        self._point_latest_to(final)
        _remove(old)
        self._rotate(keep_also=final)

    def _point_latest_to(self, checkpoint: Path | None) -> None:
        """Make `latest` name `checkpoint` (or remove it, for None): write `latest.tmp`, fsync it,
        rename it over `latest` (atomic: latest names the old or the new, never half), fsync the folder."""
        pointer = self.root / "latest.tmp"
        if checkpoint is None:
            (self.root / "latest").unlink(missing_ok=True)
        else:
            _write(pointer, checkpoint.name + "\n", text=True)
            os.rename(pointer, self.root / "latest")
        _fsync(self.root)

    def set_aside(self, from_step: int) -> tuple[Path | None, list[str]]:
        """After a divergence (rank 0): the checkpoints of `from_step` and later hold weights that gave
        a diverged loss. `latest` is pointed at the newest complete checkpoint before them (or removed:
        none), then each is renamed to `checkpoint-<step>.diverged`, kept for a look but no name
        `--resume`, the rotation or `--overwrite_output_dir` ever picks (`output_dir.OURS`). In that
        order: a kill between the two never leaves `latest` naming a bad one. Returns the good one
        (or None) and the names moved aside."""
        steps = sorted(step for name in os.listdir(self.root)
                       if (step := checkpoint_step(name)) is not None and (self.root / name).is_dir())
        good = next((self.root / f"checkpoint-{step}" for step in reversed(steps)
                     if step < from_step and complete(self.root / f"checkpoint-{step}")), None)
        bad = [f"checkpoint-{step}" for step in steps if step >= from_step]
        if bad:
            self._point_latest_to(good)
        for name in bad:
            aside = self.root / f"{name}.diverged"
            if aside.exists() or aside.is_symlink():  # an earlier divergence at the same step: the newer one is kept
                _remove(aside)
            os.rename(self.root / name, aside)
        if bad:
            _fsync(self.root)
        return good, bad

    def _rotate(self, keep_also: Path) -> None:
        """Keep the newest `keep` checkpoints (and `keep_also`, the one latest names); remove the rest.
        Only `checkpoint-<step>` folders: a user's `checkpoint-best/` is not minidist's to delete."""
        if self.keep <= 0:
            return
        steps = sorted(step for name in os.listdir(self.root)
                       if (step := checkpoint_step(name)) is not None and (self.root / name).is_dir())
        for step in steps[:-self.keep]:
            if self.root / f"checkpoint-{step}" != keep_also:
                _remove(self.root / f"checkpoint-{step}")

    def load(self, path: Path) -> dict:
        """Load a checkpoint that `verify` accepted into the model, optimizer, scheduler and RNGs.

        Returns its step, data position, metrics records and `extra`. Every rank calls it."""
        meta = json.loads((path / "checkpoint.json").read_text())
        if meta["form"] == "sharded":
            # The live state_dicts say which shard this rank needs; DCP reads just that slice
            # of every tensor into them, whatever the world size that wrote the files. It reads
            # through minidist's reader and planner, which unpickle nothing but data (data_only.py).
            model_sd, optim_sd = self.strategy.get_state_dict(self.model, self.optimizer, full=False)
            check_recorded_layouts(path, data_only.saved_keys(path / "dcp"), optim_sd)
            state = {"model": model_sd, "optimizer": optim_sd}
            data_only.load(state, path / "dcp")
            self.strategy.set_state_dict(self.model, self.optimizer, state["model"], state["optimizer"], full=False)
        else:
            model_sd, optim_sd = {}, {}
            # LoRA: `model` is the adapter alone; the frozen base is the live one (every rank gathers it)
            live = self.strategy.full_state_dict(self.model) if lora.is_peft(self.strategy.unwrap(self.model)) else None
            if self.env.is_main:  # rank 0 reads the files; set_state_dict broadcasts (and shards)
                from transformers import AutoModelForCausalLM

                model_sd = (lora.with_saved_adapter(live, path / "model") if live is not None else
                            AutoModelForCausalLM.from_pretrained(path / "model", dtype=torch.float32).state_dict())
                optim_sd = _load_data(path / "optimizer.pt")
            self.strategy.set_state_dict(self.model, self.optimizer, model_sd, optim_sd, full=True)
        self.scheduler.load_state_dict(_load_data(path / "scheduler.pt"))
        rng = path / f"rng-{self.env.rank}.pt"
        if rng.exists():  # a rank beyond the saved world size keeps its own seeded generators
            _set_rng_state(_load_data(rng), self.env.device)
        records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        position = (meta["position"]["epoch"], meta["position"]["offset"])
        return {"step": meta["step"], "position": position, "records": records, "extra": meta["extra"],
                "run": meta["run"]}

