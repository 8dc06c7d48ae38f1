"""A collective's bandwidth, timed as NVIDIA's nccl-tests time it (their doc/PERFORMANCE.md).

`time_collective` takes the average time t of back-to-back calls on S bytes, the algorithm
bandwidth algbw = S/t, and the bus bandwidth busbw = algbw x 2(N-1)/N for an all-reduce ((N-1)/N
for a reduce-scatter or an all-gather, S being the whole array): what each rank's link carried
per second under the ring algorithm, comparable with the link's peak whatever N is. Started by
torchrun or srun it runs in their ranks (nccl on GPUs); otherwise it launches `--world_size` CPU
ranks itself (gloo).
"""

import os
import time

import torch
import torch.distributed as dist

from minidist.runtime.distributed import get_env

# nccl-tests' correction from algorithm to bus bandwidth (doc/PERFORMANCE.md, "Summary").
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n}


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    """min_bytes, min_bytes x factor, ... up to max_bytes: nccl-tests' -b, -e and -f."""
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def time_collective(op: str, sizes: list[int], warmup: int = 5, iters: int = 20) -> list[dict]:
    """Run in every rank: for each size S in bytes, the average seconds of one `op` on S bytes of
    fp32 (the slowest rank's), algbw and busbw in bytes per second, and the bytes this rank sent
    by `comm.counter`. The calls go through `minidist.parallel.comm`, as the strategies' do."""
    from minidist.parallel import comm

    env = get_env()
    n = env.world_size
    rows = []
    for size in sizes:
        numel = max(n, size // 4 // n * n)  # whole fp32 elements, N equal shards
        full = torch.zeros(numel, device=env.device)  # zeros: the sums stay finite however often we add
        shard = torch.zeros(numel // n, device=env.device)
        run = {"all_reduce": lambda full=full: comm.all_reduce(full),
               "reduce_scatter": lambda full=full, shard=shard: comm.reduce_scatter(shard, full),
               "all_gather": lambda full=full, shard=shard: comm.all_gather(full, shard)}[op]
        for _ in range(warmup):  # the first calls set up connections and buffers
            run()
        _synchronize(env.device)
        dist.barrier()
        comm.counter.reset()
        start = time.perf_counter()
        for _ in range(iters):  # back to back: on a GPU they queue on one stream, as in nccl-tests
            run()
        _synchronize(env.device)
        seconds = torch.tensor((time.perf_counter() - start) / iters, device=env.device)  # nccl: on the GPU
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        t, nbytes = seconds.item(), numel * 4
        rows.append({"bytes": nbytes, "time_s": t, "algbw": nbytes / t, "busbw": nbytes / t * BUS_FACTOR[op](n),
                     "sent_per_rank": comm.counter.bytes_sent / iters})
        del full, shard
    return rows


def world_of_one(numel: int, dtype: torch.dtype = torch.bfloat16, warmup: int = 5, iters: int = 20) -> dict:
    """Seconds per call, in a world of one rank, of an all-gather and a reduce-scatter of `numel`
    elements (one FSDP unit's worth), and of the local copy that stands in for them.

    At world size 1 `comm.py` never calls the backend: a collective with no peer is a copy. So
    the GPU check's rows are blind to NCCL. Called on `dist` itself, NCCL with one rank still
    launches its kernel on its own stream, and this says what that costs beside the copy. What it
    cannot say is anything about the network: with no peer nothing crosses NVLink or InfiniBand,
    and no rank waits for a slower one. That takes several GPUs (`torchrun --nproc_per_node N -m
    minidist.bench allreduce`)."""
    env = get_env()
    full = torch.zeros(numel, dtype=dtype, device=env.device)
    shard = torch.zeros_like(full)  # one rank: the shard is the whole
    calls = {"all_gather": lambda: dist.all_gather_into_tensor(full, shard),
             "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
             "copy": lambda: full.copy_(shard)}
    seconds = {}
    for name, call in calls.items():
        for _ in range(warmup):  # NCCL sets up its communicator on the first call
            call()
        _synchronize(env.device)
        start = time.perf_counter()
        for _ in range(iters):
            call()
        _synchronize(env.device)
        seconds[name] = (time.perf_counter() - start) / iters
    return {"bytes": full.numel() * full.element_size(), "backend": env.backend, **seconds}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth_table(op: str, rows: list[dict], world_size: int, device_type: str, backend: str) -> str:
    """nccl-tests' columns: size, time, algbw, busbw; GB/s are 1e9 bytes per second, as theirs."""
    lines = [(f"{op} on {world_size} x {device_type} ({backend}), fp32, busbw = algbw x "
              f"{'2(N-1)/N' if op == 'all_reduce' else '(N-1)/N'} = algbw x {BUS_FACTOR[op](world_size):.3f}"),
             f"{'size (B)':>12}{'time (us)':>12}{'algbw (GB/s)':>14}{'busbw (GB/s)':>14}{'sent/rank (B)':>15}"]
    for r in rows:
        lines.append(f"{r['bytes']:>12,}{r['time_s'] * 1e6:>12.1f}{r['algbw'] / 1e9:>14.3f}{r['busbw'] / 1e9:>14.3f}"
                     f"{r['sent_per_rank']:>15,.0f}")
    top = max(rows, key=lambda r: r["busbw"])
    lines.append(f"peak busbw {top['busbw'] / 1e9:.2f} GB/s at {top['bytes']:,} bytes")
    return "\n".join(lines)


def bandwidth_main(args) -> None:
    sizes = message_sizes(args.min_bytes, args.max_bytes, args.factor)
    if "RANK" in os.environ:  # torchrun (or srun through it) started us: we are one of the ranks
        from minidist.runtime.distributed import cleanup, init_distributed

        env = init_distributed()
        try:
            rows = time_collective(args.op, sizes, args.warmup, args.iters)
            if env.is_main:
                print(bandwidth_table(args.op, rows, env.world_size, env.device.type, env.backend), flush=True)
        finally:
            cleanup()
        return
    # by module name: spawned ranks import it
    from minidist.bench.collectives import time_collective as worker
    from minidist.runtime.launch import launch

    rows = launch(worker, args.world_size, args.op, sizes, args.warmup, args.iters)[0]
    print(bandwidth_table(args.op, rows, args.world_size, "cpu", "gloo"))


def parse_bytes(text: str) -> int:
    """'1K' -> 1024, '64M' -> 64 x 2**20, '4G' -> 4 x 2**30: nccl-tests' -b/-e suffixes."""
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)
