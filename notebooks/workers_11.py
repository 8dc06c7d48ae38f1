"""Worker functions for lesson 11 (tensor parallelism), run in every rank by `minidist.runtime.launch.launch`.

They live in a `.py` file because `launch` starts fresh processes that import the worker by name;
a function defined in a notebook cell cannot be imported. Nothing here re-implements minidist:
`linears` cuts two `nn.Linear`s with `parallel/tensor/linear.py`, and `steps` picks the strategy
with `get_strategy(ParallelOptions(..., tp_size=...))`, which cuts the Llama with
`tensor/llama.parallelize_llama`, and steps it with the training loop's own `train_step`, as
`minidist.finetune.train` does. It only *watches*: the bytes `comm.counter` saw sent, the shapes of
the micro-batches (for the formula of `tensor/traffic.py`) and the whole step's peak of live
tensors (`minidist.memory.measure.step_peak`). `lesson` runs the real training script too
(`training.run_each`), so that one launch of N ranks does everything the notebook needs of N.
"""

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
import training
from torch import nn

from minidist import batches
from minidist.chess import jsonl
from minidist.chess.games import bundled_games
from minidist.hf import models
from minidist.memory import measure
from minidist.parallel import comm
from minidist.strategy.options import ParallelOptions
from minidist.strategy import get_strategy
from minidist.parallel.tensor import ops
from minidist.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear
from minidist.runtime.distributed import get_env
from minidist.step import assemble_micro_batches, train_step


def _quiet() -> None:
    """No loading bar per rank, nor torch's notice (every rank) that comm.py's collectives have newer names."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def linears(batch: int = 4, seq: int = 8, hidden: int = 16, inner: int = 32) -> dict:
    """A two-matrix block, y = gelu(x A^T) B^T, whole here and cut over every rank: A column-parallel,
    B row-parallel, the block entered through f (`ops.copy_to_tp`). float64, the same seed on every
    rank, so each rank can build the whole block itself and compare. Returns this rank's shapes, the
    largest difference of y and of every gradient from the whole block's, and the bytes sent."""
    group = dist.group.WORLD
    n, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    first, second = nn.Linear(hidden, inner).double(), nn.Linear(inner, hidden).double()
    x, upstream = torch.randn(batch, seq, hidden, dtype=torch.float64), torch.randn(batch, seq, hidden, dtype=torch.float64)
    column, row = ColumnParallelLinear(first, group), RowParallelLinear(second, group)

    whole_x, cut_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_whole = second(F.gelu(first(whole_x)))
    (y_whole * upstream).sum().backward()
    comm.counter.reset()
    hidden_cut = F.gelu(column(ops.copy_to_tp(cut_x, group)))  # this rank's inner/n features: no communication
    y_cut = row(hidden_cut)  # partial sums, added up by g: an all-reduce
    forward_bytes = comm.counter.take()
    (y_cut * upstream).sum().backward()  # f's backward: the all-reduce of x's gradient
    backward_bytes = comm.counter.take()

    def off(mine, whole):
        return (mine - whole).abs().max().item()

    mine_a, mine_b = first.weight.grad.chunk(n, 0)[rank], second.weight.grad.chunk(n, 1)[rank]
    return {"shapes": {"column weight": tuple(column.weight.shape), "column output": tuple(hidden_cut.shape),
                       "row weight": tuple(row.weight.shape), "row output": tuple(y_cut.shape)},
            "off": {"y": off(y_cut, y_whole), "x.grad": off(cut_x.grad, whole_x.grad),
                    "A.grad (slice)": off(column.weight.grad, mine_a), "B.grad (slice)": off(row.weight.grad, mine_b),
                    "B.bias.grad": off(row.bias.grad, second.bias.grad)},
            "bytes": {"forward": forward_bytes, "backward": backward_bytes},
            "activation bytes": batch * seq * hidden * 8}


def _train(strategy, model_dir: str, data: dict, num_steps: int, lr: float) -> dict:
    """`num_steps` steps of the loop's own calls on one strategy's model; what `steps` returns per variant."""
    env = get_env()
    model = strategy.wrap(strategy.load_model(model_dir))  # cut over tp (the tensor axis), then DDP over 1 rank
    model.train()  # as the loop does: from_pretrained hands back eval mode, where sequence parallelism steps aside
    optimizer = strategy.build_optimizer(model, lr)
    strategy.take_comm_bytes()  # count from here: wrapping is not a step's traffic
    losses, sent, shapes, peak = [], [], [], None
    for step in range(num_steps):
        micro, num_targets = assemble_micro_batches(data["sampler"], data["sequences"], step, 0, 1, data["batch"],
                                                    data["pad"], env.device, strategy.sequence_multiple)
        done = []

        def one_step(micro=micro, num_targets=num_targets, done=done):
            done.append(train_step(model, strategy, micro, num_targets, 1))
            strategy.clip_grad_norm_(model, 1.0)
            optimizer.step()

        if step == num_steps - 1:  # AdamW's moments exist from the first step on: measure the last
            peak = measure.step_peak(one_step, model, optimizer, env.device)
        else:
            one_step()
        optimizer.zero_grad(set_to_none=True)
        sent.append(strategy.take_comm_bytes())  # this step's bytes only
        losses.append(done[0].item() / num_targets)  # the same on every tensor-parallel rank
        shapes.append([tuple(b["input_ids"].shape) for b in micro])
    return {"losses": losses, "sent": sent, "shapes": shapes, "peak": peak, "config": strategy.unwrap(model).config}


def steps(model_dir: str, sequence_parallel_variants, num_steps: int = 2, batch: int = 4, seq_len: int = 64,
          lr: float = 1e-3) -> dict:
    """The Llama cut over every rank (tp = world size, one data-parallel rank: every rank sees the
    whole batch), `num_steps` steps of the loop's `train_step`, clipping and AdamW, once per value of
    `sequence_parallel_variants` (on one rank: tp 1, the single-process reference). By variant:
    the loss of each step, the bytes sent in each step, the micro-batches' (b, s) as the model saw
    them, and the last step's whole peak of live tensors on this rank (`measure.step_peak`)."""
    _quiet()
    env = get_env()
    tokenizer = models.load_tokenizer(model_dir)
    sequences = batches.tokenize_games(jsonl.load_games(bundled_games("train")), tokenizer, seq_len)
    data = {"sequences": sequences, "batch": batch, "pad": tokenizer.pad_token_id,
            "sampler": batches.GlobalBatchSampler(len(sequences), batch, seed=0)}  # one data-parallel rank: all of it
    results = {}
    for sequence_parallel in sequence_parallel_variants:
        options = ParallelOptions(strategy="ddp", impl="minidist", tp_size=env.world_size,
                                  sequence_parallel=sequence_parallel)
        results[sequence_parallel] = _train(get_strategy(options, env), model_dir, data, num_steps, lr)
        training.progress(f"  ranks: tp {env.world_size}{', sequence parallel' if sequence_parallel else ''}: "
                          f"{num_steps} steps done")
    return results


def lesson(model_dir: str, sequence_parallel_variants, step_args: dict, common: list[str] | None = None,
           runs: dict | None = None) -> dict:
    """One launch for everything the notebook asks of these N ranks: the two linears (N > 1), the
    Llama's `steps`, and (if given) the training script's `runs` (`training.run_each`)."""
    training.share_cores()
    out = {"steps": steps(model_dir, sequence_parallel_variants, **step_args)}
    if dist.get_world_size() > 1:
        out["linears"] = linears()
    if runs:
        out["runs"] = training.run_each(common, runs)
    return out
