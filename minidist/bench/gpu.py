"""The GPU check: every strategy on one GPU, in minutes, against PyTorch's and against the estimate.

    python -m minidist.bench gpu                 # one CUDA GPU: a Llama of about 1B, then CodeLlama-7b's shapes
    python -m minidist.bench gpu --smoke         # the same code on the CPU, tiny sizes, in seconds

CPU runs are blind to what a GPU punishes: a kernel launched per parameter, a copy that waits on
the host, a buffer kept one step too long. This command runs what needs a GPU, once, on a world
of one rank. Each of the six setups (PyTorch's DDP, the hand-written DDP, ZeRO-1, ZeRO-2 and
FSDP, PyTorch's FSDP2), with and without activation checkpointing, is built as `finetune.py`
builds it (`load_model`, `checkpoint_activations`, `wrap`, `build_optimizer`) on a Llama of
1.01B parameters with random weights, and runs the loop's own step: `step.train_step` over two
micro-batches of 16 x 512 random tokens (gradient accumulation 2, the first under `no_sync`:
16,384 tokens per step, enough work to fill an H100 so that its MFU is worth quoting),
`clip_grad_norm_`, the optimizer step. Each row says:

- the step time: the median of a few steps after warm-up, with the fastest and slowest, and
  tokens/s. Each setup runs alone, everything of the last one freed first, so its peak is its
  own; two 1B models with their optimizer states would not fit on one GPU together.
- MFU: the model's training FLOPs per second (`metrics.flops_per_token`: 6P per token, plus
  12 x layers x hidden x sequence for attention; recomputation is not useful work) over the GPU's
  bf16 dense peak (989 TFLOP/s for the H100 SXM by NVIDIA's datasheet, the same for the H200);
  blank where the peak is unknown, as on the CPU.
- the whole step's peak memory (`memory.measure.step_peak`: `max_memory_allocated` on a GPU,
  `LiveTensors` on the CPU) as a ratio to `memory.estimator`'s estimate of the same setup, and
  beside it `max_memory_reserved`, what the caching allocator took from the GPU (`snapshot.py`).
  Neither counts the CUDA context or NCCL's own buffers.
- the step time as a ratio to PyTorch's: DDP, ZeRO-1 and ZeRO-2 by hand to PyTorch's DDP, FSDP
  by hand to FSDP2, with the same checkpointing.

**A row runs where its estimate fits** (`gate.py`): the estimate of its setup, plus a reserve
of 5 GB for what the estimate leaves out (the CUDA context, NCCL, fragmentation; the same room
`python -m minidist.memory --gpu_memory 80GB` leaves an A100 of 85.1e9 bytes), must be at most the
GPU's memory; the offload rows too. A row that does not says so, with both figures. So CodeLlama-7b's real shapes (the
bundled config, random weights made on the GPU, nothing downloaded; FSDP, checkpointing, batch
1 x 512, about 135 GB by the estimate) run on an H200 and are skipped on an H100.

**Blind to NCCL.** At world size 1 the hand-written strategies' collectives are local copies and
PyTorch's go to NCCL with no peer: no row includes communication. One line times an all-gather
and a reduce-scatter of one decoder layer's bf16 weights through NCCL itself in the world of one
(`collectives.world_of_one`): its kernel launch, nothing on a wire. Overlap, bandwidth and
waiting for a slower rank need several GPUs.

A second table (`offload.py`) sets ZeRO-2 and FSDP by hand with `--cpu_offload` beside themselves
without it, timed on the CPU threads a torchrun rank would have (`threads.py`; by default a
capstone rank's, one of 4 on its node, whatever the lent machine's GPU count). The goals
(`gpu_report.py`) close the output.

**Nothing measured is lost.** A lent GPU is held for 10 minutes a call, and a process killed at
that limit keeps nothing it held in memory. So `table.md` is written again after every row, and no
row starts after `--deadline_s` (540 s by default): the rows not run are listed at the end. A row
under way is not cut.

Under `--out` it saves the table (`table.md`), a
`torch.profiler` trace of one hand-written FSDP step (open the JSON in chrome://tracing or
Perfetto) with its timeline as a PNG (`timeline.py`, for lesson 05), and, on a GPU, the same
step's memory snapshot for https://pytorch.org/memory_viz (`snapshot.py`).
"""

