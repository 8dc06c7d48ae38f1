"""Accelerate's FSDP beside minidist's loop: the same tiny Llama, games and steps, two loss curves that must be equal.

`python -m minidist.bench.accelerate_parity` trains a tiny Llama twice on every rank: once through
`minidist.finetune --impl torch --strategy fsdp` (PyTorch's FSDP2 under minidist's loop), once through
`accelerate.Accelerator` with `FullyShardedDataParallelPlugin(fsdp_version=2)`, written as a Trainer-style
loop (`lessons/reference/from_accelerate.md` maps one onto the other). Both take the same global batches
from minidist's sampler, so the losses step by step are a test of everything else: the wrapping, the
loss normalisation, accumulation, clipping and the schedule.

Two ways to run it:

- on one GPU (the GPU check, or by hand): `torchrun --nproc_per_node 1 -m minidist.bench.accelerate_parity`.
  Accelerate sees CUDA and a launched process, and takes its FSDP branch as any user's run would.
- on CPU ranks (the test, the notebook): `--cpu_ranks 2`. Accelerate 1.15 does not run FSDP on CPU
  processes: `AcceleratorState` takes the FSDP branch only for GPU-like distributed types
  (`accelerate/state.py`, the `elif self.distributed_type in [DistributedType.MULTI_GPU, ...]` list
  around line 986, where `MULTI_CPU` is absent). It raises nothing: the plugin is dropped, the state
  stays `MULTI_CPU`, and `prepare` wraps the model in DDP. So on CPU this script records what Accelerate
  chose (`distributed_type_chosen`), then sets the two attributes that branch would have set
  (`distributed_type = FSDP`, `fsdp_plugin`) and lets Accelerate's own FSDP2 preparation
  (`utils/fsdp_utils.py: fsdp2_prepare_model`, `fully_shard` per layer) run on gloo, which PyTorch's
  FSDP2 supports. That override is the one difference from a GPU run, and the report says so.
"""

import argparse
import importlib
import math
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch

from minidist.strategy.options import ADAMW_OPTIONS

STEPS, SEQ, LR, SEED, WARMUP = 4, 48, 3e-3, 3, 2  # tests/loop/test_finetune.py's run


def minidist_argv(model_dir, out, *, steps, lr, batch, accum) -> list[str]:
    """`python -m minidist.finetune`'s flags for the minidist side (PyTorch's FSDP2 under minidist's loop)."""
    return ["--model", str(model_dir), "--impl", "torch", "--strategy", "fsdp", "--max_steps", str(steps),
            "--max_seq_length", str(SEQ), "--learning_rate", str(lr), "--warmup_steps", str(WARMUP),
            "--seed", str(SEED), "--batch_size_per_device", str(batch), "--gradient_accumulation_steps", str(accum),
            "--eval_prefixes", "0", "--no_save", "--output_dir", str(out)]


