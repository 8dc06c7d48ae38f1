"""The hand-written strategies against PyTorch's own: step time and peak memory, as ratios.

Absolute times depend on the machine and on what else runs on it; a ratio measured in one run,
on the same model, data and ranks, mostly does not. So every implementation gets its own copy
of one randomly initialised model (FSDP wrapping replaces a model's parameters by flat shards,
so each wraps its own `deepcopy`) and the same batch on every rank, and they take turns: each
round times a few steps of each, and the rounds repeat, so a slow minute hurts all of them
alike. A step is forward, backward (with its communication), and the optimizer step; its time
is the slowest rank's, because the next step cannot start before that rank is done. The figure
reported is the median step, and each ratio comes with its spread: the ratio of the medians
within each round, lowest to highest. The hand-written ones also count the bytes each rank
sends in one step (`comm.counter`, ring collectives); PyTorch's do not go through `comm`.

Two things hide a wrapper's cost, and the command can rule both out. On 2 gloo ranks the step
is mostly gloo's: `--world_size 1` leaves no communication to hide behind. And a small model at
a large batch is mostly activations: a wide model at a small batch is mostly weights, as at 7B.
The peak is measured over one whole step, every live tensor counted as a GPU's allocator would
count it (`memory/measure.step_peak`: `LiveTensors` on the CPU, the allocator's own counter on
a GPU), not by category. It comes out the same in every round, so it is measured once per rank,
after the timed rounds, and its ratio's spread is over ranks.

A third thing hides in the step time: the operating system's. Each rank counts the minor page
faults of its process around its timed steps (`runtime.allocator.minor_page_faults`): a page mapped in on first
touch, which is what a buffer freshly `mmap`ed costs. On the CPU a flat buffer above glibc's
mmap threshold is mapped afresh and faulted in, page by page, every step it is remade, while
smaller tensors are reused from the heap; a GPU's caching allocator keeps freed blocks, so it
does not pay this. The command prints them per step, of the rank with most.
"""

import copy
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from minidist.runtime.allocator import minor_page_faults
from minidist.runtime.distributed import get_env

# What each comparison is a ratio to, and its goals (the issue's): each hand-written strategy within 1.05x of
# its reference's step and peak. PyTorch has no ZeRO of its own: ZeRO-2's reference is FSDP2, its peak allowed
# the weights it keeps whole by design, 4P(N-1)/N bytes more (`goal_ratios`).
REFERENCE = {"ddp": "DistributedDataParallel (torch)", "fsdp": "fully_shard FSDP2 (torch)"}
NAIVE, BUCKETED, TORCH_DDP = "naive DDP (minidist)", "bucketed DDP (minidist)", "DistributedDataParallel (torch)"
FSDP, ZERO2, FSDP2 = "FSDP (minidist)", "ZeRO-2 (minidist)", "fully_shard FSDP2 (torch)"
# (label, what is compared, numerator, denominator, kind, bound); "peak + weights": the denominator's peak
# plus 4P(N-1)/N bytes.
GOALS = {
    "ddp": [("bucketed / torch DDP, step", "step", BUCKETED, TORCH_DDP, "at most", 1.05),
            ("bucketed / torch DDP, peak", "peak", BUCKETED, TORCH_DDP, "at most", 1.05),
            ("naive / bucketed DDP, step", "step", NAIVE, BUCKETED, "above", 1.00)],
    "fsdp": [("minidist FSDP / FSDP2, step", "step", FSDP, FSDP2, "at most", 1.05),
             ("minidist FSDP / FSDP2, peak", "peak", FSDP, FSDP2, "at most", 1.05),
             ("ZeRO-2 / FSDP2, step", "step", ZERO2, FSDP2, "at most", 1.05),
             ("ZeRO-2 / (FSDP2 + 4P(N-1)/N), peak", "peak + weights", ZERO2, FSDP2, "at most", 1.00)],
}
# Bytes per rank per step with ring collectives, fp32 (4 bytes), P parameters, N ranks. The hand-written
# FSDP sends less than 3P: its root stays gathered from forward to backward (fsdp.py), so it is gathered once.
EXPECTED_BYTES = {"ddp": "2P(N-1)/N x 4 bytes = {two:.1f} MB",
                  "fsdp": "FSDP (3P - P_root)(N-1)/N x 4 bytes, under 3P(N-1)/N x 4 = {three:.1f} MB; "
                          "ZeRO-2 2P(N-1)/N x 4 = {two:.1f} MB"}