import dataclasses
import datetime
import gc
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from minidist.bench import gpu_report, offload, snapshot, timeline
from minidist.bench.gate import RESERVE, gpu_memory, skip_reason
from minidist.bench.strategies import time_steps

SETUPS = [("torch", "ddp"), ("minidist", "ddp"), ("minidist", "zero1"), ("minidist", "zero2"),
          ("minidist", "fsdp"), ("torch", "fsdp")]
ACCUMULATION = 2  # micro-batches per step: the first accumulates under no_sync, the last communicates
# hidden 2048 x 20 layers: 1.01B parameters over the chess vocabulary. 16 x 512 tokens per micro-batch
# is 16,384 per step; the hungriest setup (DDP without checkpointing) is 41 GB by the estimate.
CAPSTONE_RANKS_PER_NODE = 4  # slurm/chess_finetune.sh: 4 GPUs a node, each rank a quarter of its CPUs
# A lent GPU is held for 10 minutes a call: rows not started by then are listed, not run.
DEADLINE_S = 540


class Progress:
    """The rows so far, on disk after every one: `table.md` is written again as each row finishes,
    so that a run stopped at any moment (the device call's limit, a kill) keeps every row it
    measured; and the deadline, looked at before each row starts (a row under way is not cut)."""

    def __init__(self, out: Path, started: float, deadline_s: float):
        self.path, self.started, self.deadline_s = out / "table.md", started, deadline_s
        self.rows, self.not_run = [], []

    def out_of_time(self, what: str) -> bool:
        """True, and `what` noted as not run, once the deadline has passed."""
        if time.perf_counter() - self.started <= self.deadline_s:
            return False
        self.not_run.append(what)
        return True

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        self.path.write_text(f"{gpu_report.table(self.rows)}\n\n(in progress: {len(self.rows)} row(s) after "
                             f"{time.perf_counter() - self.started:.0f} s; the whole report replaces this at the end)\n")
        return row

    def note(self) -> str:
        """The line the report ends with where the deadline stopped the run; empty where it did not."""
        if not self.not_run:
            return ""
        return (f"stopped at its deadline ({self.deadline_s:.0f} s, --deadline_s): not run: {'; '.join(self.not_run)}")


SIZES = {"gpu": {"hidden_size": 2048, "num_layers": 20, "num_heads": 16, "batch": 16, "seq": 512, "warmup": 3,
                "steps": 10},
         "smoke": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "batch": 2, "seq": 32, "warmup": 1, "steps": 3}}
CODELLAMA = Path(__file__).resolve().parent.parent / "hf" / "configs" / "codellama-7b"
PHASES = (f"forward + backward ({ACCUMULATION} micro-batches)", "clip_grad_norm_", "optimizer step")
TRACED = ("minidist", "fsdp", False)  # the setup whose step is profiled and snapshotted
SNAPSHOT = "memory_snapshot_minidist_fsdp.pickle"


def build(impl: str, strategy_name: str, checkpointing: bool, source: str, env):
    """(strategy, model, optimizer) as `finetune.py` builds them. A folder without weights
    (CodeLlama-7b's config) is built from its config with random weights, on the device."""
    from minidist.strategy.options import ParallelOptions
    from minidist.strategy import get_strategy

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


def estimate(impl, strategy_name, checkpointing, sizes, env, shape) -> float:
    """The estimated peak of one setup, as `python -m minidist.memory` prints it for the same flags."""
    from minidist.memory import estimator

    setup = estimator.setup(strategy=strategy_name, impl=impl, gradient_checkpointing=checkpointing, world_size=1,
                            batch_size_per_device=sizes["batch"], max_seq_length=sizes["seq"], padded=False,
                            gradient_accumulation_steps=ACCUMULATION,
                            backend="nccl" if env.device.type == "cuda" else "gloo")
    return estimator.estimate(shape, setup)["peak"]


def run_setup(impl, strategy_name, checkpointing, source, sizes, env, shape, profile_to=None) -> dict:
    """One row: its estimate, then, where that fits the GPU, the setup built and timed, its peaks
    measured, and, if asked, one step profiled and snapshotted into the folder `profile_to`."""
    row = {"model": shape.name, "impl": impl, "strategy": strategy_name, "checkpointing": checkpointing,
           "estimate": estimate(impl, strategy_name, checkpointing, sizes, env, shape)}
    reason = skip_reason(row["estimate"], gpu_memory(env.device))
    if reason:
        print(f"{gpu_report.label(row)}: {reason}", flush=True)
        return {**row, "error": reason}
    try:
        measured = measure(impl, strategy_name, checkpointing, source, sizes, env, shape, profile_to)
    except torch.OutOfMemoryError:  # a row that says so, and the other setups still run
        return {**row, "error": "out of memory"}
    return {**row, **measured}


