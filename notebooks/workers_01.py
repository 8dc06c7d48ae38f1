"""Worker functions for lesson 01 (collectives), launched by `minidist.runtime.launch.launch`.

They live in a `.py` file because every rank is a fresh process that imports its worker by
name; a function defined in a notebook cell cannot be imported. Nothing here re-implements a
collective: each one is `minidist.parallel.comm`'s (which calls `torch.distributed`), the ring is
`comm.ring_all_reduce`, and the timing is `minidist.bench.collectives.time_collective`, the code that
`slurm/01_collectives.sh` runs on GPUs.
"""

import os
import warnings

import torch
import torch.distributed as dist

from minidist.bench import collectives
from minidist.parallel import comm

OPS = ("all_reduce", "reduce_scatter", "all_gather")


def bytes_written() -> int | None:
    """Bytes this process has passed to write()-like system calls so far, gloo's sockets included
    (`wchar` in /proc/self/io, Linux only; None elsewhere). The kernel counts them, not minidist."""
    try:
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("wchar:")).split()[1])
    except OSError:
        return None


def show_collectives() -> list[dict]:
    """Each collective once, on tensors small enough to read: this rank's (name, before, after)."""
    r, n = dist.get_rank(), dist.get_world_size()
    rows = []
    x = (r + 1) * torch.tensor([10.0**i for i in range(n)])  # rank r: (r+1) x [1, 10, 100, ...]
    before = x.tolist()
    comm.all_reduce(x)  # every rank: the sum over ranks
    rows.append(("all_reduce", before, x.tolist()))
    x = (r + 1) * torch.tensor([10.0**i for i in range(n)])
    shard = torch.empty(1)
    comm.reduce_scatter(shard, x)  # rank r: element r of the sum
    rows.append(("reduce_scatter", x.tolist(), shard.tolist()))
    shard = torch.tensor([float(r + 1)])
    full = torch.empty(n)
    comm.all_gather(full, shard)  # every rank: every rank's shard, in rank order
    rows.append(("all_gather", shard.tolist(), full.tolist()))
    x = torch.full((2,), float(r + 1))
    before = x.tolist()
    comm.broadcast(x, src=0)  # every rank: rank 0's
    rows.append(("broadcast", before, x.tolist()))
    chunks = [torch.tensor([100.0 + i]) for i in range(n)] if r == 0 else None
    out = torch.empty(1)
    comm.scatter(out, chunks, src=0)  # rank r: rank 0's chunk r
    rows.append(("scatter", [c.item() for c in chunks] if chunks else [], out.tolist()))
    return rows


def ring_against_library(groups: dict, numels: list[int]) -> list[dict]:
    """`comm.ring_all_reduce` (send/recv by hand) against `comm.all_reduce` (gloo) on random fp32
    tensors, different on every rank, in each group of `groups` ({k: the group of the first k
    ranks}): are they bitwise equal, and if not, how far apart relative to the floating-point
    bound? Summing k numbers in any order is off by at most (k-1) u sum|x_i| (u = 2**-24, fp32's
    unit roundoff), so two orders differ by at most twice that."""
    r = dist.get_rank()
    u = 2.0**-24
    rows = []
    for k, group in groups.items():
        if r >= k:  # not a member: the members' collectives do not involve this rank
            continue
        for numel in numels:
            x = torch.randn(numel, generator=torch.Generator().manual_seed(1000 + r))
            library, by_hand, magnitude = x.clone(), x.clone(), x.abs()
            comm.counter.reset()  # one counter counts one group at a time
            comm.all_reduce(library, group=group)
            comm.ring_all_reduce(by_hand, group=group)
            comm.all_reduce(magnitude, group=group)  # sum over ranks of |x_i|, element by element
            diff = (library - by_hand).abs()
            verdict = torch.tensor([float(torch.equal(library, by_hand)), diff.max().item(),
                                    (diff / (2 * (k - 1) * u * magnitude)).max().item()])
            everyone = [torch.empty(3) for _ in range(k)]
            dist.all_gather(everyone, verdict, group=group)  # every member's verdict, for rank 0 to report
            rows.append({"ranks": k, "numel": numel, "bitwise_equal": all(v[0] == 1 for v in everyone),
                         "max_abs_diff": max(v[1].item() for v in everyone),
                         "share_of_bound": max(v[2].item() for v in everyone)})
    return rows


def bytes_per_rank(groups: dict, numel: int, repeats: int = 3) -> list[dict]:
    """For each group of the first k ranks in `groups`: the bytes one rank sends per call of each
    collective on `numel` fp32 elements, by `comm.counter` (the ring's formula) and by the kernel
    (`bytes_written`: what gloo really wrote to its sockets). Only the members call it."""
    rank = dist.get_rank()
    rows = []
    for k, group in groups.items():
        for op in OPS + ("ring_all_reduce",):
            dist.barrier()
            if rank >= k:
                continue
            full = torch.randn(numel)  # numel divisible by k: equal shards
            shard = torch.empty(numel // k)
            run = {"all_reduce": lambda: comm.all_reduce(full, group=group),
                   "reduce_scatter": lambda: comm.reduce_scatter(shard, full, group=group),
                   "all_gather": lambda: comm.all_gather(full, shard, group=group),
                   "ring_all_reduce": lambda: comm.ring_all_reduce(full, group=group)}[op]
            comm.counter.reset()  # one counter counts one group at a time
            run()  # the first call may set up connections: not counted
            dist.barrier(group=group)
            comm.counter.reset()
            before = bytes_written()
            for _ in range(repeats):
                run()
            after = bytes_written()
            rows.append({"ranks": k, "op": op, "rank": rank, "bytes": numel * 4,
                         "counted": comm.counter.bytes_sent / repeats,
                         "written": None if before is None else (after - before) / repeats})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    return [row for rows_of_rank in gathered for row in rows_of_rank]


def lesson(numels: list[int], group_sizes: list[int], count_numel: int, sizes: list[int], warmup: int,
           iters: int) -> dict:
    """Everything the notebook shows, in one launch (each launch costs seconds of start-up)."""
    # N ranks share the laptop's cores: one thread each, or they would oversubscribe it.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    # torch 2.13 calls the tensor forms of reduce-scatter and all-gather deprecated: not this lesson's topic.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    # The groups of the first k ranks. Every rank builds every group (`new_group` is collective).
    groups = {k: dist.new_group(list(range(k))) for k in group_sizes}
    results = {"collectives": show_collectives(), "ring": ring_against_library(groups, numels),
               "bytes": bytes_per_rank(groups, count_numel)}
    # The timing: minidist.bench.collectives', the function the SLURM script runs on GPUs.
    results["timing"] = {op: collectives.time_collective(op, sizes, warmup, iters) for op in OPS}
    return results
