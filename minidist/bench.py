"""Benchmarks: the hand-written strategies against PyTorch's own as ratios; a collective's bandwidth.

    python -m minidist.bench ddp        # naive DDP, bucketed DDP, torch DDP; 2 CPU ranks
    python -m minidist.bench fsdp       # FSDP, ZeRO-2 (minidist) and torch FSDP2; 2 CPU ranks
    python -m minidist.bench allreduce  # all-reduce time, algbw and busbw per message size; 2 CPU ranks
    torchrun --nproc_per_node 4 -m minidist.bench allreduce   # the same on 4 GPUs (nccl)

Absolute times depend on the machine and on what else runs on it; a ratio measured in one run,
on the same model, data and ranks, mostly does not. So every implementation gets its own copy
of one randomly initialised model (FSDP wrapping replaces a model's parameters by flat shards,
so each wraps its own `deepcopy`) and the same batch on every rank, and they take turns: each
round times a few steps of each, and the rounds repeat, so a slow minute hurts all of them
alike. A step is forward, backward (with its communication), and the optimizer step; its time
is the slowest rank's, because the next step cannot start before that rank is done. The
figure reported is the median step. The hand-written ones also count the bytes each rank sends
in one step (`comm.counter`, ring collectives); PyTorch's do not go through `comm`.

`allreduce` times one collective alone, as NVIDIA's nccl-tests do (doc/PERFORMANCE.md there):
the average time t of back-to-back calls on S bytes, the algorithm bandwidth algbw = S/t, and
the bus bandwidth busbw = algbw x 2(N-1)/N for an all-reduce ((N-1)/N for a reduce-scatter or an
all-gather, S being the whole array): what each rank's link carried per second under the ring
algorithm, comparable with the link's peak whatever N is. Started by torchrun or srun it runs in
their ranks (nccl on GPUs); otherwise it launches `--world_size` CPU ranks itself (gloo).
"""

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist

from minidist.distributed import get_env

# What each comparison is a ratio to, and its goals: (label, numerator, denominator, kind, bound).
REFERENCE = {"ddp": "DistributedDataParallel (torch)", "fsdp": "fully_shard FSDP2 (torch)"}
GOALS = {
    "ddp": [("bucketed / torch DDP", "bucketed DDP (minidist)", "DistributedDataParallel (torch)", "at most", 1.10),
            ("naive / bucketed DDP", "naive DDP (minidist)", "bucketed DDP (minidist)", "above", 1.00)],
    "fsdp": [("minidist FSDP / FSDP2", "FSDP (minidist)", "fully_shard FSDP2 (torch)", "at most", 1.25),
             ("minidist ZeRO-2 / FSDP2", "ZeRO-2 (minidist)", "fully_shard FSDP2 (torch)", "at most", 1.25)],
}
# Bytes per rank per step with ring collectives, fp32 (4 bytes), P parameters, N ranks.
EXPECTED_BYTES = {"ddp": "2P(N-1)/N x 4 bytes = {two:.1f} MB",
                  "fsdp": "3P(N-1)/N x 4 bytes = {three:.1f} MB (FSDP), 2P(N-1)/N = {two:.1f} MB (ZeRO-2)"}


def _time_steps(step, num_steps: int) -> list[float]:
    """Seconds per step, each the slowest rank's."""
    times = []
    for _ in range(num_steps):
        dist.barrier()  # start together, so no rank's time includes waiting for another
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(times)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def _wrapped(base, bucket_cap_mb, **options) -> tuple:
    """(model, optimizer) as the training loop builds them: the strategy `options` name, around
    its own copy of `base` (sharding replaces a model's parameters by flat shards)."""
    from minidist.parallel.options import ParallelOptions
    from minidist.parallel.strategy import get_strategy

    if options["impl"] == "minidist" and options["strategy"] != "fsdp":
        options["bucket_cap_mb"] = bucket_cap_mb
    strategy = get_strategy(ParallelOptions(**options), get_env())
    model = strategy.wrap(copy.deepcopy(base))
    return model, strategy.build_optimizer(model, lr=1e-4)


def _ddp_implementations(base, bucket_cap_mb) -> tuple[dict, str]:
    """Naive, bucketed and PyTorch DDP (buckets of 25 MB, its default), each on its own copy of `base`."""
    wrapped = {name: _wrapped(base, bucket_cap_mb, strategy="ddp", **options) for name, options in (
        ("naive DDP (minidist)", {"impl": "minidist", "ddp_variant": "naive"}),
        ("bucketed DDP (minidist)", {"impl": "minidist", "ddp_variant": "bucketed"}),
        ("DistributedDataParallel (torch)", {"impl": "torch"}))}
    bucketed = wrapped["bucketed DDP (minidist)"][0]
    return wrapped, f"bucketed DDP: buckets of {bucket_cap_mb:g} MB ({len(bucketed.buckets)} for this model)"


