"""The GPU check: every strategy on one GPU, in minutes, against PyTorch's and against the estimate.

    python -m minidist.bench gpu                 # one CUDA GPU: a Llama of about 1B, then CodeLlama-7b's shapes
    python -m minidist.bench gpu --smoke         # the same code on the CPU, tiny sizes, in seconds

CPU runs are blind to what a GPU punishes: a kernel launched per parameter, a copy that waits on
the host, a buffer kept one step too long. This command runs what needs a GPU, once, on a world
of one rank: a collective has no peer to wait for, so what is left is the CUDA path itself (NCCL,
bf16, the allocator), the wrapper's own overhead, and its memory. Each of the six setups
(PyTorch's DDP, the hand-written DDP, ZeRO-1, ZeRO-2 and FSDP, PyTorch's FSDP2), with and
without activation checkpointing, is built as `finetune.py` builds it (`load_model`,
`checkpoint_activations`, `wrap`, `build_optimizer`) on a Llama with random weights, and runs the
loop's own step: `step.train_step` over two micro-batches of random tokens (gradient
accumulation 2, the first under `no_sync`), `clip_grad_norm_`, the optimizer step. Each row says:

- the step time: the median of a few steps after warm-up, with the fastest and slowest, and
  tokens/s. Each setup runs alone, everything of the last one freed first, so its peak is its
  own; the setups do not take turns as in `strategies.py`: two 1B models with their optimizer
  states would not fit on one GPU together.
- MFU: the model's training FLOPs per second (`metrics.flops_per_token`; recomputation is not
  useful work) over the GPU's bf16 peak; blank where the peak is unknown, as on the CPU.
- the whole step's peak memory (`memory.measure.step_peak`: the allocator's counter on a GPU,
  `LiveTensors` on the CPU) as a ratio to `memory.estimator`'s estimate of the same setup.
  Neither counts the CUDA context or NCCL's own buffers, so the ratio should be near 1.
- the step time as a ratio to PyTorch's: DDP, ZeRO-1 and ZeRO-2 by hand to PyTorch's DDP, FSDP
  by hand to FSDP2, with the same checkpointing.

A second table (`offload.py`) sets ZeRO-2 and FSDP by hand with `--cpu_offload` beside
themselves without it: step time, the device's peak, the estimate's device and host columns.

On a GPU with at least 120 GB it also times CodeLlama-7b's real shapes (the bundled config,
random weights made on the GPU, nothing downloaded) with FSDP, checkpointing, batch 1 x 512: 16
bytes per parameter are about 108 GB. It saves a `torch.profiler` trace of one minidist FSDP step
(open the JSON in chrome://tracing or Perfetto), its timeline as a PNG (`timeline.py`, for
lesson 05), and the table as markdown (`table.md`), under `--out`.
"""

import dataclasses
import datetime
import gc
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from minidist.bench import offload, timeline
from minidist.bench.strategies import time_steps

SETUPS = [("torch", "ddp"), ("minidist", "ddp"), ("minidist", "zero1"), ("minidist", "zero2"),
          ("minidist", "fsdp"), ("torch", "fsdp")]
REFERENCE = {"ddp": ("torch", "ddp"), "zero1": ("torch", "ddp"), "zero2": ("torch", "ddp"), "fsdp": ("torch", "fsdp")}
ACCUMULATION = 2  # micro-batches per step: the first accumulates under no_sync, the last communicates
# hidden 2048 x 20 layers: 1.01B parameters over the chess vocabulary; 16 bytes each (fp32 masters
# and AdamW) is 16 GB, so the activations of 8 x 512 tokens and DDP's buckets fit in 80 GB too.
SIZES = {"gpu": dict(hidden_size=2048, num_layers=20, num_heads=16, batch=8, seq=512, warmup=3, steps=10),
         "smoke": dict(hidden_size=64, num_layers=2, num_heads=2, batch=2, seq=32, warmup=1, steps=3)}
CODELLAMA = Path(__file__).resolve().parent.parent / "hf" / "configs" / "codellama-7b"
BIG_GPU = 120e9  # bytes: CodeLlama-7b with FSDP on one GPU needs about 108 GB of model states alone
PHASES = (f"forward + backward ({ACCUMULATION} micro-batches)", "clip_grad_norm_", "optimizer step")


def build(impl: str, strategy_name: str, checkpointing: bool, source: str, env):
    """(strategy, model, optimizer) as `finetune.py` builds them. A folder without weights
    (CodeLlama-7b's config) is built from its config with random weights, on the device."""
    from minidist.parallel.options import ParallelOptions
    from minidist.parallel.strategy import get_strategy

    options = ParallelOptions(strategy=strategy_name, impl=impl, mixed_precision="bf16",
                              gradient_checkpointing=checkpointing)
    strategy = get_strategy(options, env)
    if (Path(source) / "model.safetensors").exists():
        model = strategy.load_model(source)
    else:  # initialising 7B parameters takes minutes on a CPU and seconds on a GPU
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device(env.device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch.float32)
    if checkpointing:
        strategy.checkpoint_activations(model)
    model = strategy.wrap(model)
    model.train()  # transformers recomputes layers only in training mode
    return strategy, model, strategy.build_optimizer(model, lr=1e-5, weight_decay=0.0)


