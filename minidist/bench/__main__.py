"""`python -m minidist.bench ddp|fsdp|allreduce|allocator|bubble|packing|gpu`: the command (see `__init__.py`)."""

import os
import sys
from pathlib import Path

import torch

from minidist import bench
from minidist.bench import allocator, collectives, packing, strategies, sweep
from minidist.runtime.errors import ArgumentParser, fail

# The least each flag can be (the flags a subcommand has): below it a run has nothing to time,
# or never ends (a --factor of 1 never reaches --max_bytes).
AT_LEAST = {"world_size": 1, "hidden_size": 1, "num_layers": 1, "batch_size": 1, "seq_len": 2, "warmup": 0,
            "steps": 1, "rounds": 1, "iters": 1, "factor": 2, "min_bytes": 4, "ranks_per_node": 1,
            # packing: a run of at least one step, rows of a token and its target (the loop's own minimum)
            "max_steps": 1, "max_seq_length": 2, "layout_world_size": 1, "layout_batch_size_per_device": 1,
            "layout_accumulation": 1, "layout_max_seq_length": 2, "layout_steps": 1,
            "deadline_s": 0}  # the GPU check: 0 runs no row, and still writes what it knows


def check(parser, args) -> None:
    """Sizes that cannot be timed, told in one line before any rank starts."""
    for name, least in AT_LEAST.items():
        value = getattr(args, name, least)
        values = value if isinstance(value, list) else [value]  # the sweep's flags take several
        if any(v is not None and v < least for v in values):  # None: a default decided later (--ranks_per_node)
            parser.error(f"--{name} must be at least {least}")
    if getattr(args, "bucket_cap_mb", 1) <= 0:
        parser.error("--bucket_cap_mb must be more than 0")
    if hasattr(args, "max_steps") and args.warmup >= args.max_steps:
        parser.error(f"--warmup ({args.warmup}) must be less than --max_steps ({args.max_steps}): no step would be "
                     "timed")
    if hasattr(args, "max_bytes") and args.max_bytes < args.min_bytes:
        parser.error(f"--max_bytes ({args.max_bytes}) must be at least --min_bytes ({args.min_bytes})")
    for hidden_size in getattr(args, "hidden_size", []):
        heads = max(1, hidden_size // 64)  # time_implementations' heads of about 64
        if hidden_size % heads:
            parser.error(f"--hidden_size {hidden_size} does not split into {heads} heads: pick a multiple of 64")
    for size in getattr(args, "sizes", []):  # the allocator command's hidden sizes, checked alike
        if size < 1 or size % max(1, size // 64):
            parser.error(f"--sizes {size} does not split into {max(1, size // 64)} heads: pick a multiple of 64")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bubble"]:  # a command of its own, with its own flags (bubble.py)
        from minidist.bench import bubble

        bubble.main(argv[1:])
        return
    parser = ArgumentParser(prog="python -m minidist.bench", description=bench.__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="what", required=True)
    commands.add_parser("bubble", help="a pipeline's idle time per stage, measured on CPU ranks, against "
                                       "(p - 1) / (m + p - 1) (`python -m minidist.bench bubble --help`)")
    for what in strategies.IMPLEMENTATIONS:
        p = commands.add_parser(what, help=f"time the hand-written {what.upper()} against PyTorch's")
        p.add_argument("--world_size", type=int, nargs="+", default=list(sweep.WORLD_SIZES),
                       help="one or more: each is one launch")
        p.add_argument("--hidden_size", type=int, nargs="+", default=list(sweep.SIZES),
                       help="one or more; one size on one world size prints every implementation's row")
        p.add_argument("--num_layers", type=int, default=None,
                       help="every size's (default: 8 below 1024, 4 up to 1536, 2 from 2048)")
        p.add_argument("--batch_size", type=int, default=2, help="sequences per rank per step")
        p.add_argument("--seq_len", type=int, default=32)
        p.add_argument("--bucket_cap_mb", type=float, default=25.0, help="DDP and ZeRO buckets")
        p.add_argument("--warmup", type=int, default=2, help="untimed steps per implementation")
        p.add_argument("--steps", type=int, default=5, help="timed steps per implementation per round")
        p.add_argument("--rounds", type=int, default=4)
    p = commands.add_parser("allreduce", help="time one collective per message size: algbw and busbw")
    p.add_argument("--op", choices=tuple(collectives.BUS_FACTOR), default="all_reduce")
    p.add_argument("--world_size", type=int, default=2, help="CPU ranks to launch (torchrun and srun say their own)")
    p.add_argument("--min_bytes", type=collectives.parse_bytes, default=collectives.parse_bytes("1K"), help="like nccl-tests -b: 1K, 64M, 1G")
    p.add_argument("--max_bytes", type=collectives.parse_bytes, default=collectives.parse_bytes("64M"), help="like nccl-tests -e")
    p.add_argument("--factor", type=int, default=4, help="like nccl-tests -f: each size is the last x factor")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per size")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size")
    p = commands.add_parser("allocator", help="FSDP and FSDP2 per hidden size, with glibc's defaults and with freed "
                                              "blocks kept: step time, page faults, system and user time")
    p.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 1536], help="hidden sizes, multiples of 64")
    p.add_argument("--num_layers", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per implementation")
    p.add_argument("--steps", type=int, default=3, help="timed steps per implementation per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--png", default=None, help="draw the figure here (lesson 05: lessons/figures/05_allocator.png)")
    packing_parser(commands)
    p = commands.add_parser("gpu", help="every strategy on one GPU: step time, MFU, peak memory against the estimate")
    p.add_argument("--smoke", action="store_true", help="the same code on the CPU with tiny sizes (a check of the command)")
    p.add_argument("--out", default="runs/bench_gpu",
                   help="folder for table.md, the profiler trace, its timeline and the memory snapshot")
    p.add_argument("--ranks_per_node", type=int, default=None,
                   help="the torchrun job (--nproc_per_node) whose CPU threads the offload rows are timed on "
                        "(default: 4, a capstone rank's share of its node; 1 with --smoke)")
    p.add_argument("--deadline_s", type=float, default=None,
                   help="start no row after this many seconds (default 540, within a 10-minute device call); "
                        "table.md holds every finished row as it goes")
    args = parser.parse_args(argv)
    check(parser, args)
    if args.what == "gpu":
        gpu_main(args)
        return
    if args.what == "allocator":
        allocator.main(args)
        return
    if args.what == "packing":
        packing.main(args)
        return
    if args.what == "allreduce":
        collectives.bandwidth_main(args)
        return
    sweep.main(args)


def packing_parser(commands) -> None:
    """`packing`'s flags: the timed runs', then the arithmetic's (`packing.py`)."""
    p = commands.add_parser("packing", help="the training loop with and without --pack: real tokens/s, padding, "
                                            "their ratio against its bound; and any tokenizer's padding at a layout")
    p.add_argument("--only", choices=("speed", "arithmetic"), default=None, help="one of the two parts (default both)")
    p.add_argument("--world_size", type=int, default=2, help="CPU ranks of the timed runs")
    p.add_argument("--model", default="tiny", help="the timed runs' model (minidist.finetune's --model)")
    p.add_argument("--max_seq_length", type=int, nargs="+", default=[128, 256],
                   help="one or more; the runs' rows (default: the loop's 128, and 256: no game cut)")
    p.add_argument("--max_steps", type=int, default=12, help="steps per run")
    p.add_argument("--warmup", type=int, default=3, help="first steps of each run left untimed")
    p.add_argument("--rounds", type=int, default=3, help="unpacked then packed, this many times")
    p.add_argument("--tokenizer", nargs="+", default=["tiny"],
                   help="one or more, for the arithmetic: `tiny` (the chess tokenizer), a cached hub name, a folder")
    p.add_argument("--layout_world_size", type=int, default=4, help="the arithmetic's layout (default: "
                   "slurm/chess_finetune.sh's, 4 ranks x 4 games x 2 micro-batches, rows of 512)")
    p.add_argument("--layout_batch_size_per_device", type=int, default=4)
    p.add_argument("--layout_accumulation", type=int, default=2)
    p.add_argument("--layout_max_seq_length", type=int, default=512)
    p.add_argument("--layout_steps", type=int, default=200, help="steps of the sampler's order counted")


def gpu_main(args) -> None:
    """The GPU check, after the mistakes a user can make are told in one line (exit 2)."""
    from minidist.bench import gpu

    problem = None
    if not args.smoke and not torch.cuda.is_available():
        problem = "no CUDA GPU here: run with --smoke to check the command on CPU"
    elif os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")) != "1":  # init_distributed would wait
        problem = "the GPU check is one process on one GPU: run it with python in one task, not under torchrun"
    else:
        try:
            Path(args.out).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            problem = f"cannot make the folder --out {args.out} ({err.strerror}): name another one"
    if problem:
        fail("python -m minidist.bench gpu", problem)
    gpu.main(args)


if __name__ == "__main__":
    main()
