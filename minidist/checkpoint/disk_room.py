"""Room on the disk for a run's checkpoints and model, checked after its first step, in one line.

A sharded checkpoint of CodeLlama-7b with AdamW holds 80.9 GB: fp32 weights and two fp32 moments,
12 bytes for each of its 6.74e9 parameters. `--save_total_limit 2` keeps two, but the rotation
runs after the next one is published, so three are on the disk at once, 243 GB, and the fine-tuned
model comes on top (13.5 GB in bf16). A home folder's quota is full long before that; a run that
finds out at its third save has lost the hours before it. So, after the first step of every start
(the first moment the optimizer's state exists to be counted), rank 0 says in one line how much
the run will write at most and how much the output folder's file system has free (with
`--save_steps`; a run without saves only a stop's checkpoint and the model, and says nothing when
they fit), and every rank stops in one line if it does not fit. (A quota may be smaller than the file system's free space:
`quota -s`, or the site's own tool, says what is left of it.)

How big a checkpoint is, is counted, not guessed: it is what DCP would write for the state the
strategy hands a save (`Strategy.get_state_dict(full=False)`). DCP writes every key once: a
`DTensor` as the whole tensor it is a piece of (its pieces on the ranks that hold them), a plain
tensor once even where every rank holds a copy (DDP's weights, the norms under tensor parallelism),
and a pipeline's stages each under keys of their own. So every rank lists its keys with their whole
sizes, the ranks exchange the lists and join them, and the sum is the checkpoint's payload; the
files around it (DCP's metadata, the RNG states, the scheduler) add a few kilobytes per rank.

How many are on the disk at once follows from the rotation (`state.Checkpointer._rotate`): with
`keep` kept and `e` complete ones already there, a save adds one folder and then removes the
oldest beyond `keep`; so at most `min(saves, max(keep - e, 0) + 1)` new ones at once, where
`saves` counts the `--save_steps` saves left in this start and one more for a stop signal. With
`--save_total_limit 0` (keep all) every save stays.
"""

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from minidist.checkpoint.output_dir import checkpoint_step
from minidist.runtime.errors import UsageError


def _leaves(value, path=()):
    """Every tensor in a (nested) state dict, with the path of keys that leads to it."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _leaves(inner, (*path, str(key)))
    elif isinstance(value, (list, tuple)):
        for i, inner in enumerate(value):
            yield from _leaves(inner, (*path, str(i)))
    elif isinstance(value, torch.Tensor):
        yield path, value


def whole_sizes(model_sd: dict, optim_sd: dict) -> dict[tuple, int]:
    """This rank's keys -> the bytes DCP writes for each: a DTensor's whole tensor, a tensor's own."""
    sizes = {}
    for path, tensor in _leaves({"model": model_sd, "optimizer": optim_sd}):
        # DTensor.numel() is the whole tensor's, not this rank's piece.
        sizes[path] = tensor.numel() * tensor.element_size()
    return sizes


def checkpoint_bytes(strategy, model, optimizer) -> int:
    """A collective: the bytes of tensors in one sharded checkpoint of this run, on every rank."""
    model_sd, optim_sd = strategy.get_state_dict(model, optimizer, full=False)
    sizes = whole_sizes(model_sd, optim_sd)
    del model_sd, optim_sd
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sizes)
        sizes = {path: size for theirs in everyone for path, size in theirs.items()}  # each key once
    return sum(sizes.values())


def new_checkpoints_at_once(saves: int, keep: int, existing: int) -> int:
    """At most how many checkpoints this start adds to the disk at once (see module doc)."""
    if keep <= 0:
        return saves
    return min(saves, max(keep - existing, 0) + 1)


def saves_left(first_step: int, max_steps: int, save_steps: int) -> int:
    """The saves from step `first_step` to `max_steps`: every `save_steps`-th step, and one for a stop."""
    planned = 0
    if save_steps > 0:
        planned = max_steps // save_steps - (first_step - 1) // save_steps
    return planned + 1


def size(n: int) -> str:
    """Bytes as a person reads them: MB below a GB, TB from a thousand GB on."""
    if n >= 1e12:
        return f"{n / 1e12:.2f} TB"
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def check(out: Path, checkpoint: int, model: int, saves: int, keep: int) -> str:
    """On rank 0: the line to print, or a UsageError where the run will not fit on `out`'s disk.
    `checkpoint` and `model` are bytes (model 0: `--no_save`), `saves` what `saves_left` counts."""
    existing = sum(1 for p in out.iterdir() if checkpoint_step(p.name) is not None and p.is_dir())
    at_once = new_checkpoints_at_once(saves, keep, existing)
    needed = at_once * checkpoint + model
    free = shutil.disk_usage(out).free
    some = f"{at_once} checkpoint{'s' * (at_once != 1)}"
    if at_once == saves:  # every save left stays on the disk (few saves, or --save_total_limit 0)
        kept = f"{some}: {saves - 1} by --save_steps and one if a stop signal asks for it"
        if saves == 1:
            kept = f"{some}, if a stop signal asks for it (--save_steps saves none in this start)"
    else:
        kept = f"{some} at once: the {keep} kept (--save_total_limit) and the one being written"
    kept += f", besides the {existing} already there" if existing else ""
    product = f"the fine-tuned model {size(model)}" if model else "no fine-tuned model (--no_save)"
    plan = (f"a checkpoint holds {size(checkpoint)} and {product}; this start writes up to {size(needed)} more "
            f"({kept}{', then the model' if model else ''})")
    if needed > free:
        raise UsageError(f"--output_dir {out} has {size(free)} free, and {plan}: choose an --output_dir on a larger "
                         f"disk (a scratch file system; OUTPUT_DIR= for the SLURM scripts), free some space, or keep "
                         f"fewer checkpoints (--save_total_limit 1)")
    return f"disk: {plan}; {out} has {size(free)} free (a quota may allow less: quota -s)"
