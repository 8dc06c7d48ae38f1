"""Benchmarks: the hand-written strategies against PyTorch's own, in one run, as ratios.

    python -m minidist.bench ddp                  # naive DDP, bucketed DDP, torch DDP; 2 CPU ranks

Absolute times depend on the machine and on what else runs on it; a ratio measured in one run,
on the same model, data and ranks, mostly does not. So every implementation gets its own copy
of one randomly initialised model and the same batch on every rank, and they take turns: each
round times a few steps of each, and the rounds repeat, so a slow minute hurts all of them
alike. A step is forward, backward (with its communication), and the optimizer step; its time
is the slowest rank's, because the next step cannot start before that rank is done. The
figure reported is the median step.
"""

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist

from minidist.distributed import get_env


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


def time_ddp(hidden_size, num_layers, batch_size, seq_len, bucket_cap_mb, warmup, steps, rounds):
    """Run in every rank: time naive, bucketed and PyTorch DDP on one model, turn by turn."""
    from torch.nn.parallel import DistributedDataParallel
    from transformers import LlamaForCausalLM

    from minidist import comm, ddp, models

    env = get_env()
    config = models.tiny_llama_config(hidden_size=hidden_size, num_layers=num_layers, num_heads=max(1, hidden_size // 64))
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(env.rank)  # each rank its own batch, as in training
    input_ids = torch.randint(4, config.vocab_size, (batch_size, seq_len), generator=generator)
    wrapped = {
        "naive DDP (minidist)": ddp.NaiveDDP(copy.deepcopy(base)),
        "bucketed DDP (minidist)": ddp.BucketedDDP(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb),
        "DistributedDataParallel (torch)": DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb),
    }
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, model in wrapped.items()}

    def step(name):
        def run():
            wrapped[name](input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
        return run

    times = {name: [] for name in wrapped}
    for name in wrapped:
        _time_steps(step(name), warmup)  # first steps allocate memory and (bucketed) re-pack buckets
    comm.counter.reset()
    step("bucketed DDP (minidist)")()
    bytes_per_step = comm.counter.bytes_sent
    for _ in range(rounds):
        for name in wrapped:
            times[name] += _time_steps(step(name), steps)
    return {"times": times, "parameters": sum(p.numel() for p in base.parameters()),
            "num_buckets": len(wrapped["bucketed DDP (minidist)"].buckets), "bytes_per_step": bytes_per_step}


def report_ddp(result: dict, args) -> str:
    tokens = args.batch_size * args.seq_len * args.world_size
    medians = {name: statistics.median(times) for name, times in result["times"].items()}
    reference = medians["DistributedDataParallel (torch)"]
    lines = [
        f"DDP on {args.world_size} CPU ranks (gloo): Llama of {result['parameters'] / 1e6:.1f}M parameters "
        f"({args.num_layers} layers x {args.hidden_size}), batch {args.batch_size} x {args.seq_len} tokens per rank, "
        f"buckets of {args.bucket_cap_mb:g} MB ({result['num_buckets']} for this model), "
        f"{args.rounds} rounds x {args.steps} timed steps each",
        f"sent per rank per step: {result['bytes_per_step'] / 1e6:.1f} MB (2(N-1)/N x 4 bytes x P)",
        "",
        f"{'implementation':<34}{'median step':>12}{'tokens/s':>11}{'vs torch':>10}",
    ]
    for name, median in medians.items():
        lines.append(f"{name:<34}{median * 1e3:>9.0f} ms{tokens / median:>11,.0f}{median / reference:>9.2f}x")
    bucketed, naive = medians["bucketed DDP (minidist)"], medians["naive DDP (minidist)"]
    lines += ["",
              f"bucketed / torch DDP: {bucketed / reference:.2f}x (goal: at most 1.10x)",
              f"naive / bucketed:     {naive / bucketed:.2f}x (goal: above 1, bucketed faster)"]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m minidist.bench", description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("ddp",), help="which strategies to compare")
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--hidden_size", type=int, default=384)
    parser.add_argument("--num_layers", type=int, default=6)
    parser.add_argument("--batch_size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--bucket_cap_mb", type=float, default=25.0)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per implementation")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per implementation per round")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    # Import the worker under its module name: launch() starts fresh interpreters that import it.
    from minidist.bench import time_ddp as worker
    from minidist.launch import launch

    print(f"timing on {args.world_size} ranks ...", flush=True)
    result = launch(worker, args.world_size, args.hidden_size, args.num_layers, args.batch_size, args.seq_len,
                    args.bucket_cap_mb, args.warmup, args.steps, args.rounds)[0]
    print(report_ddp(result, args))


if __name__ == "__main__":
    main()