def time_steps(step, num_steps: int) -> list[float]:
    """Seconds per step, each the slowest rank's. On a GPU the clock stops when the GPU is done:
    a kernel runs after the call that queued it has returned."""
    device = get_env().device
    times = []
    for _ in range(num_steps):
        dist.barrier()  # start together, so no rank's time includes waiting for another
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, device=device)  # NCCL reduces GPU tensors only
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
        (NAIVE, {"impl": "minidist", "ddp_variant": "naive"}),
        (BUCKETED, {"impl": "minidist", "ddp_variant": "bucketed"}),
        (TORCH_DDP, {"impl": "torch"}))}
    bucketed = wrapped[BUCKETED][0]
    return wrapped, f"bucketed DDP: buckets of {bucket_cap_mb:g} MB ({len(bucketed.buckets)} for this model)"


def layer_mb(base) -> float:
    """One decoder layer's fp32 gradients in MB (2**20 bytes, as `bucket_cap_mb` counts them)."""
    return 4 * sum(p.numel() for p in base.model.layers[0].parameters()) / 2**20


def _fsdp_implementations(base, bucket_cap_mb) -> tuple[dict, str]:
    """minidist FSDP (one unit per decoder layer and the root), minidist ZeRO-2, and PyTorch's
    FSDP2 (`fully_shard` on every decoder layer, then on the root), each on its own copy of `base`.

    ZeRO-2 reduce-scatters at the grain FSDP2 does: its buckets hold at most one decoder layer's
    gradients. It keeps two buckets alive while it overlaps (one filling, one on the wire), where
    FSDP2 holds about a layer's unsharded gradients at a time. With 25 MB buckets on a model whose
    gradients are 29 MB (8 x 256), those two buckets are nearly a whole copy of the gradients, and
    the peak goal would compare bucket sizes, not implementations (`lessons/reference/strategies.md`,
    "Over layer sizes", gives ZeRO-2's peak at 8 x 256 on 2 ranks with 25 MB buckets and with
    layer-sized ones).
    """
    zero2_cap_mb = min(bucket_cap_mb, layer_mb(base))
    wrapped = {name: _wrapped(base, cap_mb, **options) for name, cap_mb, options in (
        (FSDP, bucket_cap_mb, {"impl": "minidist", "strategy": "fsdp"}),
        (ZERO2, zero2_cap_mb, {"impl": "minidist", "strategy": "zero2"}),
        (FSDP2, bucket_cap_mb, {"impl": "torch", "strategy": "fsdp"}))}
    fsdp, zero2 = wrapped[FSDP][0], wrapped[ZERO2][0]
    return wrapped, (f"FSDP units: {len(fsdp.units)} ({len(fsdp.layer_units)} x {type(fsdp.units[0].module).__name__}"
                     f" + root); ZeRO-2 buckets of {zero2_cap_mb:.3g} MB, at most a layer's gradients "
                     f"({len(zero2.buckets)} for this model)")


IMPLEMENTATIONS = {"ddp": _ddp_implementations, "fsdp": _fsdp_implementations}


def time_implementations(what, hidden_size, num_layers, batch_size, seq_len, bucket_cap_mb, warmup, steps, rounds):
    """Run in every rank: time the implementations compared by `what` on one model, turn by turn."""
    from transformers import LlamaForCausalLM

    from minidist.hf import models
    from minidist.memory.measure import step_peak
    from minidist.parallel import comm

    env = get_env()
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")  # comm.py's names
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
        time_steps(step(name), warmup)  # first steps allocate memory and (bucketed) re-pack buckets
    bytes_per_step = {}
    for name in wrapped:
        comm.counter.reset()
        step(name)()
        bytes_per_step[name] = comm.counter.bytes_sent  # 0 for PyTorch's: they bypass comm
    times = {name: [] for name in wrapped}  # one list of step times per round
    faults = dict.fromkeys(wrapped, 0)  # this rank's minor page faults over its timed steps
    for _ in range(rounds):
        for name in wrapped:
            before = minor_page_faults()
            times[name].append(time_steps(step(name), steps))
            faults[name] += minor_page_faults() - before
    rank_peaks = {name: by_rank(step_peak(step(name), model, optimizer, env.device))  # one more step each
                  for name, (model, optimizer) in wrapped.items()}
    return {"times": times, "parameters": sum(p.numel() for p in base.parameters()), "setup": setup,
            "bytes_per_step": bytes_per_step, "rank_peaks": rank_peaks,
            "peaks": {name: max(peaks) for name, peaks in rank_peaks.items()},  # the rank that needs most
            "rank_faults": {name: by_rank(n / (rounds * steps)) for name, n in faults.items()},
            "device": str(env.device), "backend": env.backend}


