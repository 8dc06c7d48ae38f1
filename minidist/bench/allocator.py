"""Where a gathered unit's memory comes from: the same FSDP step with glibc's defaults, then with
freed blocks kept (`python -m minidist.bench allocator`).

A GPU job never asks the driver for memory in the middle of a step: PyTorch's CUDA caching
allocator keeps every freed block and hands it to the next tensor of a fitting size. A CPU rank
asks glibc's `malloc`, and glibc serves a request above its mmap threshold (128 KiB at start,
raised as large blocks are freed, never above 32 MiB on 64-bit Linux) with a fresh `mmap`, and
gives it back with `munmap` when it is freed. The kernel then maps every 4 KiB page of the next
such buffer again, on first touch: a minor page fault, paid in system time. An FSDP unit's flat
buffer is one large allocation (a 1536-wide Llama layer is 113 MB in fp32), made and freed on
every gather, and its gradient is one flat tensor too. FSDP2 makes unit-sized flat buffers for its
collectives as well, but the tensors autograd works on are per parameter, 25 MB at most there: below
the threshold once it has risen, so the heap reuses them. Lesson 05 has the measured counts.

`minidist.runtime.allocator.keep_freed_blocks`, called by `init_distributed` on CPU ranks, makes
glibc serve every block from its heap and never trim it, so that freed large blocks are kept for
reuse as the CUDA allocator keeps them; `MINIDIST_GLIBC_DEFAULTS=1` in the environment leaves glibc
as it is. This command runs the same workload twice per hidden size, each time in a fresh one-rank
child (`launch`), first with `MINIDIST_GLIBC_DEFAULTS=1` ("before"), then without ("after"): the
hand-written FSDP and FSDP2,
built and timed as `strategies.py` builds and times them, taking turns round by round. Per step
it reports the median time with the spread of the per-round medians, and what
`resource.getrusage` counts for the process over the timed steps: minor page faults, system and
user CPU time. User time is the arithmetic, alike for both; system time is the kernel's work,
mostly those faults. Then it draws the figure of lesson 05 (`--png`).
"""

import os
import resource
import statistics
import warnings

import torch

from minidist.runtime.allocator import DEFAULTS_VARIABLE

# The two implementations compared, as `strategies._wrapped` takes them.
IMPLEMENTATIONS = {"FSDP (minidist)": {"impl": "minidist", "strategy": "fsdp"},
                   "fully_shard FSDP2 (torch)": {"impl": "torch", "strategy": "fsdp"}}
# Each condition is the environment a child runs under: with glibc's defaults, then with freed blocks kept.
CONDITIONS = {"before (glibc defaults)": {DEFAULTS_VARIABLE: "1"}, "after (freed blocks kept)": {}}


def usage() -> tuple[int, float, float]:
    """(minor page faults, system seconds, user seconds) this process has used so far, all threads."""
    now = resource.getrusage(resource.RUSAGE_SELF)
    return now.ru_minflt, now.ru_stime, now.ru_utime