def fsdp_accelerator():
    """An `Accelerator` with the FSDP plugin as `accelerate config` writes it for a Llama (FSDP2, a unit
    per decoder layer), and the distributed type Accelerate chose before any override (see module doc)."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                            reshard_after_forward=True, state_dict_type="FULL_STATE_DICT")
    # cpu=True is `accelerate launch --cpu`: without it, on a machine with no GPU, Accelerate runs each
    # process alone (DistributedType.NO), with no process group of its own.
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=not torch.cuda.is_available())
    chosen = accelerator.distributed_type
    if chosen == DistributedType.MULTI_CPU:
        # What state.py's FSDP branch sets for a GPU run, and nothing else (fp32: no mixed-precision policy).
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    return accelerator, str(chosen)


def accelerate_run(model_dir, *, steps, lr, batch, accum) -> dict:
    """This rank's side of the Accelerate run: the loop a Trainer user would write, step by step.

    The loss is the Trainer's (`transformers` 5, `Trainer._get_num_items_in_batch` and `compute_loss`):
    the model sums the token losses and divides by `num_items_in_batch`, the target tokens of all the
    step's micro-batches gathered over all ranks; it is then multiplied by the number of processes,
    because FSDP averages gradients over ranks. That is minidist's `loss * world_size / num_targets`
    (`step.train_step`). Micro-batches before the last run under `accelerator.no_sync`, as minidist's."""
    from minidist import batches
    from minidist.chess import jsonl
    from minidist.chess.games import bundled_games
    from minidist.hf import models
    from minidist.step import assemble_micro_batches, lr_schedule

    accelerator, chosen = fsdp_accelerator()
    tokenizer = models.load_tokenizer(model_dir)
    model = models.load_model(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, **ADAMW_OPTIONS)
    # Together, as FSDP2 requires: prepare swaps the optimizer's parameters for the sharded ones.
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    schedule = SimpleNamespace(warmup_steps=WARMUP, max_steps=steps)
    # Not prepared: an `AcceleratedScheduler` steps once per process per call unless `split_batches`.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_schedule(step, schedule.warmup_steps, schedule.max_steps))
    sequences = batches.tokenize_games(jsonl.load_games(bundled_games("train")), tokenizer, SEQ)
    sampler = batches.GlobalBatchSampler(len(sequences), batch * accum * accelerator.num_processes, SEED)
    losses = []
    for step in range(steps):
        micro_batches, _ = assemble_micro_batches(sampler, sequences, step, accelerator.process_index,
                                                  accelerator.num_processes, batch, tokenizer.pad_token_id,
                                                  accelerator.device)
        here = sum(int(b["labels"][:, 1:].ne(-100).sum()) for b in micro_batches)
        num_items_in_batch = accelerator.gather(torch.tensor([here], device=accelerator.device)).sum()
        step_loss = torch.zeros((), device=accelerator.device)
        for i, micro in enumerate(micro_batches):
            with accelerator.no_sync(model) if i < len(micro_batches) - 1 else nullcontext():
                loss = model(**micro, use_cache=False, num_items_in_batch=num_items_in_batch).loss
                accelerator.backward(loss * accelerator.num_processes)
            step_loss += loss.detach()
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(accelerator.reduce(step_loss, "sum").item())
    return {"losses": losses, "distributed_type_chosen": chosen, "wrapped_as": type(model).__name__}


def both_sides(model_dir, out, steps=STEPS, lr=LR, batch=1, accum=2, accelerate_lr=None) -> dict:
    """On this rank: minidist's run, then Accelerate's, in the same process group. `accelerate_lr`
    gives the Accelerate side another learning rate (the test's check that a difference shows)."""
    from minidist import finetune

    ours = finetune.train(finetune.parse_args(minidist_argv(model_dir, out, steps=steps, lr=lr, batch=batch,
                                                                accum=accum)))
    theirs = accelerate_run(model_dir, steps=steps, lr=accelerate_lr or lr, batch=batch, accum=accum)
    return {"minidist": ours["losses"], **theirs}


def compare(result: dict, rtol: float = 1e-5) -> tuple[bool, str]:
    """Whether the two curves are equal within `rtol`, and the lines that show them side by side."""
    lines = [f"Accelerate chose {result['distributed_type_chosen']}; the model was wrapped as {result['wrapped_as']}",
             f"{'step':>4}  {'minidist fsdp (torch)':>22}  {'accelerate fsdp2':>17}  {'rel. diff':>9}"]
    worst = 0.0
    for step, (a, b) in enumerate(zip(result["minidist"], result["losses"]), 1):
        diff = abs(a - b) / abs(a)
        worst = max(worst, diff)
        lines.append(f"{step:>4}  {a:>22.6f}  {b:>17.6f}  {diff:>9.1e}")
    same = len(result["minidist"]) == len(result["losses"]) and worst <= rtol and math.isfinite(worst)
    lines.append(f"largest relative difference {worst:.1e}: {'equal' if same else 'DIFFERENT'} (rtol {rtol:g})")
    return same, "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m minidist.bench.accelerate_parity", description=__doc__.split("\n")[0])
    parser.add_argument("--cpu_ranks", type=int, default=0,
                        help="start this many CPU ranks (gloo) here; 0: this process is a torchrun rank")
    parser.add_argument("--model", default=None, help="a model folder; default: a tiny Llama written to a temporary one")
    args = parser.parse_args(argv)
    from minidist.hf.models import write_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or write_tiny_llama(Path(tmp) / "tiny-llama", hidden_size=64, num_layers=2)
        if args.cpu_ranks:
            from minidist.runtime.launch import launch

            # By its module's name, not __main__'s: each rank imports the function it runs.
            by_name = importlib.import_module("minidist.bench.accelerate_parity").both_sides
            result = launch(by_name, args.cpu_ranks, str(model_dir), Path(tmp) / "run")[0]
        else:
            from minidist.runtime.distributed import get_env

            result = both_sides(str(model_dir), Path(tmp) / "run")
            if not get_env().is_main:
                return
    same, report = compare(result)
    print(report)
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