def random_batches(vocab_size: int, batch: int, seq: int, device, seed: int = 0) -> list[dict]:
    """ACCUMULATION micro-batches of random tokens, every position a target (no padding)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(ACCUMULATION):
        ids = torch.randint(vocab_size, (batch, seq), generator=generator)
        batches.append({"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
                        "labels": ids.to(device)})
    return batches


def run_setup(impl, strategy_name, checkpointing, source, sizes, env, shape, profile_to=None) -> dict:
    """Build one setup, time it, measure its peak, and, if asked, profile one step into `profile_to`."""
    from minidist.step import train_step
    from minidist.memory import estimator
    from minidist.memory.measure import step_peak
    from minidist.runtime.metrics import flops_per_token, peak_flops
    from torch.profiler import record_function  # names the phases in the trace; nearly free otherwise

    batch, seq = sizes["batch"], sizes["seq"]
    row = {"model": shape.name, "impl": impl, "strategy": strategy_name, "checkpointing": checkpointing}
    setup = estimator.setup(strategy=strategy_name, impl=impl, gradient_checkpointing=checkpointing, world_size=1,
                            batch_size_per_device=batch, max_seq_length=seq, padded=False,
                            gradient_accumulation_steps=ACCUMULATION, backend="nccl" if env.device.type == "cuda" else "gloo")
    row["estimate"] = estimator.estimate(shape, setup)["peak"]
    try:
        strategy, model, optimizer = build(impl, strategy_name, checkpointing, source, env)
        batches = random_batches(shape.vocab_size, batch, seq, env.device)
        num_targets = ACCUMULATION * batch * (seq - 1)

        def step():
            with record_function(PHASES[0]):  # the loop's own step (step.py), world size 1
                train_step(model, strategy, batches, num_targets, world_size=1)
            with record_function(PHASES[1]):
                strategy.clip_grad_norm_(model, 1.0)
            with record_function(PHASES[2]):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        time_steps(step, sizes["warmup"])  # the first steps allocate states, buckets and caches
        row["times"] = time_steps(step, sizes["steps"])
        row["peak"] = step_peak(step, model, optimizer, env.device)
        if profile_to:
            timeline.profile(step, env.device, profile_to / "trace_minidist_fsdp.json",
                             profile_to / "timeline_minidist_fsdp.png", PHASES)  # lesson 05's picture
    except torch.OutOfMemoryError:  # a row that says so, and the other setups still run
        row["error"] = "out of memory"
        return row
    row["tokens_per_s"] = ACCUMULATION * batch * seq / statistics.median(row["times"])
    peak = peak_flops(env.device)
    per_token = flops_per_token(shape.num_params, shape.num_layers, shape.hidden_size, seq)
    row["mfu"] = row["tokens_per_s"] * per_token / peak if peak else None
    return row


def free(device) -> None:
    gc.collect()  # let go of the last setup for real: wrapped models sit in reference cycles (hooks)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def table(rows: list[dict]) -> str:
    """The rows as one markdown table (printed, and written to table.md)."""
    unit, scale = ("GB", 1e9) if max(r.get("peak", r["estimate"]) for r in rows) > 1e9 else ("MB", 1e6)
    medians = {(r["model"], r["impl"], r["strategy"], r["checkpointing"]): statistics.median(r["times"])
               for r in rows if "times" in r}
    lines = [f"| model | setup | checkpointing | step (median, min-max) | tokens/s | MFU | peak ({unit}) "
             f"| estimate ({unit}) | peak / estimate | step / torch's |", "|" + " --- |" * 10]
    for r in rows:
        start = f"| {r['model']} | {r['impl']}/{r['strategy']} | {'on' if r['checkpointing'] else 'off'} |"
        if "error" in r:
            lines.append(f"{start} {r['error']} | | | | {r['estimate'] / scale:.2f} | | |")
            continue
        median, reference = statistics.median(r["times"]), REFERENCE[r["strategy"]]
        ref = medians.get((r["model"], *reference, r["checkpointing"]))  # its reference with the same checkpointing
        versus = "reference" if reference == (r["impl"], r["strategy"]) else f"{median / ref:.2f}x" if ref else "-"
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else ""
        lines.append(f"{start} {median * 1e3:.1f} ms ({min(r['times']) * 1e3:.1f}-{max(r['times']) * 1e3:.1f}) "
                     f"| {r['tokens_per_s']:,.0f} | {mfu} | {r['peak'] / scale:.2f} | {r['estimate'] / scale:.2f} "
                     f"| {r['peak'] / r['estimate']:.2f}x | {versus} |")
    return "\n".join(lines)


def codellama(env, sizes, started: float, budget_s: float = 360.0) -> tuple[list[dict], str]:
    """CodeLlama-7b's shapes with FSDP at world size 1, where a GPU can hold them; else why not."""
    from minidist.memory import estimator

    shape = dataclasses.replace(estimator.model_shape(str(CODELLAMA)), name="CodeLlama-7b")
    if env.device.type != "cuda":
        return [], "CodeLlama-7b: skipped (a smoke run on the CPU; it runs on a GPU with at least 120 GB)"
    total = torch.cuda.get_device_properties(env.device).total_memory
    setup = estimator.setup(strategy="fsdp", impl="minidist", gradient_checkpointing=True, max_seq_length=512)
    need = estimator.estimate(shape, setup)["peak"]
    if total < BIG_GPU:
        return [], (f"CodeLlama-7b: skipped (this GPU has {total / 1e9:.0f} GB; FSDP at world size 1 needs "
                    f"about {need / 1e9:.0f} GB by the estimate, so the check asks for at least {BIG_GPU / 1e9:.0f} GB)")
    big = dict(sizes, batch=1, seq=512, warmup=1, steps=3)
    rows = []
    for impl in ("minidist", "torch"):  # PyTorch's too, if the 8 minutes allow
        if impl == "torch" and time.perf_counter() - started > budget_s:
            return rows, "CodeLlama-7b: torch/fsdp skipped (out of time)"
        rows.append(run_setup(impl, "fsdp", True, str(CODELLAMA), big, env, shape))
        free(env.device)
    return rows, f"CodeLlama-7b ({shape.num_params / 1e9:.2f}B): FSDP at world size 1, batch 1 x 512, checkpointing"


