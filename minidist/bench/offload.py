"""The GPU check's offload rows: ZeRO-2 and FSDP by hand with and without `--cpu_offload`.

`gpu.py` calls `compare` after its main table, on the same Llama and batches: for each of the two
strategies, the step time without offload and with it (median of the timed steps, and the ratio),
and the device's peak: on a GPU the allocator's counter (`torch.cuda.max_memory_allocated`, which
pinned host memory does not enter), on the CPU the device side of `memory/sides.py`'s split.
Beside them the estimate's device and host columns (`memory/offload_split.py`). What to expect
on a GPU: the device peak falls by the 12 bytes per parameter of masters and moments (ZeRO-2: of
its shard), and the step grows by the CPU's AdamW and the PCIe copies (`parallel/offload.py`).
"""

import statistics

import torch

from minidist.bench.strategies import time_steps
from minidist.memory.sides import SplitLiveTensors  # imported before any wrapping: it sees host tensors placed

STRATEGIES = ("zero2", "fsdp")


def _build(strategy_name, cpu_offload, source, env):
    from minidist.parallel.options import ParallelOptions
    from minidist.parallel.strategy import get_strategy

    strategy = get_strategy(ParallelOptions(strategy=strategy_name, impl="minidist", mixed_precision="bf16",
                                            cpu_offload=cpu_offload), env)
    model = strategy.wrap(strategy.load_model(source))
    model.train()
    return strategy, model, strategy.build_optimizer(model, lr=1e-5, weight_decay=0.0)


def _device_peak(step, model, optimizer, device) -> int:
    from minidist.memory.measure import step_peak

    if device.type == "cuda":
        return step_peak(step, model, optimizer, device)
    with SplitLiveTensors(device, model, optimizer) as live:
        step()
    return live.device_peak


def run(strategy_name, cpu_offload, source, sizes, env, shape, batches, accumulation) -> dict:
    from minidist.step import train_step
    from minidist.memory import estimator

    strategy, model, optimizer = _build(strategy_name, cpu_offload, source, env)
    num_targets = accumulation * sizes["batch"] * (sizes["seq"] - 1)

    def step():
        train_step(model, strategy, batches, num_targets, world_size=1)
        strategy.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    time_steps(step, sizes["warmup"])
    times = time_steps(step, sizes["steps"])
    setup = estimator.setup(strategy=strategy_name, impl="minidist", world_size=1, cpu_offload=True,
                            batch_size_per_device=sizes["batch"], max_seq_length=sizes["seq"], padded=False,
                            gradient_accumulation_steps=accumulation,
                            backend="nccl" if env.device.type == "cuda" else "gloo")
    estimate = estimator.estimate(shape, setup)
    return {"strategy": strategy_name, "offload": cpu_offload, "median": statistics.median(times),
            "device_peak": _device_peak(step, model, optimizer, env.device),
            "estimate_device": estimate["device"] if cpu_offload else None, "estimate_host": estimate["host"]}


def compare(source, sizes, env, shape, batches, accumulation) -> str:
    """The markdown table of the offload rows (each setup alone, freed before the next)."""
    import gc

    rows = []
    for strategy_name in STRATEGIES:
        for cpu_offload in (False, True):
            rows.append(run(strategy_name, cpu_offload, source, sizes, env, shape, batches, accumulation))
            gc.collect()
            if env.device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(env.device)
    lines = ["| setup | --cpu_offload | step (median) | step / no offload | device peak (MB) | estimate: device, host (MB) |",
             "|" + " --- |" * 6]
    plain = {r["strategy"]: r for r in rows if not r["offload"]}
    for r in rows:
        base = plain[r["strategy"]]
        estimate = (f"{r['estimate_device'] / 1e6:.1f}, {r['estimate_host'] / 1e6:.1f}" if r["offload"] else "")
        lines.append(f"| minidist/{r['strategy']} | {'on' if r['offload'] else 'off'} | {r['median'] * 1e3:.1f} ms "
                     f"| {r['median'] / base['median']:.2f}x | {r['device_peak'] / 1e6:.1f} | {estimate} |")
    return "\n".join(lines)