def by_rank(value: float) -> list[float]:
    """Every rank's `value`, in rank order, on every rank: each rank fills its own slot of a
    zero vector and one all-reduce sums them."""
    env = get_env()
    mine = torch.zeros(env.world_size, dtype=torch.float64, device=env.device)
    mine[env.rank] = value
    dist.all_reduce(mine)
    return mine.tolist()


def ratio_spread(result: dict, name: str, reference: str) -> tuple[float, float, float]:
    """The ratio of the median steps over all rounds, and its lowest and highest round by round."""
    times, ref = result["times"][name], result["times"][reference]
    per_round = [statistics.median(a) / statistics.median(b) for a, b in zip(times, ref)]
    overall = statistics.median([t for r in times for t in r]) / statistics.median([t for r in ref for t in r])
    return overall, min(per_round), max(per_round)


def peak_spread(result: dict, name: str, reference: str, allowance: float = 0.0) -> tuple[float, float, float]:
    """The ratio of the peaks of the ranks that need most, and its lowest and highest rank by rank.
    A peak is the same in every round (only times move), so its spread is over ranks, not rounds."""
    peaks, ref = result["rank_peaks"][name], result["rank_peaks"][reference]
    per_rank = [a / (b + allowance) for a, b in zip(peaks, ref)]
    return max(peaks) / (max(ref) + allowance), min(per_rank), max(per_rank)


def goal_ratios(what: str, result: dict, world_size: int) -> list[tuple]:
    """(label, ratio, lowest, highest, kind, bound, met) for each goal of `what`."""
    p, n = result["parameters"], world_size
    rows = []
    for label, compared, numerator, denominator, kind, bound in GOALS[what]:
        if compared == "step":
            ratio, low, high = ratio_spread(result, numerator, denominator)
        else:  # ZeRO-2 keeps every fp32 weight: 4P bytes where FSDP keeps 4P/N, the formulas' difference
            weights = 4 * p * (n - 1) / n if compared == "peak + weights" else 0.0
            ratio, low, high = peak_spread(result, numerator, denominator, weights)
        rows.append((label, ratio, low, high, kind, bound, ratio <= bound if kind == "at most" else ratio > bound))
    return rows


def goal_cell(ratio, low, high, kind, bound, met) -> str:
    """One ratio with its spread and its goal: `1.03x (0.98-1.07), at most 1.05x: met`."""
    return f"{ratio:.2f}x ({low:.2f}-{high:.2f}), {kind} {bound:.2f}x: {'met' if met else 'missed'}"


def report(what: str, result: dict, args) -> str:
    """One size on one world size, every implementation's row, then the goals."""
    tokens = args.batch_size * args.seq_len * args.world_size
    medians = {name: statistics.median([t for r in times for t in r]) for name, times in result["times"].items()}
    peaks = result["peaks"]
    P, N = result["parameters"], args.world_size
    lines = [
        (f"{what.upper()} on {N} x {result['device']} ({result['backend']}): Llama of {P / 1e6:.1f}M parameters "
         f"({args.num_layers} layers x {args.hidden_size}), batch {args.batch_size} x {args.seq_len} tokens per rank, "
         f"{args.rounds} rounds x {args.steps} timed steps each"),
        result["setup"],
        "sent per rank per step: " + EXPECTED_BYTES[what].format(two=8 * P * (N - 1) / N / 1e6,
                                                                  three=12 * P * (N - 1) / N / 1e6),
        "",
        (f"{'implementation':<34}{'median step':>12}{'tokens/s':>11}{'vs torch (rounds)':>24}{'peak':>11}"
         f"{'vs torch':>9}{'sent/step':>12}{'faults/step':>13}"),
    ]
    for name, median in medians.items():
        sent = result["bytes_per_step"][name]
        sent = f"{sent / 1e6:>9.1f} MB" if sent else f"{'-':>12}"
        ratio, low, high = ratio_spread(result, name, REFERENCE[what])
        spread = f"{ratio:.2f}x ({low:.2f}-{high:.2f})"
        lines.append(f"{name:<34}{median * 1e3:>9.0f} ms{tokens / median:>11,.0f}{spread:>24}"
                     f"{peaks[name] / 1e6:>8.1f} MB{peaks[name] / peaks[REFERENCE[what]]:>8.2f}x{sent}"
                     f"{max(result['rank_faults'][name]):>13,.0f}")
    lines += ["", "faults/step: minor page faults per timed step, of the rank with most",
              "step: median ratio (lowest and highest round); peak: whole step, the ranks that need most (each rank's):"]
    for label, *cell in goal_ratios(what, result, N):
        lines.append(f"{label + ':':<42}{goal_cell(*cell)}")
    return "\n".join(lines)
