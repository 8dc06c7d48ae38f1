"""The ranks of test_kill_at_every_step.py: saves whose every rename and fsync is a kill point.

A process killed (SIGKILL, an OOM kill, a node gone) leaves the files exactly as its last finished
system call left them: a rename either happened or did not, and what was written stays written
(only a power cut loses what was not yet fsynced). So the folder a kill just before a given rename
or fsync leaves is the folder as it is at that instant. `snapshots_at_every_step` copies the output
folder at each of those instants, on rank 0, while the save goes on: one save yields every folder a
kill in it could leave. Each of them is then resumed on all ranks, as a requeued job would, and the
state it gives back is compared, bitwise, with the state that was saved at that step.
"""

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from minidist.checkpoint import output_dir, state
from minidist.hf.models import load_model
from minidist.strategy.options import ParallelOptions
from minidist.strategy import get_strategy
from minidist.runtime.distributed import get_env

RUN = {"model": {}, "strategy": "torch/fsdp", "global_batch_size": 4, "seed": 0, "num_examples": 2}


def _seen_by_a_resume(out: Path) -> list:
    """What of `out` a resume can see: every file's name and size, a `.tmp` folder's by its name
    alone (a save cut short: nothing reads it, and the next save deletes it)."""
    return sorted((str(p.relative_to(out)), p.stat().st_size if p.is_file() else -1) for p in out.rglob("*")
                  if not any(part.endswith(".tmp") for part in p.relative_to(out).parent.parts))


@contextmanager
def snapshots_at_every_step(out: Path, where: Path, take: bool, kill_points: list):
    """While inside, just before every `os.rename`, `os.replace` and `os.fsync` of this process
    (minidist's, DCP's and torch's alike), if `take`: append the operation to `kill_points`, and
    copy `out` into `where/NNN <what>` unless a resume would see it as the copy before (an fsync,
    or a write inside a `.tmp`, changes nothing it can see). A copy is named by the first
    operation it precedes."""
    real = {name: getattr(os, name) for name in ("rename", "replace", "fsync")}
    last = [None]

    def copy(what: str) -> None:
        kill_points.append(what)
        seen = _seen_by_a_resume(out)
        if seen != last[0]:
            last[0] = seen
            shutil.copytree(out, where / f"{len(list(where.glob('*'))):03d} {what}")

    def before(name):
        def op(*args, **kwargs):
            target = os.readlink(f"/proc/self/fd/{args[0]}") if isinstance(args[0], int) else args[0]
            copy(f"before {name} of {Path(str(target)).name}")
            return real[name](*args, **kwargs)
        return op

    where.mkdir(parents=True, exist_ok=True)
    if take:
        for name in real:
            setattr(os, name, before(name))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(os, name, fn)
    if take:
        copy("after the save")


def _local_state(strategy, model, optimizer, scheduler) -> list:
    """This rank's whole training state, flattened to (key, value) pairs, tensors cloned."""
    model_sd, optim_sd = strategy.get_state_dict(model, optimizer, full=False)
    pairs = []

    def walk(prefix, value):
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(f"{prefix}.{key}", value[key])
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{prefix}.{i}", item)
        elif isinstance(value, torch.Tensor):
            pairs.append((prefix, (value.to_local() if hasattr(value, "to_local") else value).detach().clone()))
        else:
            pairs.append((prefix, value))

    walk("model", model_sd)
    walk("optimizer", optim_sd)
    walk("scheduler", scheduler.state_dict())
    pairs.append(("rng", torch.get_rng_state()))
    return pairs


def _same(a: list, b: list) -> bool:
    return [k for k, _ in a] == [k for k, _ in b] and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for (_, x), (_, y) in zip(a, b))


def save_and_resume_every_kill(model_dir: str, root: str, forms: list) -> dict:
    """`save_and_resume_every_kill_in` for each checkpoint form, in one launch: {form: its result}."""
    return {form: save_and_resume_every_kill_in(model_dir, Path(root) / form, form) for form in forms}


def save_and_resume_every_kill_in(model_dir: str, root: Path, form: str) -> dict:
    """Saves of steps 1 (the first: no `latest` yet), 2, 3 (the rotation removes step 1) and 3 again
    after resuming from step 2 (its older save moved aside), every rename and fsync of all but step
    2's a kill point; then each folder a kill leaves resumed. Returns, on every rank, the number of
    kill points and [(save, snapshot, its top-level names, outcome)]: outcome is the step resumed
    bitwise, "fresh" (nothing saved yet, and a fresh start accepted), or what went wrong."""
    env = get_env()
    out, snaps = root / "out", root / "snapshots"
    strategy = get_strategy(ParallelOptions("fsdp", "torch"), env)
    model = strategy.wrap(load_model(model_dir))
    optimizer = strategy.build_optimizer(model, 1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    metrics = out / "metrics.jsonl"
    checkpoints = state.Checkpointer(out, strategy, model, optimizer, scheduler, RUN, form=form, keep=2)
    saved, kill_points = {}, []

    def train(step):
        generator = torch.Generator().manual_seed(step)
        ids = torch.randint(4, 60, (2, 12), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        torch.rand(1)  # the run's own random stream moves on between saves

    def save(step, name):
        if env.is_main:
            out.mkdir(parents=True, exist_ok=True)
            with open(metrics, "a") as f:
                f.write(f'{{"step": {step}, "loss": 1.0}}\n')
        dist.barrier()
        rng = torch.get_rng_state()
        with snapshots_at_every_step(out, snaps / name, env.is_main and name != "save 2", kill_points):
            checkpoints.save(step, (0, 4 * step), metrics, {})
        torch.set_rng_state(rng)
        now = _local_state(strategy, model, optimizer, scheduler)
        assert step not in saved or _same(saved[step], now), f"step {step} trained twice differs"
        saved[step] = now

    for step in (1, 2, 3):
        train(step)
        save(step, f"save {step}")
    checkpoints.load(out / "checkpoint-2")  # a run resumed from an older checkpoint...
    train(3)
    save(3, "save 3 again")  # ...meets its former future: checkpoint-3, which latest names
    resumed = [(save_name.name, snap.name, sorted(os.listdir(snap)),
                _resume(snap, checkpoints, saved, strategy, model, optimizer, scheduler))
               for save_name in _listed(snaps) for snap in _listed(save_name)]
    return {"kill points": len(kill_points), "resumed": resumed}


def _listed(folder: Path) -> list:
    """`folder`'s entries as rank 0 sees them (every rank walks the same list)."""
    box = [sorted(folder.iterdir()) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _resume(snap: Path, checkpoints, saved: dict, strategy, model, optimizer, scheduler):
    """What `--resume` makes of the folder `snap` a kill left: the step it resumes bitwise, or why not."""
    try:
        path = state.find("latest", snap)
    except ValueError as err:
        refused = output_dir._other_runs(snap, None, False)  # would a fresh start (no --resume) be accepted?
        return "fresh" if refused is None else f"stuck: --resume says {err}; a fresh start says {refused}"
    try:
        state.verify(path, RUN)
        step = checkpoints.load(path)["step"]
    except (ValueError, RuntimeError) as err:
        return f"refused: {err}"
    same = _same(saved[step], _local_state(strategy, model, optimizer, scheduler))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, same)
    return step if all(everyone) else f"step {step} resumed, not bitwise"