def main(args) -> None:
    """Run the check; `__main__.py` has already made sure there is a GPU or `--smoke` was asked."""
    from minidist.hf import models
    from minidist.runtime.distributed import cleanup, init_distributed
    from minidist.memory import estimator
    from transformers.utils import logging as hf_logging

    started = time.perf_counter()
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")  # comm.py's names
    hf_logging.disable_progress_bar()  # twelve loads, twelve bars
    sizes = SIZES["smoke" if args.smoke else "gpu"]
    out = Path(args.out)
    env = init_distributed(device_type="cpu" if args.smoke else "cuda")  # gloo on the CPU, NCCL on cuda:0
    try:
        device_name = (torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else
                       f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)")
        with tempfile.TemporaryDirectory(prefix="minidist-gpu-check-") as folder:
            path = str(models.write_tiny_llama(folder, hidden_size=sizes["hidden_size"], num_layers=sizes["num_layers"],
                                               num_heads=sizes["num_heads"]))
            shape = estimator.model_shape(path)
            size = f"{shape.num_params / 1e9:.2f}B" if shape.num_params >= 1e9 else f"{shape.num_params / 1e6:.1f}M"
            shape = dataclasses.replace(shape, name=f"Llama {size}")
            print(f"GPU check{' (--smoke: on the CPU, tiny sizes)' if args.smoke else ''}: {device_name} | "
                  f"torch {torch.__version__} | {datetime.datetime.now():%Y-%m-%d %H:%M}\n"
                  f"world size 1, {env.backend} on {env.device} | {shape.name} ({shape.num_layers} layers x "
                  f"{shape.hidden_size}, random weights) | batch {sizes['batch']} x {sizes['seq']} tokens x "
                  f"{ACCUMULATION} micro-batches per step | bf16 | {sizes['warmup']} warm-up + {sizes['steps']} "
                  f"timed steps per setup\n", flush=True)
            rows = []
            for checkpointing in (False, True):
                for impl, strategy_name in SETUPS:
                    traced = (impl, strategy_name, checkpointing) == ("minidist", "fsdp", False)
                    print(f"{impl}/{strategy_name}, checkpointing {'on' if checkpointing else 'off'} ...", flush=True)
                    rows.append(run_setup(impl, strategy_name, checkpointing, path, sizes, env, shape,
                                          profile_to=out if traced else None))
                    free(env.device)
            print("with and without --cpu_offload ...", flush=True)  # bench/offload.py: ZeRO-Offload's price
            offloaded = offload.compare(path, sizes, env, shape, random_batches(shape.vocab_size, sizes["batch"],
                                                                               sizes["seq"], env.device), ACCUMULATION)
        big_rows, note = codellama(env, sizes, started)
        text = table(rows + big_rows) + "\n\n" + offloaded
        print(text + "\n\n" + note)
        (out / "table.md").write_text(text + "\n")
        print(f"\nwrote {out / 'table.md'}, {out / 'trace_minidist_fsdp.json'} and {out / 'timeline_minidist_fsdp.png'}"
              f" in {time.perf_counter() - started:.0f} s")
    finally:
        cleanup()
