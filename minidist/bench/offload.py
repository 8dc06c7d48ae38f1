"""The GPU check's offload rows: ZeRO-2 and FSDP by hand with and without `--cpu_offload`.

`gpu.py` calls `compare` after its main table, on the same Llama and batches: for each of the two
strategies, the step time without offload and with it (median of the timed steps, and the ratio),
and the device's peak: on a GPU the allocator's counter (`torch.cuda.max_memory_allocated`, which
pinned host memory does not enter; `max_memory_reserved` beside it), on the CPU the device side of
`memory/sides.py`'s split. Beside them the estimate's device and host columns
(`memory/offload_split.py`). What to expect on a GPU: the device peak falls by the 12 bytes per
parameter of masters and moments (ZeRO-2: of its shard), and the step grows by the CPU's AdamW
and the PCIe copies (`parallel/offload.py`).

A row runs where its estimate fits the GPU (`gate.py`), as in `gpu.py`. Each row is timed on the
CPU threads one rank of a torchrun job on this node would have (`threads.job_threads`): with
offload, the rank's share of the cores (`use_cores_for_offload`); without, torchrun's
OMP_NUM_THREADS=1 where it sets it. An offloaded row whose count differs from this process's is
timed on all of this process's threads too, so the difference shows.
"""

import statistics

import torch

from minidist.bench import snapshot
from minidist.bench import threads as cpu_threads
from minidist.bench.gate import gpu_memory, skip_reason
from minidist.bench.strategies import time_steps

# imported before any wrapping: it sees host tensors placed
from minidist.memory.sides import SplitLiveTensors

STRATEGIES = ("zero2", "fsdp")


def _build(strategy_name, cpu_offload, source, env):
    from minidist.strategy.options import ParallelOptions
    from minidist.strategy import get_strategy

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


def estimate(strategy_name, cpu_offload, sizes, env, shape, accumulation) -> dict:
    """The estimate of one row's setup: its peak, and with offload its device and host sides."""
    from minidist.memory import estimator

    setup = estimator.setup(strategy=strategy_name, impl="minidist", world_size=1, cpu_offload=cpu_offload,
                            batch_size_per_device=sizes["batch"], max_seq_length=sizes["seq"], padded=False,
                            gradient_accumulation_steps=accumulation,
                            backend="nccl" if env.device.type == "cuda" else "gloo")
    return estimator.estimate(shape, setup)


def run(strategy_name, cpu_offload, source, sizes, env, shape, batches, accumulation, threads: int,
        all_threads: int) -> dict:
    """One row, where its estimate fits the GPU (`gate.py`): the setup timed on `threads` CPU
    threads (and, offloaded, on `all_threads` too where that differs), its device peak, and the
    estimate's device and host bytes."""
    from minidist.step import train_step

    expected = estimate(strategy_name, cpu_offload, sizes, env, shape, accumulation)
    row = {"strategy": strategy_name, "offload": cpu_offload, "threads": threads,
           "estimate_device": expected["device"] if cpu_offload else None,
           "estimate_host": expected["host"] if cpu_offload else None}
    reason = skip_reason(expected["peak"], gpu_memory(env.device))  # under offload the peak is the device's
    if reason:
        print(f"minidist/{strategy_name}, --cpu_offload {'on' if cpu_offload else 'off'}: {reason}", flush=True)
        return {**row, "error": reason}
    strategy, model, optimizer = _build(strategy_name, cpu_offload, source, env)
    num_targets = accumulation * sizes["batch"] * (sizes["seq"] - 1)

    def step():
        train_step(model, strategy, batches, num_targets, world_size=1)
        strategy.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with cpu_threads.using(threads):  # as the job's rank would run it
        time_steps(step, sizes["warmup"])
        times = time_steps(step, sizes["steps"])
    on_all = None
    if cpu_offload and all_threads != threads:
        with cpu_threads.using(all_threads):
            on_all = statistics.median(time_steps(step, sizes["steps"]))
    return {**row, "median": statistics.median(times), "on_all_threads": on_all,
            "device_peak": _device_peak(step, model, optimizer, env.device),
            "reserved": snapshot.reserved_peak(env.device)}  # the same step's: step_peak reset the counters


def compare(source, sizes, env, shape, batches, accumulation, ranks_per_node: int, environ) -> str:
    """The markdown table of the offload rows (each setup alone, freed before the next), after a
    line saying which thread counts a torchrun rank of `ranks_per_node` per node would have."""
    import gc

    from minidist.runtime.distributed import usable_cores

    all_threads = torch.get_num_threads()  # this process's: PyTorch's default, or init_distributed's share
    decided = {cpu_offload: cpu_threads.job_threads(environ, usable_cores(), all_threads, ranks_per_node, cpu_offload)
               for cpu_offload in (False, True)}
    rows = []
    for strategy_name in STRATEGIES:
        for cpu_offload in (False, True):
            rows.append(run(strategy_name, cpu_offload, source, sizes, env, shape, batches, accumulation,
                            decided[cpu_offload][0], all_threads))
            gc.collect()
            if env.device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(env.device)
    return threads_line(decided, ranks_per_node, all_threads) + "\n\n" + offload_table(rows, all_threads)


def threads_line(decided: dict, ranks_per_node: int, all_threads: int) -> str:
    (plain, plain_source), (offloaded, offloaded_source) = decided[False], decided[True]
    return (f"CPU threads, as one rank of torchrun --nproc_per_node {ranks_per_node} on this node would have them: "
            f"without offload {plain} ({plain_source}), with --cpu_offload {offloaded} ({offloaded_source}); "
            f"this process has {all_threads}")


def offload_table(rows: list[dict], all_threads: int) -> str:
    columns = ("| setup | --cpu_offload | CPU threads | step (median) | step / no offload "
               f"| step on all {all_threads} threads | device peak (MB) | reserved (MB) | estimate: device, host (MB) |")
    lines = [columns, "|" + " --- |" * 9]
    plain = {r["strategy"]: r for r in rows if not r["offload"] and "error" not in r}
    for r in rows:
        estimate = f"{r['estimate_device'] / 1e6:.1f}, {r['estimate_host'] / 1e6:.1f}" if r["offload"] else ""
        start = f"| minidist/{r['strategy']} | {'on' if r['offload'] else 'off'} | {r['threads']} |"
        if "error" in r:
            lines.append(f"{start} {r['error']} | | | | | {estimate} |")
            continue
        base = plain.get(r["strategy"])
        ratio = f"{r['median'] / base['median']:.2f}x" if base else "-"
        on_all = f"{r['on_all_threads'] * 1e3:.1f} ms" if r["on_all_threads"] is not None else ""
        reserved = f"{r['reserved'] / 1e6:.1f}" if r["reserved"] is not None else ""
        lines.append(f"{start} {r['median'] * 1e3:.1f} ms | {ratio} | {on_all} | {r['device_peak'] / 1e6:.1f} "
                     f"| {reserved} | {estimate} |")
    return "\n".join(lines)