def _fsdp_implementations(base, bucket_cap_mb) -> tuple[dict, str]:
    """minidist FSDP (one unit per decoder layer and the root), minidist ZeRO-2, and PyTorch's
    FSDP2 (`fully_shard` on every decoder layer, then on the root), each on its own copy of `base`."""
    wrapped = {name: _wrapped(base, bucket_cap_mb, **options) for name, options in (
        ("FSDP (minidist)", {"impl": "minidist", "strategy": "fsdp"}),
        ("ZeRO-2 (minidist)", {"impl": "minidist", "strategy": "zero2"}),
        ("fully_shard FSDP2 (torch)", {"impl": "torch", "strategy": "fsdp"}))}
    fsdp, zero2 = wrapped["FSDP (minidist)"][0], wrapped["ZeRO-2 (minidist)"][0]
    return wrapped, (f"FSDP units: {len(fsdp.units)} ({len(fsdp.layer_units)} x {type(fsdp.units[0].module).__name__}"
                     f" + root); ZeRO-2 buckets of {bucket_cap_mb:g} MB ({len(zero2.buckets)} for this model)")


IMPLEMENTATIONS = {"ddp": _ddp_implementations, "fsdp": _fsdp_implementations}


def time_implementations(what, hidden_size, num_layers, batch_size, seq_len, bucket_cap_mb, warmup, steps, rounds):
    """Run in every rank: time the implementations compared by `what` on one model, turn by turn."""
    from transformers import LlamaForCausalLM

    from minidist import models
    from minidist.parallel import comm

    env = get_env()
    config = models.tiny_llama_config(hidden_size=hidden_size, num_layers=num_layers, num_heads=max(1, hidden_size // 64))
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(env.rank)  # each rank its own batch, as in training
    input_ids = torch.randint(4, config.vocab_size, (batch_size, seq_len), generator=generator)
    wrapped, setup = IMPLEMENTATIONS[what](base, bucket_cap_mb)

    def step(name):
        model, optimizer = wrapped[name]

        def run():
            model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return run

    for name in wrapped:
        _time_steps(step(name), warmup)  # first steps allocate memory and (bucketed) re-pack buckets
    bytes_per_step = {}
    for name in wrapped:
        comm.counter.reset()
        step(name)()
        bytes_per_step[name] = comm.counter.bytes_sent  # 0 for PyTorch's: they bypass comm
    times = {name: [] for name in wrapped}
    for _ in range(rounds):
        for name in wrapped:
            times[name] += _time_steps(step(name), steps)
    return {"times": times, "parameters": sum(p.numel() for p in base.parameters()), "setup": setup,
            "bytes_per_step": bytes_per_step}


def report(what: str, result: dict, args) -> str:
    tokens = args.batch_size * args.seq_len * args.world_size
    medians = {name: statistics.median(times) for name, times in result["times"].items()}
    reference = medians[REFERENCE[what]]
    P, N = result["parameters"], args.world_size
    lines = [
        f"{what.upper()} on {N} CPU ranks (gloo): Llama of {P / 1e6:.1f}M parameters "
        f"({args.num_layers} layers x {args.hidden_size}), batch {args.batch_size} x {args.seq_len} tokens per rank, "
        f"{args.rounds} rounds x {args.steps} timed steps each",
        result["setup"],
        "sent per rank per step: " + EXPECTED_BYTES[what].format(two=8 * P * (N - 1) / N / 1e6,
                                                                  three=12 * P * (N - 1) / N / 1e6),
        "",
        f"{'implementation':<34}{'median step':>12}{'tokens/s':>11}{'vs torch':>10}{'sent/step':>12}",
    ]
    for name, median in medians.items():
        sent = result["bytes_per_step"][name]
        sent = f"{sent / 1e6:>9.1f} MB" if sent else f"{'-':>12}"
        lines.append(f"{name:<34}{median * 1e3:>9.0f} ms{tokens / median:>11,.0f}{median / reference:>9.2f}x{sent}")
    lines.append("")
    for label, numerator, denominator, kind, bound in GOALS[what]:
        ratio = medians[numerator] / medians[denominator]
        met = ratio <= bound if kind == "at most" else ratio > bound
        lines.append(f"{label + ':':<25}{ratio:.2f}x (goal: {kind} {bound:.2f}x, {'met' if met else 'NOT met'})")
    return "\n".join(lines)


# Collective bandwidth -------------------------------------------------------------------------
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
        run = {"all_reduce": lambda: comm.all_reduce(full),
               "reduce_scatter": lambda: comm.reduce_scatter(shard, full),
               "all_gather": lambda: comm.all_gather(full, shard)}[op]
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


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth_table(op: str, rows: list[dict], world_size: int, device_type: str, backend: str) -> str:
    """nccl-tests' columns: size, time, algbw, busbw; GB/s are 1e9 bytes per second, as theirs."""
    lines = [f"{op} on {world_size} x {device_type} ({backend}), fp32, busbw = algbw x "
             f"{'2(N-1)/N' if op == 'all_reduce' else '(N-1)/N'} = algbw x {BUS_FACTOR[op](world_size):.3f}",
             f"{'size (B)':>12}{'time (us)':>12}{'algbw (GB/s)':>14}{'busbw (GB/s)':>14}{'sent/rank (B)':>15}"]
    for r in rows:
        lines.append(f"{r['bytes']:>12,}{r['time_s'] * 1e6:>12.1f}{r['algbw'] / 1e9:>14.3f}{r['busbw'] / 1e9:>14.3f}"
                     f"{r['sent_per_rank']:>15,.0f}")
    top = max(rows, key=lambda r: r["busbw"])
    lines.append(f"peak busbw {top['busbw'] / 1e9:.2f} GB/s at {top['bytes']:,} bytes")
    return "\n".join(lines)


def _bandwidth_main(args) -> None:
    sizes = message_sizes(args.min_bytes, args.max_bytes, args.factor)
    if "RANK" in os.environ:  # torchrun (or srun through it) started us: we are one of the ranks
        from minidist.distributed import cleanup, init_distributed

        env = init_distributed()
        try:
            rows = time_collective(args.op, sizes, args.warmup, args.iters)
            if env.is_main:
                print(bandwidth_table(args.op, rows, env.world_size, env.device.type, env.backend), flush=True)
        finally:
            cleanup()
        return
    from minidist.bench import time_collective as worker  # by module name: spawned ranks import it
    from minidist.launch import launch

    rows = launch(worker, args.world_size, args.op, sizes, args.warmup, args.iters)[0]
    print(bandwidth_table(args.op, rows, args.world_size, "cpu", "gloo"))


def _bytes(text: str) -> int:
    """'1K' -> 1024, '64M' -> 64 x 2**20, '4G' -> 4 x 2**30: nccl-tests' -b/-e suffixes."""
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m minidist.bench", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="what", required=True)
    for what in IMPLEMENTATIONS:
        p = commands.add_parser(what, help=f"time the hand-written {what.upper()} against PyTorch's")
        p.add_argument("--world_size", type=int, default=2)
        p.add_argument("--hidden_size", type=int, default=384)
        p.add_argument("--num_layers", type=int, default=6)
        p.add_argument("--batch_size", type=int, default=4, help="sequences per rank per step")
        p.add_argument("--seq_len", type=int, default=64)
        p.add_argument("--bucket_cap_mb", type=float, default=25.0, help="DDP and ZeRO buckets")
        p.add_argument("--warmup", type=int, default=2, help="untimed steps per implementation")
        p.add_argument("--steps", type=int, default=5, help="timed steps per implementation per round")
        p.add_argument("--rounds", type=int, default=4)
    p = commands.add_parser("allreduce", help="time one collective per message size: algbw and busbw")
    p.add_argument("--op", choices=tuple(BUS_FACTOR), default="all_reduce")
    p.add_argument("--world_size", type=int, default=2, help="CPU ranks to launch (torchrun and srun say their own)")
    p.add_argument("--min_bytes", type=_bytes, default=_bytes("1K"), help="like nccl-tests -b: 1K, 64M, 1G")
    p.add_argument("--max_bytes", type=_bytes, default=_bytes("64M"), help="like nccl-tests -e")
    p.add_argument("--factor", type=int, default=4, help="like nccl-tests -f: each size is the last x factor")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per size")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size")
    args = parser.parse_args(argv)
    if args.what == "allreduce":
        _bandwidth_main(args)
        return
    # Import the worker under its module name: launch() starts fresh interpreters that import it.
    from minidist.bench import time_implementations as worker
    from minidist.launch import launch

    print(f"timing on {args.world_size} ranks ...", flush=True)
    result = launch(worker, args.world_size, args.what, args.hidden_size, args.num_layers, args.batch_size,
                    args.seq_len, args.bucket_cap_mb, args.warmup, args.steps, args.rounds)[0]
    print(report(args.what, result, args))


if __name__ == "__main__":
    main()
