"""The GPU check's table and its goals: what `gpu.py` measured, as markdown, and judged.

A row (a dict made by `gpu.run_setup`) holds the model, the setup, the estimate, and either the
step times, the peaks and the MFU, or an `error` (out of memory, or skipped by the gate). The
table says each row's numbers; the goals say, in one line each, whether the issue's targets were
met on this device:

- every row's allocated peak within 5% of the estimate of the same setup;
- the hand-written FSDP within 1.05x of PyTorch's FSDP2, in step time and in peak, at world
  size 1, with and without checkpointing;
- the 1B Llama at 40% MFU or more on an H100 (989 TFLOP/s bf16 dense, NVIDIA's H100 SXM
  datasheet; the H200 has the same 989), judged on its best row.

Neither is asserted by any test: a CPU has no MFU, and its times say nothing about a GPU's.
"""

import statistics

REFERENCE = {"ddp": ("torch", "ddp"), "zero1": ("torch", "ddp"), "zero2": ("torch", "ddp"), "fsdp": ("torch", "fsdp")}
PEAK_TOLERANCE = 0.05  # |peak / estimate - 1|
FSDP_BOUND = 1.05  # hand-written FSDP over FSDP2, step and peak
MFU_GOAL = 0.40
BLIND = ("world size 1: the hand-written strategies' collectives are local copies (comm.py) and PyTorch's "
         "run NCCL with no peer, so no row includes communication; see the NCCL line below the tables")


def label(row: dict) -> str:
    return f"{row['model']} {row['impl']}/{row['strategy']} checkpointing {'on' if row['checkpointing'] else 'off'}"


def _median(row: dict) -> float:
    return statistics.median(row["times"])


def _find(rows: list[dict], model: str, impl: str, strategy: str, checkpointing: bool) -> dict | None:
    return next((r for r in rows if "times" in r and (r["model"], r["impl"], r["strategy"], r["checkpointing"])
                 == (model, impl, strategy, checkpointing)), None)


def table(rows: list[dict]) -> str:
    """The rows as one markdown table (printed, and written to table.md), after a line saying
    what world size 1 hides. The reserved peak is blank where there is no caching allocator."""
    sizes = [r.get(key) or 0 for r in rows for key in ("peak", "reserved", "estimate")]
    unit, scale = ("GB", 1e9) if max(sizes) > 1e9 else ("MB", 1e6)
    columns = (f"| model | setup | checkpointing | step (median, min-max) | tokens/s | MFU | peak allocated ({unit}) "
               f"| peak reserved ({unit}) | estimate ({unit}) | peak / estimate | step / torch's |")
    lines = [f"Blind to NCCL: {BLIND}.", "", columns, "|" + " --- |" * 11]
    for r in rows:
        start = f"| {r['model']} | {r['impl']}/{r['strategy']} | {'on' if r['checkpointing'] else 'off'} |"
        if "error" in r:
            lines.append(f"{start} {r['error']} | | | | | {r['estimate'] / scale:.2f} | | |")
            continue
        reference = REFERENCE[r["strategy"]]
        ref = _find(rows, r["model"], *reference, r["checkpointing"])  # its reference with the same checkpointing
        versus = ("reference" if reference == (r["impl"], r["strategy"]) else
                  f"{_median(r) / _median(ref):.2f}x" if ref else "-")
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else ""
        reserved = f"{r['reserved'] / scale:.2f}" if r["reserved"] is not None else ""
        times = r["times"]
        lines.append(f"{start} {_median(r) * 1e3:.1f} ms ({min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}) "
                     f"| {r['tokens_per_s']:,.0f} | {mfu} | {r['peak'] / scale:.2f} | {reserved} "
                     f"| {r['estimate'] / scale:.2f} | {r['peak'] / r['estimate']:.2f}x | {versus} |")
    return "\n".join(lines)


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def goals(rows: list[dict], first_model: str) -> list[str]:
    """One line per goal (module docstring), judged on the rows that ran; `first_model` names
    the 1B Llama's rows, whose MFU is judged."""
    measured = [r for r in rows if "times" in r]
    if not measured:
        return ["goals: no row ran"]
    off = [label(r) for r in measured if abs(r["peak"] / r["estimate"] - 1) > PEAK_TOLERANCE]
    lines = [f"peak within {PEAK_TOLERANCE:.0%} of the estimate: {len(measured) - len(off)} of {len(measured)} rows"
             + (f" (not: {'; '.join(off)})" if off else "") + f", {_met(not off)}"]
    for model in dict.fromkeys(r["model"] for r in measured):
        for checkpointing in (False, True):
            mine, theirs = (_find(rows, model, impl, "fsdp", checkpointing) for impl in ("minidist", "torch"))
            if mine is None or theirs is None:
                continue
            step, peak = _median(mine) / _median(theirs), mine["peak"] / theirs["peak"]
            lines.append(f"{model}, checkpointing {'on' if checkpointing else 'off'}: minidist FSDP / FSDP2 step "
                         f"{step:.2f}x, peak {peak:.2f}x (goal: both at most {FSDP_BOUND:.2f}x, "
                         f"{_met(step <= FSDP_BOUND and peak <= FSDP_BOUND)})")
    judged = [r for r in measured if r["model"] == first_model and r["mfu"] is not None]
    if not judged:
        lines.append(f"MFU: no bf16 peak known for this device, not judged (goal: {MFU_GOAL:.0%} on an H100)")
    else:
        best = max(judged, key=lambda r: r["mfu"])
        lines.append(f"MFU of {first_model}: best {best['mfu']:.1%} ({label(best)}), {sum(r['mfu'] >= MFU_GOAL for r in judged)}"
                     f" of {len(judged)} rows at {MFU_GOAL:.0%} or more (goal: {MFU_GOAL:.0%} on an H100, "
                     f"{_met(best['mfu'] >= MFU_GOAL)})")
    return lines
