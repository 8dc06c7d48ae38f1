"""Benchmarks: the hand-written strategies against PyTorch's own, in one run, as ratios.

    python -m minidist.bench ddp      # naive DDP, bucketed DDP, torch DDP; 2 CPU ranks
    python -m minidist.bench fsdp     # FSDP, ZeRO-2 (minidist) and torch FSDP2; 2 CPU ranks

Absolute times depend on the machine and on what else runs on it; a ratio measured in one run,
on the same model, data and ranks, mostly does not. So every implementation gets its own copy
of one randomly initialised model (FSDP wrapping replaces a model's parameters by flat shards,
so each wraps its own `deepcopy`) and the same batch on every rank, and they take turns: each
round times a few steps of each, and the rounds repeat, so a slow minute hurts all of them
alike. A step is forward, backward (with its communication), and the optimizer step; its time
is the slowest rank's, because the next step cannot start before that rank is done. The
figure reported is the median step. The hand-written ones also count the bytes each rank sends
in one step (`comm.counter`, ring collectives); PyTorch's do not go through `comm`.
"""

import argparse
import copy
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


def _ddp_implementations(base, bucket_cap_mb) -> tuple[dict, str]:
    """Naive, bucketed and PyTorch DDP, each around its own copy of `base`, with its optimizer."""
    from torch.nn.parallel import DistributedDataParallel

    from minidist import ddp

    bucketed = ddp.BucketedDDP(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb)
    models = {
        "naive DDP (minidist)": ddp.NaiveDDP(copy.deepcopy(base)),
        "bucketed DDP (minidist)": bucketed,
        "DistributedDataParallel (torch)": DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb),
    }
    wrapped = {name: (model, torch.optim.AdamW(model.parameters(), lr=1e-4)) for name, model in models.items()}
    return wrapped, f"bucketed DDP: buckets of {bucket_cap_mb:g} MB ({len(bucketed.buckets)} for this model)"


def _fsdp_implementations(base, bucket_cap_mb) -> tuple[dict, str]:
    """minidist FSDP (one unit per decoder layer and the root), minidist ZeRO-2, and PyTorch's
    FSDP2 (`fully_shard` on every decoder layer, then on the root), each on its own copy of `base`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from minidist.fsdp import FullyShardedDataParallel
    from minidist.zero import ZeroDP

    layer = "LlamaDecoderLayer"
    fsdp = FullyShardedDataParallel(copy.deepcopy(base), unit_classes={layer}, device=get_env().device)
    zero2 = ZeroDP(copy.deepcopy(base), stage=2, bucket_cap_mb=bucket_cap_mb)
    torch_fsdp = copy.deepcopy(base)
    mesh = init_device_mesh(get_env().device.type, (get_env().world_size,))
    for module in torch_fsdp.modules():
        if type(module).__name__ == layer:
            fully_shard(module, mesh=mesh)
    fully_shard(torch_fsdp, mesh=mesh)
    wrapped = {
        "FSDP (minidist)": (fsdp, fsdp.build_optimizer(lr=1e-4)),
        "ZeRO-2 (minidist)": (zero2, zero2.build_optimizer(lr=1e-4)),
        "fully_shard FSDP2 (torch)": (torch_fsdp, torch.optim.AdamW(torch_fsdp.parameters(), lr=1e-4, betas=(0.9, 0.95))),
    }
    return wrapped, (f"FSDP units: {len(fsdp.units)} ({len(fsdp.layer_units)} x {layer} + root); "
                     f"ZeRO-2 buckets of {bucket_cap_mb:g} MB ({len(zero2.buckets)} for this model)")


IMPLEMENTATIONS = {"ddp": _ddp_implementations, "fsdp": _fsdp_implementations}


def time_implementations(what, hidden_size, num_layers, batch_size, seq_len, bucket_cap_mb, warmup, steps, rounds):
    """Run in every rank: time the implementations compared by `what` on one model, turn by turn."""
    from transformers import LlamaForCausalLM

    from minidist import comm, models

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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m minidist.bench", description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=tuple(IMPLEMENTATIONS), help="which strategies to compare")
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--hidden_size", type=int, default=384)
    parser.add_argument("--num_layers", type=int, default=6)
    parser.add_argument("--batch_size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--bucket_cap_mb", type=float, default=25.0, help="DDP and ZeRO buckets")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per implementation")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per implementation per round")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    # Import the worker under its module name: launch() starts fresh interpreters that import it.
    from minidist.bench import time_implementations as worker
    from minidist.launch import launch

    print(f"timing on {args.world_size} ranks ...", flush=True)
    result = launch(worker, args.world_size, args.what, args.hidden_size, args.num_layers, args.batch_size,
                    args.seq_len, args.bucket_cap_mb, args.warmup, args.steps, args.rounds)[0]
    print(report(args.what, result, args))


if __name__ == "__main__":
    main()
