"""The memory estimate as people read it: a table for one case, a README table, other estimators.

`estimator.py` computes the terms; this module turns them into what the command prints
(`python -m minidist.memory ...`, in `__main__.py`), with `--gpu_memory` (does it fit, the
largest batch that does) and `--readme_table`, and sets them beside what `accelerate` and
DeepSpeed would say, and what PyTorch's own `MemTracker` measures on one step traced under fake
tensors (`tracker.py`).
"""

import re
from dataclasses import replace

from minidist.memory import offload_split, tracker
from minidist.memory.estimator import (GB, Setup, Shape, activations, as_dict, estimate, largest_batch, peak_moment,
                                       setup)
from minidist.strategy.options import STRATEGIES


def others(s: Shape, setup: Setup, trace: bool = False) -> dict:
    """What two popular estimators say for the same case (model states only, no activations), and
    what PyTorch's MemTracker measures on one step of the model traced under FakeTensorMode
    (`tracker.py`): the whole step's peak, or None where it does not apply (ZeRO-1/2, FSDP by
    hand) or `trace` is False.

    `accelerate estimate-memory` (accelerate 1.15, commands/estimate.py): one number per model and
    dtype, whatever the strategy or number of GPUs. It sizes `AutoModel` (no output layer) as
    transformers builds it, in the config's dtype (bf16 for CodeLlama under transformers 5), takes
    that as the fp32 size and reports the largest stage: for bf16 Adam's two states, 2x; for fp32 4x.
    DeepSpeed (deepspeed/runtime/zero/stage_1_and_2.py and stage3.py,
    estimate_zero2/3_model_states_mem_needs, no offload): ZeRO-2 2P + 18P/N; ZeRO-3
    4 x largest layer + 18P/N. DeepSpeed has no estimator for DDP or ZeRO-1.
    """
    p, n = s.num_params, setup.world_size
    deepspeed = {"zero2": 2 * p + 18 * p // n, "fsdp": 4 * s.largest_module_params + 18 * p // n}.get(setup.strategy)
    size = s.base_params * s.config_dtype_bytes
    traced = (tracker.peak(s.name, setup) if trace else None) or {}
    if trace and not tracker.applies(setup):
        traced = {"error": "tensor parallelism: it traces one process's whole model" if setup.options.tp_size > 1
                  else f"minidist's own {setup.strategy}: it traces DDP and PyTorch's FSDP"}
    return {"accelerate": (2 if setup.options.mixed_precision == "bf16" else 4) * size, "deepspeed": deepspeed,
            "memtracker": traced.get("peak"), "memtracker_split": traced}


def parse_bytes(text: str) -> float:
    """'80GB' -> 8e10, '79.2GiB' -> 79.2 * 2**30, '8e10' -> 8e10."""
    units = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not match or match.group(2) not in units:
        raise ValueError(f"--gpu_memory must look like 80GB, 79.2GiB or 8e10, got {text!r}")
    return float(match.group(1)) * units[match.group(2)]


LABELS = {
    "parameters": "parameters", "gradients": "gradients", "optimizer_states": "optimizer states (AdamW)",
    "buckets": "gradient buckets (DDP, ZeRO)", "gathered_units": "gathered FSDP units",
    "activations": "activations saved for backward", "activations_per_layer": "  one decoder layer, in full",
    "weight_copies": "bf16 weight copies (autocast)", "recompute": "recomputed layer (checkpointing)",
    "logits": "logits and their gradients", "optimizer_step": "optimizer step temporary", "peak": "peak per rank",
    "device_shard": "compute-dtype shard (FSDP)",
}


def report(s: Shape, setup: Setup, gpu_memory: float | None = None, trace: bool = False) -> dict:
    """The estimate, what it means for a GPU of `gpu_memory` bytes, and what others would say
    (`trace`: with MemTracker's figure, which traces one step the first time per setup, seconds to
    minutes: `tracker.py`; `--memtracker` on the command)."""
    moment, alive = peak_moment(s, setup)
    result = {"model": s.name, "architecture": s.architecture, "num_params": s.num_params,
              "setup": as_dict(setup), "bytes": estimate(s, setup), "traced": _traced_as(s, setup),
              "peak_moment": moment, "alive_at_peak": alive}
    if setup.options.cpu_offload:  # (term, bytes, "device" or "host"): the table's two columns
        result.update(sides=offload_split.columns(s, setup, result["bytes"]), pcie=offload_split.pcie_bytes(s, setup))
    if gpu_memory is not None:
        result.update(gpu_memory=gpu_memory, fits=result["bytes"]["peak"] <= gpu_memory,
                      largest_batch_per_device=largest_batch(s, setup, gpu_memory))
    result["others"] = others(s, setup, trace)
    return result


def _traced_as(s: Shape, setup: Setup) -> str:
    """How the activations were counted: the attention the trace ran, the layer types it found."""
    acts = activations(s, setup)
    names = [kind.split("(")[0] for kind in acts["types"]]  # the class and attention variant; numbered where they repeat
    names = [f"{n} (type {i + 1})" if names.count(n) > 1 else n for i, n in enumerate(names)]
    kinds = ", ".join(f"{count} x {name}" for name, (count, _) in zip(names, acts["types"].values()))
    seq2seq = "; an encoder-decoder: minidist.finetune does not train it" if s.is_encoder_decoder else ""
    return f"activations traced on fake tensors: {acts['attention']} attention, layers {kinds}{seq2seq}"


def _size(n: float, unit: str = "B") -> str:
    """6.74e9 -> '6.74 GB', 4.15e6 -> '4.15 MB': decimal units, as GPU makers count."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}"


def format_report(r: dict) -> str:
    u = r["setup"]
    lines = [f"{r['model']}: {r['architecture']}, {_size(r['num_params'], '').replace(' G', ' B')} parameters",
             f"({r['traced']})",
             f"{u['impl']}/{u['strategy']} on {u['world_size']} rank(s), "
             + (f"tensor parallel over {u['tp_size']} of them, " if u["tp_size"] > 1 else "")
             + ("sequence parallel, " if u["sequence_parallel"] else "")
             + f"{u['mixed_precision']}, batch "
             f"{u['batch_size_per_device']} x {u['max_seq_length']} tokens per device"
             + (" (packed rows: the block-diagonal mask)" if u.get("packed") else "" if u["padded"] else " (unpadded)")
             + (f" > {u['target_length']} target tokens" if u["target_length"] else "")
             + (", activation checkpointing" if u["gradient_checkpointing"] else "")
             + ("" if u["layer_wrap_policy"] or u["strategy"] != "fsdp" else ", no layer wrap policy"), ""]
    if "host" in r["bytes"]:  # --cpu_offload: each term in the column of the side that holds it (offload_split.py)
        lines += [f"{'':<34} {'device':>10} {'host':>10}"] + [
            f"{LABELS[k]:<34} " + (f"{_size(v):>10} {'':>10}" if where == "device" else f"{'':>10} {_size(v):>10}")
            for k, v, where in r["sides"] if v and k in LABELS]
        lines.append(f"{'peak per rank, each side':<34} {_size(r['bytes']['device']):>10} {_size(r['bytes']['host']):>10}")
        lines.append(f"over PCIe per step and rank: {_size(r['pcie']['device_to_host'])} of gradients out, "
                     f"{_size(r['pcie']['host_to_device'])} of weights back")
    else:
        lines += [f"{label:<34} {_size(r['bytes'][k]):>10}" for k, label in LABELS.items() if r["bytes"].get(k) or k == "peak"]
    alive = ", ".join(f"{term.replace('_', ' ')} {_size(n)}" for term, n in r["alive_at_peak"].items() if n)
    lines.append(f"(the peak falls in {r['peak_moment']}: {alive})")
    if "fits" in r:
        largest = r["largest_batch_per_device"]
        lines.append(f"fits in {_size(r['gpu_memory'])}: {'yes' if r['fits'] else 'no'}; largest batch per "
                     f"device that fits: {largest or 'none, not even 1'}")
    o = r["others"]
    lines.append(f"model states only, as others count them: accelerate {_size(o['accelerate'])}"
                 + (f", DeepSpeed {_size(o['deepspeed'])}" if o["deepspeed"] else ""))
    if o["memtracker"]:
        split = ", ".join(f"{k.lower()} {_size(v)}" for k, v in o["memtracker_split"].items() if k != "peak" and v >= 1e6)
        lines.append(f"the whole step as PyTorch's MemTracker sees it (traced under fake tensors): peak "
                     f"{_size(o['memtracker'])} ({split})")
    elif "error" in o["memtracker_split"]:
        lines.append(f"PyTorch's MemTracker did not trace this step ({o['memtracker_split']['error']})")
    return "\n".join(lines)


def readme_table(s: Shape, base: Setup, gpu_memory: float, world_sizes=(1, 4, 8)) -> str:
    """Markdown: every strategy on 1, 4 and 8 GPUs; batch 1, then the largest batch without and with
    checkpointing; beside them accelerate's, DeepSpeed's and MemTracker's figures at batch 1."""
    rows = ["| GPUs | strategy | model states | peak at batch 1 | fits at batch 1 | largest batch | largest batch, "
            "checkpointing | accelerate | DeepSpeed | PyTorch MemTracker |", "|---:|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for n in world_sizes:
        for strategy in STRATEGIES:
            plain, ckpt = (report(s, replace(setup(**{**as_dict(base), "strategy": strategy, "impl": "torch",
                                                        "gradient_checkpointing": c}), world_size=n,
                                                batch_size_per_device=1), gpu_memory, trace=not c)
                           for c in (False, True))
            b, o = plain["bytes"], plain["others"]
            states = b["parameters"] + b["gradients"] + b["optimizer_states"]
            rows.append(f"| {n} | {plain['setup']['impl']}/{strategy} | {states / GB:.1f} GB | {b['peak'] / GB:.1f} GB | "
                        f"{'yes' if plain['fits'] else 'no'} | {plain['largest_batch_per_device'] or '-'} | "
                        f"{ckpt['largest_batch_per_device'] or '-'} | {o['accelerate'] / GB:.1f} GB | "
                        + (f"{o['deepspeed'] / GB:.1f} GB |" if o["deepspeed"] else "- |")
                        + (f" {o['memtracker'] / GB:.1f} GB |" if o["memtracker"] else " - |"))
    return "\n".join(rows)
