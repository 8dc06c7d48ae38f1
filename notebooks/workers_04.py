"""Worker functions for lesson 04 (ZeRO-1 and ZeRO-2), launched by `minidist.runtime.launch.launch`.

They live in a `.py` file because every rank is a fresh process that imports its worker by
name; a function defined in a notebook cell cannot be imported. Nothing here re-implements
minidist: `train_and_measure` runs the real training loop, `minidist.finetune.train`, with the
flags a learner would type, and hands back what that loop measured; `side_by_side` builds each
strategy with the loop's own calls (`get_strategy`, `wrap`, `build_optimizer`,
`token_loss_sum`), and only watches: the live bytes over one step
(`minidist.memory.timeline`), the time per step in alternating rounds
(`minidist.bench.strategies.time_steps`), and, if asked, one step under `torch.profiler`.
"""

import torch.distributed as dist

from minidist import batches
from minidist.chess import jsonl
from minidist.hf import models
from minidist.step import token_loss_sum
from minidist.bench import timeline
from minidist.bench.strategies import time_steps
from minidist.runtime.distributed import get_env
from minidist.memory.timeline import step_timeline
from minidist.strategy.options import ParallelOptions
from minidist.strategy import get_strategy

import training


def train_and_measure(model_dir: str, data: str, runs: list[dict], steps: int, seq_len: int, batch: int) -> list[dict]:
    """Train once per entry of `runs` ({"strategy", "mixed_precision"}), one after the other in
    the same ranks, and return, per run, what the loop logged each step (rank 0's view of every
    rank: `memory_bytes` are lists by rank, `comm_bytes` what rank 0 sent).

    Each run starts from the same weights and sees the same batches (the data order depends only
    on the seed), so their losses can be compared step by step."""
    training.share_cores()
    results = []
    for run in runs:
        done = training.run([
            "--model", model_dir, "--data", data, "--impl", "minidist", "--strategy", run["strategy"],
            "--mixed_precision", run["mixed_precision"], "--max_steps", str(steps),
            "--max_seq_length", str(seq_len), "--batch_size_per_device", str(batch),
            "--warmup_steps", "1", "--eval_prefixes", "0", "--no_save",
        ])
        results.append({**run, "world_size": dist.get_world_size(), "records": done["records"], "log": done["log"]})
    return results


def side_by_side(model_dir: str, data_path: str, names: list[str], seq_len: int, batch: int, rounds: int,
                 warmup: int = 2, profile_to: dict | None = None) -> dict:
    """Build every strategy in `names` (ddp, zero1, zero2, fsdp; fp32), each its own model from
    the same weights, and step them all on the same batch. Return, for this rank:

    - "timelines": each strategy's live bytes over one step (`step_timeline`: forward, backward,
      optimizer step, zero_grad), after `warmup` steps, so AdamW's states exist;
    - "seconds": each strategy's time per step over `rounds` alternating rounds (ddp, zero1,
      zero2, fsdp, ddp, ...: a slow moment of the shared machine hits them all alike), each the
      slowest rank's (`time_steps`);
    - traces: for each `profile_to` entry (strategy -> Chrome trace path), one more step under
      `torch.profiler`, written by rank 0, with FSDP's units named (`timeline.mark_units`)."""
    env = get_env()
    training.share_cores()
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # one loading bar per rank and model: noise here
    tokenizer = models.load_tokenizer(model_dir)
    sequences = batches.tokenize_games(jsonl.load_games(data_path), tokenizer, seq_len)
    sampler = batches.GlobalBatchSampler(len(sequences), batch * env.world_size, seed=0)
    ids, = sampler.micro_batches(0, env.rank, env.world_size, batch)
    micro = batches.collate([sequences[i] for i in ids], tokenizer.pad_token_id)
    num_targets = sum(len(sequences[i]) - 1 for i in sampler.global_batch(0))
    built = {}
    for name in names:
        strategy = get_strategy(ParallelOptions(strategy=name, impl="minidist"), env)
        model = strategy.wrap(strategy.load_model(model_dir))  # rank 0's weights, broadcast or scattered
        built[name] = (strategy, model, strategy.build_optimizer(model, 1e-3))

    def phases(name):
        strategy, model, optimizer = built[name]
        held = {}  # the loss, from forward to backward: then nothing keeps the graph alive
        return [("forward", lambda: held.update(
                    loss=token_loss_sum(model, micro, strategy) * env.world_size / num_targets)),
                ("backward", lambda: held.pop("loss").backward()),
                ("optimizer step", lambda: (strategy.clip_grad_norm_(model, 1.0), optimizer.step())),
                ("zero_grad", lambda: optimizer.zero_grad(set_to_none=True))]

    def step(name):
        for _, run in phases(name):
            run()

    for _ in range(warmup):
        for name in names:
            step(name)
    out = {"timelines": {name: step_timeline(env.device, built[name][1], built[name][2], phases(name))
                         for name in names},
           "seconds": {name: [] for name in names}}
    for _ in range(rounds):
        for name in names:
            out["seconds"][name] += time_steps(lambda: step(name), 1)
    for name, trace in (profile_to or {}).items():
        if name == "fsdp":
            timeline.mark_units(built[name][1])
        if env.rank == 0:
            with training.without_profiler_notices():
                timeline.record(lambda: named_step(phases(name)), env.device, trace)
        else:
            named_step(phases(name))  # the same step, unrecorded: rank 0's collectives need a partner
    return out


def named_step(phases) -> None:
    """One step, each phase a `record_function` range of its name (a lane of the trace)."""
    from torch.autograd.profiler import record_function

    for name, run in phases:
        with record_function(name):
            run()


def lesson(model_dir: str, data_path: str, runs: list[dict], steps: int, seq_len: int, batch: int,
           side: dict | None = None) -> dict:
    """One launch for both parts of the notebook (each launch costs seconds of start-up): the
    training runs, and (if asked) `side_by_side` with the arguments in `side`."""
    trained = train_and_measure(model_dir, data_path, runs, steps, seq_len, batch)
    return {"runs": trained, "side": side_by_side(model_dir, data_path, seq_len=seq_len, batch=batch, **side) if side else None}