def measure(impl, strategy_name, checkpointing, source, sizes, env, shape, profile_to=None) -> dict:
    """Build one setup and time it (`run_setup`): its step times, tokens/s, MFU and peaks."""
    # record_function names the phases in the trace; nearly free otherwise
    from torch.profiler import record_function

    from minidist.memory.measure import step_peak
    from minidist.runtime.metrics import flops_per_token, peak_flops
    from minidist.step import train_step

    batch, seq = sizes["batch"], sizes["seq"]
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
    row = {"times": time_steps(step, sizes["steps"])}
    row["peak"] = step_peak(step, model, optimizer, env.device)  # resets the allocator's peaks first
    row["reserved"] = snapshot.reserved_peak(env.device)  # so this is the same step's
    if profile_to:
        timeline.profile(step, env.device, profile_to / "trace_minidist_fsdp.json",
                         profile_to / "timeline_minidist_fsdp.png", PHASES)  # lesson 05's picture
        row["snapshot"] = snapshot.record_step(step, env.device, profile_to / SNAPSHOT)
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


def codellama(env, sizes, progress: Progress) -> tuple[list[dict], str]:
    """CodeLlama-7b's shapes with FSDP at world size 1, by hand then PyTorch's, each where its
    estimate fits the GPU (`run_setup`'s gate) and the deadline allows; on the CPU, its estimate only."""
    from minidist.memory import estimator

    shape = dataclasses.replace(estimator.model_shape(str(CODELLAMA)), name="CodeLlama-7b")
    big = dict(sizes, batch=1, seq=512, warmup=1, steps=3)
    what = f"CodeLlama-7b ({shape.num_params / 1e9:.2f}B): FSDP at world size 1, batch 1 x 512, checkpointing"
    if env.device.type != "cuda":
        need = estimate("minidist", "fsdp", True, big, env, shape)
        return [], (f"{what}: not run (a smoke run on the CPU); estimate {need / 1e9:.1f} GB, so it runs on a GPU "
                    f"of at least {(need + RESERVE) / 1e9:.1f} GB")
    rows = []
    for impl in ("minidist", "torch"):
        if progress.out_of_time(f"{impl}/fsdp CodeLlama-7b"):
            continue
        print(f"{impl}/fsdp, CodeLlama-7b ...", flush=True)
        rows.append(progress.add(run_setup(impl, "fsdp", True, str(CODELLAMA), big, env, shape)))
        free(env.device)
    return rows, what


def nccl_line(shape, env) -> str:
    """What one collective through the backend itself costs at world size 1 (`world_of_one`),
    one decoder layer's weights in bf16, beside the local copy the rows made instead."""
    from minidist.bench.collectives import world_of_one

    t = world_of_one(shape.layer_params)
    return (f"{t['backend']} at world size 1, one decoder layer ({t['bytes'] / 1e6:.1f} MB bf16): all_gather "
            f"{t['all_gather'] * 1e6:.0f} us, reduce_scatter {t['reduce_scatter'] * 1e6:.0f} us, the local copy "
            f"the rows make instead {t['copy'] * 1e6:.0f} us. With no peer nothing crosses a link and no rank waits "
            f"for another: bandwidth, overlap and stragglers need several GPUs (torchrun --nproc_per_node N -m "
            f"minidist.bench allreduce).")


def llama_rows(path, sizes, env, shape, out, progress: Progress) -> list[dict]:
    """The six setups with and without checkpointing, one at a time, on the Llama of `path`, each
    on disk as it finishes and none started after the deadline (`progress`)."""
    rows = []
    for checkpointing in (False, True):
        for impl, strategy_name in SETUPS:
            label = f"{impl}/{strategy_name}, checkpointing {'on' if checkpointing else 'off'}"
            if progress.out_of_time(label):
                continue
            traced = (impl, strategy_name, checkpointing) == TRACED
            print(f"{label} ...", flush=True)
            rows.append(progress.add(run_setup(impl, strategy_name, checkpointing, path, sizes, env, shape,
                                               profile_to=out if traced else None)))
            free(env.device)
    return rows