def time_sizes_worker(hidden_size, num_layers, batch_size, seq_len, warmup, steps, rounds) -> dict:
    """Run in the one rank: FSDP and FSDP2 on one Llama, turn by turn. For each implementation: the
    step times of each round, and the page faults, system and user seconds per timed step."""
    from transformers import LlamaForCausalLM

    from minidist.bench.strategies import _wrapped, time_steps
    from minidist.hf import models

    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")  # comm.py's names
    torch.manual_seed(0)
    base = LlamaForCausalLM(models.tiny_llama_config(hidden_size=hidden_size, num_layers=num_layers,
                                                     num_heads=max(1, hidden_size // 64)))
    tokens = torch.randint(4, base.config.vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    steps_of = {}
    for name, options in IMPLEMENTATIONS.items():
        model, optimizer = _wrapped(base, 0.0, **options)

        def one_step(model=model, optimizer=optimizer):
            model(input_ids=tokens, labels=tokens, use_cache=False).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        steps_of[name] = one_step
    del base  # each implementation holds its own copy
    for one_step in steps_of.values():
        time_steps(one_step, warmup)  # the first steps make the optimizer's states and warm the heap
    found = {name: {"times": [], "usage": [0, 0.0, 0.0]} for name in steps_of}
    for _ in range(rounds):
        for name, one_step in steps_of.items():
            before = usage()
            found[name]["times"].append(time_steps(one_step, steps))
            found[name]["usage"] = [total + now - then for total, now, then in zip(found[name]["usage"], usage(), before)]
    for counts in found.values():
        faults, system, user = counts.pop("usage")
        counts.update(faults=faults / (rounds * steps), system=system / (rounds * steps), user=user / (rounds * steps))
    return found


def measure(sizes, num_layers, batch_size, seq_len, warmup, steps, rounds) -> list[dict]:
    """Every size under every condition, each in a fresh one-rank child: one row per size,
    condition and implementation."""
    from minidist.runtime.launch import launch

    rows = []
    for hidden_size in sizes:
        for condition, environment in CONDITIONS.items():
            print(f"hidden size {hidden_size}, {condition} ...", flush=True)
            saved = os.environ.pop(DEFAULTS_VARIABLE, None)
            os.environ.update(environment)  # launch() hands the child the environment as it is now
            try:
                found = launch(time_sizes_worker, 1, hidden_size, num_layers, batch_size, seq_len, warmup, steps, rounds)[0]
            finally:
                os.environ.pop(DEFAULTS_VARIABLE, None)
                if saved is not None:
                    os.environ[DEFAULTS_VARIABLE] = saved
            for name, counts in found.items():
                rows.append({"hidden_size": hidden_size, "condition": condition, "implementation": name, **counts})
    return rows


def summary(row: dict) -> tuple[float, float, float]:
    """The median step over all rounds, and the lowest and highest of the per-round medians (seconds)."""
    per_round = [statistics.median(times) for times in row["times"]]
    return statistics.median([t for times in row["times"] for t in times]), min(per_round), max(per_round)


def table(rows: list[dict], num_layers: int) -> str:
    """The rows as a Markdown table, then the hand-written FSDP's step over FSDP2's per size and condition."""
    lines = [(f"| hidden x {num_layers} layers | glibc | implementation | median step (rounds) | "
              "minor page faults / step | system s / step | user s / step |"),
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        median, low, high = summary(row)
        lines.append(f"| {row['hidden_size']} | {row['condition']} | {row['implementation']} | "
                     f"{median:.2f} s ({low:.2f}-{high:.2f}) | {row['faults']:,.0f} | {row['system']:.2f} | "
                     f"{row['user']:.2f} |")
    lines += ["", "minidist FSDP / FSDP2, median step:"]
    for first, second in zip(rows[::2], rows[1::2]):  # the two implementations of one size and condition
        lines.append(f"  {first['hidden_size']:>5}, {first['condition']:<26} {summary(first)[0] / summary(second)[0]:.2f}x")
    return "\n".join(lines)


def draw(rows: list[dict], png, num_layers: int) -> None:
    """Two panels, linear axes: page faults per step and the median step time (with its spread over
    the rounds), per hidden size; one line per implementation and condition."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, (faults, times) = plt.subplots(1, 2, figsize=(11, 4))
    for i, name in enumerate(IMPLEMENTATIONS):
        for condition, style, face in zip(CONDITIONS, ("--", "-"), ("none", f"C{i}")):  # before: dashed, hollow
            mine = [row for row in rows if row["implementation"] == name and row["condition"] == condition]
            sizes = [row["hidden_size"] for row in mine]
            look = {"marker": "o", "color": f"C{i}", "markerfacecolor": face,
                    "label": f"{name.split(' (')[0]}, {condition}"}
            faults.plot(sizes, [row["faults"] / 1e3 for row in mine], style, **look)
            medians, lows, highs = zip(*(summary(row) for row in mine))
            errors = [[m - lo for m, lo in zip(medians, lows)], [hi - m for m, hi in zip(medians, highs)]]
            times.errorbar(sizes, medians, yerr=errors, fmt=style, capsize=3, **look)
    faults.set(xlabel="hidden size", ylabel="minor page faults per step (thousands)", title="Page faults per step")
    times.set(xlabel="hidden size", ylabel="seconds per step (median, bars: rounds)", title="Step time")
    for ax in (faults, times):
        ax.set_ylim(bottom=0)
        ax.set_xticks(sorted({row["hidden_size"] for row in rows}))
    times.legend(fontsize=8)
    fig.suptitle(f"One rank, Llama of {num_layers} layers, fp32: glibc's defaults against freed blocks kept",
                 x=0.01, ha="left", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main(args) -> None:
    from minidist.runtime.distributed import usable_cores

    rows = measure(args.sizes, args.num_layers, args.batch_size, args.seq_len, args.warmup, args.steps, args.rounds)
    print(f"\n1 rank on {usable_cores()} CPU cores, batch {args.batch_size} x {args.seq_len}, {args.rounds} rounds x "
          f"{args.steps} timed steps after {args.warmup} untimed, per implementation and condition\n")
    print(table(rows, args.num_layers))
    if args.png:
        draw(rows, args.png, args.num_layers)
        print(f"\nfigure: {args.png}")
