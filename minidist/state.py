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
CPU memory). A *sharded* checkpoint lets each rank write only its own shard with PyTorch's
distributed checkpoint (DCP, `torch.distributed.checkpoint`): no rank ever holds the full state,
all ranks write at once, and DCP records which slice of which tensor each file holds, so a
different world size reads the slices it needs (resharding). To get one file out of it anyway:
`python -m torch.distributed.checkpoint.format_utils dcp_to_torch CHECKPOINT/dcp state.pt`.

Both forms get and set the state through `strategy.get_state_dict` / `set_state_dict`, which
default to PyTorch's `torch.distributed.checkpoint.state_dict` helpers (they understand plain
modules, DDP and FSDP2; FSDP2 saves one DTensor per parameter). The hand-written ZeRO and FSDP
hand out their flat shards instead (`sharded_state.py`): one DTensor per *flat* (a bucket or a
unit, `DTensor.from_local`, `Shard(0)`), and take them back; DCP then saves and reshards them
like FSDP2's, and nothing here changes.

**Atomic.** A save writes `checkpoint-N.tmp/`; every rank fsyncs its files; a barrier; then rank 0
writes `checkpoint.json` (the manifest: what the checkpoint holds and every file's size) and
publishes with one `os.rename` to `checkpoint-N`, then replaces the `latest` pointer (a text file
naming the folder) by the same write-then-rename. A kill at any moment leaves `latest` naming a
complete checkpoint. A rename is atomic within one file system; that is why nothing is ever
published by writing in place. Only the newest K checkpoints are kept (`--save_total_limit`).
On several nodes, `--output_dir` must be a file system they all share, as DCP assumes too.

When a save happens is the loop's business: every `--save_steps`, and when the cluster asks the
run to stop (`preemption.py`).
"""

import json
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from minidist.preemption import pause_if_asked

CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads")  # what fixes the shape of every weight


def model_fingerprint(name_or_path: str) -> dict:
    """The parts of a model's config that fix its weights' shapes: cheap, read before loading it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(name_or_path).to_dict()
    return {key: config.get(key) for key in CONFIG_KEYS}


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


def _write(path: Path, content, text=False) -> None:
    """torch.save (or write text) and fsync: the file is on disk when this returns."""
    with open(path, "w" if text else "wb") as f:
        f.write(content) if text else torch.save(content, f)
        f.flush()
        os.fsync(f.fileno())


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
    """`--resume` alone means `output_dir/latest`; a path is a checkpoint folder or an output dir."""
    path = Path(output_dir if resume == "latest" else resume)
    if (path / "checkpoint.json").exists() or path.name.startswith("checkpoint-"):
        return path
    if not (path / "latest").exists():
        raise ValueError(f"--resume: no checkpoint in {path} (no {path / 'latest'}); "
                         f"drop --resume to start afresh, or pass a checkpoint folder")
    target = path / (path / "latest").read_text().strip()
    if not target.is_dir():
        raise ValueError(f"{path / 'latest'} names {target.name}, which does not exist; "
                         f"pass another checkpoint to --resume")
    return target


def verify(path: Path, run: dict) -> dict:
    """Refuse, in one sentence and before any training, a checkpoint that is incomplete, damaged
    or written by another kind of run; return its manifest."""
    try:
        meta = json.loads((path / "checkpoint.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} is not a complete checkpoint (no checkpoint.json: a save that never finished?); "
                         f"resume from another one") from None
    for name, size in meta["files"].items():
        have = (path / name).stat().st_size if (path / name).exists() else 0
        if have != size:  # a truncated copy, a full disk: sizes catch it without reading everything
            raise ValueError(f"checkpoint {path} is damaged: {name} has {have} of its {size} bytes; "
                             f"resume from another checkpoint or start afresh without --resume")
    for key, what, fix in (("model", "model", "pass the --model it was trained from"),
                           ("strategy", "strategy", "resume with the same --impl and --strategy"),
                           ("global_batch_size", "global batch", "keep batch x ranks x accumulation the same"),
                           ("seed", "seed", "pass its --seed"), ("num_examples", "training data", "pass its --data")):
        theirs, ours = meta["run"][key], run[key]
        if theirs != ours:
            if isinstance(ours, dict):  # a model: name only the config entries that differ
                keys = [k for k in ours if theirs.get(k) != ours[k]]
                theirs = ", ".join(f"{k} {theirs.get(k)}" for k in keys)
                ours = ", ".join(f"{k} {ours[k]}" for k in keys)
            raise ValueError(f"checkpoint {path} was written with another {what} ({theirs}; this run: {ours}); "
                             f"{fix}, or use another --output_dir")
    return meta


# ---------------------------------------------------------------- save and load
class Checkpointer:
    """Save and load the whole training state of one run under `output_dir` (see module doc)."""

    def __init__(self, output_dir, strategy, model, optimizer, scheduler, run: dict, form="sharded",
                 keep=2, tokenizer=None):
        self.root, self.strategy, self.model = Path(output_dir), strategy, model
        self.optimizer, self.scheduler, self.run, self.form = optimizer, scheduler, run, form
        self.keep, self.tokenizer, self.env = keep, tokenizer, strategy.env

    def save(self, step: int, position, metrics_path: Path, extra: dict) -> Path:
        """Every rank calls this at the same step boundary. Returns the published folder."""
        final, rank = self.root / f"checkpoint-{step}", self.env.rank
        tmp = final.with_name(final.name + ".tmp")
        if self.env.is_main:
            for stale in self.root.glob("checkpoint-*.tmp"):  # saves that a kill cut short
                shutil.rmtree(stale)
            tmp.mkdir(parents=True)
        dist.barrier()
        _write(tmp / f"rng-{rank}.pt", _rng_state(self.env.device))
        if self.form == "sharded":
            import torch.distributed.checkpoint as dcp

            model_sd, optim_sd = self.strategy.get_state_dict(self.model, self.optimizer, full=False)
            # Each rank writes its own shard file (and fsyncs it); rank 0 adds DCP's .metadata.
            dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp / "dcp"))
        else:
            model_sd, optim_sd = self.strategy.get_state_dict(self.model, self.optimizer, full=True)
            if self.env.is_main:  # the others got empty dicts: the whole state is on rank 0's CPU
                self.strategy.unwrap(self.model).save_pretrained(tmp / "model", state_dict=model_sd)
                if self.tokenizer is not None:
                    self.tokenizer.save_pretrained(tmp / "model")
                _write(tmp / "optimizer.pt", optim_sd)
            del model_sd, optim_sd
        if self.env.is_main:
            _write(tmp / "scheduler.pt", self.scheduler.state_dict())
            lines = [l for l in metrics_path.read_text().splitlines() if json.loads(l)["step"] <= step]
            _write(tmp / "metrics.jsonl", "".join(l + "\n" for l in lines), text=True)
        pause_if_asked("save", step)
        dist.barrier()  # every shard is on disk: only now may rank 0 publish
        if self.env.is_main:
            self._publish(tmp, final, step, position, extra)
        dist.barrier()  # nobody leaves (and maybe exits) before the checkpoint is published
        return final

    def _publish(self, tmp: Path, final: Path, step: int, position, extra: dict) -> None:
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        meta = {"step": step, "form": self.form, "world_size": self.env.world_size,
                "position": {"epoch": position[0], "offset": position[1]}, "run": self.run,
                "extra": extra, "files": files}
        _write(tmp / "checkpoint.json", json.dumps(meta, indent=1), text=True)  # last: "complete"
        _fsync_tree(tmp)
        old = final.with_name(final.name + ".replaced")
        if final.exists():  # a run resumed from an older checkpoint meets its former future
            final.rename(old)
        tmp.rename(final)
        _fsync(self.root)
        pointer = self.root / "latest.tmp"
        _write(pointer, final.name + "\n", text=True)
        pointer.rename(self.root / "latest")  # atomic: latest names the old or the new, never half
        _fsync(self.root)
        shutil.rmtree(old, ignore_errors=True)
        if self.keep > 0:
            done = sorted((p for p in self.root.glob("checkpoint-*") if p.suffix == "" and p.is_dir()),
                          key=lambda p: int(p.name.split("-")[1]))
            for stale in done[:-self.keep]:
                if stale != final:
                    shutil.rmtree(stale)

    def load(self, path: Path) -> dict:
        """Load a checkpoint that `verify` accepted into the model, optimizer, scheduler and RNGs.

        Returns its step, data position, metrics records and `extra`. Every rank calls it."""
        meta = json.loads((path / "checkpoint.json").read_text())
        if meta["form"] == "sharded":
            import torch.distributed.checkpoint as dcp

            # The live state_dicts say which shard this rank needs; DCP reads just that slice
            # of every tensor into them, whatever the world size that wrote the files.
            model_sd, optim_sd = self.strategy.get_state_dict(self.model, self.optimizer, full=False)
            state = {"model": model_sd, "optimizer": optim_sd}
            dcp.load(state, checkpoint_id=str(path / "dcp"))
            self.strategy.set_state_dict(self.model, self.optimizer, state["model"], state["optimizer"], full=False)
        else:
            model_sd, optim_sd = {}, {}
            if self.env.is_main:  # rank 0 reads the files; set_state_dict broadcasts (and shards)
                from transformers import AutoModelForCausalLM

                model_sd = AutoModelForCausalLM.from_pretrained(path / "model", dtype=torch.float32).state_dict()
                optim_sd = torch.load(path / "optimizer.pt", weights_only=True)
            self.strategy.set_state_dict(self.model, self.optimizer, model_sd, optim_sd, full=True)
        self.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        rng = path / f"rng-{self.env.rank}.pt"
        if rng.exists():  # a rank beyond the saved world size keeps its own seeded generators
            _set_rng_state(torch.load(rng, weights_only=True), self.env.device)
        records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        position = (meta["position"]["epoch"], meta["position"]["offset"])
        return {"step": meta["step"], "position": position, "records": records, "extra": meta["extra"]}