def offload_ranks_per_node(given: int | None, device: torch.device) -> int:
    """The ranks per node whose CPU threads the offload rows are timed on: `--ranks_per_node`, else
    a capstone rank's share (4 a node) on a GPU, not the lent machine's GPU count, which on a
    one-GPU machine would time offload on every core, four times a rank's; 1 on the CPU (--smoke)."""
    return given or (CAPSTONE_RANKS_PER_NODE if device.type == "cuda" else 1)


def header(args, env, sizes, shape) -> str:
    device = (torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else
              f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)")
    memory = gpu_memory(env.device)
    return (f"GPU check{' (--smoke: on the CPU, tiny sizes)' if args.smoke else ''}: {device}"
            f"{f', {memory / 1e9:.1f} GB' if memory else ''} | torch {torch.__version__} | "
            f"{datetime.datetime.now():%Y-%m-%d %H:%M}\n"
            f"world size 1, {env.backend} on {env.device} | {shape.name} ({shape.num_layers} layers x "
            f"{shape.hidden_size}, random weights) | batch {sizes['batch']} x {sizes['seq']} tokens x "
            f"{ACCUMULATION} micro-batches = {sizes['batch'] * sizes['seq'] * ACCUMULATION:,} tokens per step | bf16 | "
            f"{sizes['warmup']} warm-up + {sizes['steps']} timed steps per setup\n")


def main(args) -> None:
    """Run the check; `__main__.py` has already made sure there is a GPU or `--smoke` was asked."""
    from transformers.utils import logging as hf_logging

    from minidist.hf import models
    from minidist.memory import estimator
    from minidist.runtime.distributed import cleanup, init_distributed

    started = time.perf_counter()
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")  # comm.py's names
    hf_logging.disable_progress_bar()  # twelve loads, twelve bars
    sizes = SIZES["smoke" if args.smoke else "gpu"]
    out = Path(args.out)
    env = init_distributed(device_type="cpu" if args.smoke else "cuda")  # gloo on the CPU, NCCL on cuda:0
    ranks_per_node = offload_ranks_per_node(args.ranks_per_node, env.device)
    try:
        with tempfile.TemporaryDirectory(prefix="minidist-gpu-check-") as folder:
            path = str(models.write_tiny_llama(folder, hidden_size=sizes["hidden_size"], num_layers=sizes["num_layers"],
                                               num_heads=sizes["num_heads"]))
            shape = estimator.model_shape(path)
            size = f"{shape.num_params / 1e9:.2f}B" if shape.num_params >= 1e9 else f"{shape.num_params / 1e6:.1f}M"
            shape = dataclasses.replace(shape, name=f"Llama {size}")
            print(header(args, env, sizes, shape), flush=True)
            progress = Progress(out, started, DEADLINE_S if args.deadline_s is None else args.deadline_s)
            rows = llama_rows(path, sizes, env, shape, out, progress)
            offloaded = "with and without --cpu_offload: not run (the deadline)"
            if not progress.out_of_time("the --cpu_offload rows"):
                print("with and without --cpu_offload ...", flush=True)  # bench/offload.py: ZeRO-Offload's price
                offloaded = offload.compare(path, sizes, env, shape, random_batches(shape.vocab_size, sizes["batch"],
                                            sizes["seq"], env.device), ACCUMULATION, ranks_per_node, os.environ)
        big_rows, note = codellama(env, sizes, progress)
        measured = rows + big_rows
        text = "\n\n".join(part for part in [
            gpu_report.table(measured) if measured else "no row ran before the deadline", note, offloaded,
            nccl_line(shape, env), "Goals:\n" + "\n".join(gpu_report.goals(measured, shape.name)) if measured else "",
            progress.note()] if part)
        print(text)
        (out / "table.md").write_text(text + "\n")
        written = [out / name for name in ("table.md", "trace_minidist_fsdp.json", "timeline_minidist_fsdp.png")
                   if (out / name).exists()]  # the traced row may not have run before the deadline
        snapped = next((r["snapshot"] for r in rows if r.get("snapshot")), None)
        print(f"\nwrote {', '.join(map(str, written))} in {time.perf_counter() - started:.0f} s")
        print(f"memory snapshot of one minidist/fsdp step: {snapped}, open at {snapshot.VIEWER}" if snapped else
              "memory snapshot: none (the CUDA allocator records it; there is none on the CPU)")
    finally:
        cleanup()
