"""The strategy benchmarks over a sweep of layer sizes: does a wrapper's cost grow with the model?

One model hides what grows with a layer. On the CPU a flat buffer above glibc's mmap threshold
is mapped afresh, page fault by page fault, every step it is remade, unless freed blocks are kept
(`runtime/allocator.py`), while FSDP2's per-parameter tensors are small enough for the heap to
reuse. A hand-written FSDP unit at 4 layers x 1536 is one 113 MB buffer, at 8 x 512 a ninth of
that, so one model size can show no such cost where a wider one shows a large one. So the sweep
prints, for every hidden size and world size, each goal's ratio with its spread
and whether it is met, and the minor page faults per step of each implementation, so that such a
cost cannot grow unseen.

Each world size is one launch: its ranks time every size in turn (`strategies.time_implementations`,
implementations taking turns within each round), letting each size's models go before the next.
Fewer layers for the wider sizes keep the widest row affordable on a 2-core laptop (`layers_for`).
"""

import gc
import time

from minidist.bench import strategies
from minidist.runtime.distributed import get_env

SIZES = (256, 512, 1024, 1536, 2048)
WORLD_SIZES = (1, 2)


def layers_for(hidden_size: int) -> int:
    """Decoder layers at this width: 8 below 1024 (the issue's table), 4 up to 1536, 2 from 2048.
    A layer holds about 12 x hidden^2 parameters, so 2 x 2048 (101M) weighs about what
    4 x 1536 (113M) does, and each of the three implementations keeps its own copy with AdamW's states."""
    return 8 if hidden_size < 1024 else 4 if hidden_size < 2048 else 2


def time_sizes(what, sizes, layers, batch_size, seq_len, bucket_cap_mb, warmup, steps, rounds) -> list[dict]:
    """Run in every rank: `strategies.time_implementations` for each (hidden size, layers), in turn."""
    results = []
    for hidden_size, num_layers in zip(sizes, layers):
        start = time.perf_counter()
        results.append(strategies.time_implementations(what, hidden_size, num_layers, batch_size, seq_len,
                                                       bucket_cap_mb, warmup, steps, rounds))
        gc.collect()  # this size's three models and their optimizers go before the next size's are built
        if get_env().is_main:  # a long sweep shows that it moves
            print(f"  {hidden_size} x {num_layers}: {time.perf_counter() - start:,.0f} s", flush=True)
    return results


def run(args) -> list[tuple]:
    """Every (world size, hidden size, layers, result) of the sweep `args` names, one launch per world size."""
    # Import the worker under its module name: launch() starts fresh interpreters that import it.
    from minidist.bench.sweep import time_sizes as worker
    from minidist.runtime.launch import launch

    layers = [args.num_layers or layers_for(h) for h in args.hidden_size]
    cells = []
    for world_size in args.world_size:
        print(f"timing on {world_size} ranks: hidden sizes {', '.join(map(str, args.hidden_size))} ...", flush=True)
        results = launch(worker, world_size, args.what, args.hidden_size, layers, args.batch_size, args.seq_len,
                         args.bucket_cap_mb, args.warmup, args.steps, args.rounds)[0]
        cells += [(world_size, h, n, result) for h, n, result in zip(args.hidden_size, layers, results)]
    return cells


def table(what: str, cells: list[tuple], args, seconds: float) -> str:
    """The sweep as a Markdown table: a row per size and world size, each goal's ratio with its
    spread and verdict, then the minor page faults per timed step of each implementation."""
    goals = [goal[0] for goal in strategies.GOALS[what]]
    names = list(cells[0][3]["times"])
    lines = [
        (f"{what.upper()} sweep on {cells[0][3]['device']} ({cells[0][3]['backend']}), fp32, batch {args.batch_size} x "
         f"{args.seq_len} tokens per rank, {args.rounds} rounds x {args.steps} timed steps of each implementation"),
        ("step: ratio of the median steps (lowest and highest round); peak: whole step, the ranks that need most "
         "(lowest and highest rank)"),
        "faults: minor page faults per timed step, of the rank with most",
        "",
        "| hidden x layers | ranks | " + " | ".join(goals) + " | " + " | ".join(f"faults, {n}" for n in names) + " |",
        "|" + " --- |" * (2 + len(goals) + len(names)),
    ]
    for world_size, hidden_size, num_layers, result in cells:
        ratios = [strategies.goal_cell(*row[1:]) for row in strategies.goal_ratios(what, result, world_size)]
        faults = [f"{max(result['rank_faults'][name]):,.0f}" for name in names]
        lines.append(f"| {hidden_size} x {num_layers} | {world_size} | " + " | ".join(ratios + faults) + " |")
    missed = sum(line.count(": missed") for line in lines)
    lines += ["", f"goals missed: {missed} of {len(goals) * len(cells)}; the whole sweep took {seconds:,.0f} s"]
    return "\n".join(lines)


def main(args) -> None:
    """Time the sweep `args` name; print one size on one world size in full, more as a table."""
    start = time.perf_counter()
    cells = run(args)
    if len(cells) == 1:
        world_size, hidden_size, num_layers, result = cells[0]
        one = type(args)(**{**vars(args), "world_size": world_size, "hidden_size": hidden_size,
                            "num_layers": num_layers})
        print(strategies.report(args.what, result, one))
        print(f"took {time.perf_counter() - start:,.0f} s")
    else:
        print(table(args.what, cells, args, time.perf_counter() - start))
