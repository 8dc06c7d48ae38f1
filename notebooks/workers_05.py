"""Worker functions for lesson 05 (FSDP), run in every rank by `minidist.runtime.launch.launch`.

They live in a `.py` file because `launch` starts fresh processes that import the worker by name;
a function defined in a notebook cell cannot be imported. Nothing here re-implements minidist:
the worker picks a strategy with `get_strategy`, wraps the model, and steps it with the training
loop's own `train_step`, exactly as `minidist.finetune.train` does. It only *watches*: the bytes
each rank holds (`minidist.memory.measure.model_state_bytes`), the bytes it sends (`comm.counter`,
read through `strategy.take_comm_bytes()`), and, for FSDP, when each unit is gathered and freed.

One launch runs several strategies one after the other in the same ranks: starting processes and
importing transformers costs more on 2 cores than a few steps of a tiny model. `lesson` adds, in
the same launch, lesson 04's `side_by_side`: a memory timeline per strategy, timing rounds, and
a profiler trace of FSDP's prefetch.
"""

import time
import warnings

import torch
import torch.distributed as dist

from minidist import batches
from minidist.chess import jsonl
from minidist.chess.games import bundled_games
from minidist.hf import models
from minidist.step import train_step
from minidist.runtime.distributed import get_env
from minidist.memory import measure
from minidist.strategy.options import ParallelOptions
from minidist.strategy import get_strategy


def _watch_units(fsdp, events, t0):
    """Record every real gather and free of every unit as (seconds, unit index, +1 or -1).

    The unit's hooks call `self.gather()` and `self.free()`, which Python looks up on the instance
    first: wrapping them there observes the real methods without changing what they do. Calls that
    find the unit already gathered (or already sharded) change nothing and are not recorded."""
    for index, unit in enumerate(fsdp.units):
        def watched(method, change, unit=unit, index=index):
            def call():
                before = unit.state
                method()
                if (before == "sharded") != (unit.state == "sharded"):
                    events.append((time.perf_counter() - t0, index, change))
            return call
        unit.gather = watched(unit.gather, +1)
        unit.free = watched(unit.free, -1)


def run(model_dir, variants, steps=2, batch_size_per_device=2, seq_len=64, lr=1e-3):
    """Train each variant for `steps` steps from the same weights; return what each one measured.

    A variant is a dict: `strategy` (ddp, zero1, zero2, fsdp) and optionally `wrap` (FSDP's layer
    wrap policy, default True). Each result holds, for this rank: the losses, the model-state bytes
    after the last step, the bytes sent per step, P (the parameter count) and, for FSDP, the units'
    sizes, the most units gathered at once and the gather/free timeline of the last step."""
    env = get_env()
    # Keep the notebook's output to what the lesson is about: no per-rank loading bars, and not
    # torch's notice that the collectives comm.py calls have newer names.
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    tokenizer = models.load_tokenizer(model_dir)
    sequences = batches.tokenize_games(jsonl.load_games(bundled_games("train")), tokenizer, seq_len)
    sampler = batches.GlobalBatchSampler(len(sequences), batch_size_per_device * env.world_size, seed=0)
    results = {}
    for variant in variants:
        name, wrap = variant["strategy"], variant.get("wrap", True)
        strategy = get_strategy(ParallelOptions(strategy=name, impl="minidist", layer_wrap_policy=wrap), env)
        model = strategy.load_model(model_dir)  # FSDP: rank 0 reads the weights, the others get shapes
        num_params = models.num_parameters(model) if env.rank == 0 else None
        model = strategy.wrap(model)  # FSDP: cut into units, flatten on rank 0, scatter the shards
        optimizer = strategy.build_optimizer(model, lr)
        strategy.take_comm_bytes()  # count from here: wrapping (broadcast, scatter) is not a step's traffic
        losses, sent, events = [], [], []
        for step in range(steps):
            ids = sampler.global_batch(step)
            num_targets = sum(len(sequences[i]) - 1 for i in ids)
            micro = [batches.collate([sequences[i] for i in m], tokenizer.pad_token_id)
                     for m in sampler.micro_batches(step, env.rank, env.world_size, batch_size_per_device)]
            if name == "fsdp" and step == steps - 1:  # the timeline of the last step only
                events.clear()
                _watch_units(model, events, time.perf_counter())
            loss = train_step(model, strategy, micro, num_targets, env.world_size)
            strategy.clip_grad_norm_(model, 1.0)
            optimizer.step()
            state = measure.model_state_bytes(model, optimizer)  # gradients still held
            optimizer.zero_grad(set_to_none=True)
            dist.all_reduce(loss)
            losses.append(loss.item() / num_targets)
            sent.append(strategy.take_comm_bytes())
        num = torch.tensor([num_params or 0], dtype=torch.long)
        dist.broadcast(num, src=0)  # every rank knows P, though only rank 0 read the weights
        key = name if wrap else f"{name}/no-wrap"
        results[key] = {"losses": losses, "model_states": state, "sent_per_step": sent, "P": int(num.item())}
        if name == "fsdp":
            results[key].update(
                max_unsharded=model.max_unsharded, events=events,
                units=[type(u.module).__name__ for u in model.units],
                unit_numel=[u.layout.padded_numel for u in model.units])
    return results


def lesson(model_dir: str, variants: list[dict], steps: int, side: dict | None = None) -> dict:
    """One launch for both parts of the notebook: `run`, and (if asked) lesson 04's
    `side_by_side` (the memory timeline of one step per strategy, alternating timing rounds and
    a profiler trace of FSDP's prefetch), on the bundled games, with the arguments in `side`."""
    import workers_04

    out = {"run": run(model_dir, variants, steps=steps)}
    if side:
        out["side"] = workers_04.side_by_side(model_dir, str(bundled_games("train")), **side)
    return out
