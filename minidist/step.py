"""One optimizer step, as lessons 03 and 09 teach it: the token-normalised loss, micro-batches, no_sync.

The loop (`finetune.py`) calls `assemble_micro_batches` and then `train_step` once per optimizer
step, and steps the learning rate by `lr_schedule`; the memory tools (`memory/`), the benchmarks
(`bench/`), the notebooks and the tests call the very same functions, so what they measure is
what trains.

Why the loss is a *sum* divided by the global batch's target count, not a mean per micro-batch:
chess games have different lengths, and averaging per micro-batch would weigh a token in a short
batch more than one in a long batch, differently for every split of the batch across ranks and
accumulation steps. Divided once by the whole global batch's count, every split computes the
same gradient.
"""

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minidist import packing
from minidist.batches import GlobalBatchSampler, collate


def lr_schedule(step: int, warmup_steps: int, max_steps: int) -> float:
    """Linear warm-up over `warmup_steps`, then cosine decay to a tenth of the peak at `max_steps`:
    a multiplier for LambdaLR."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def rescale_peak(scheduler, peak: float) -> float:
    """Give a scheduler another peak learning rate, keeping its shape and its step; return the old peak.

    A LambdaLR's rate is `base_lr x lr_schedule(step)`, and a resumed scheduler brings back the
    `base_lrs` it was saved with: so they are scaled by new / old, and so is each optimizer group's
    current rate (the next step uses it before the scheduler steps again)."""
    old = scheduler.base_lrs[0]
    ratio = peak / old
    scheduler.base_lrs = [base * ratio for base in scheduler.base_lrs]
    for group in scheduler.optimizer.param_groups:
        group["lr"] *= ratio
        if "initial_lr" in group:  # where LambdaLR keeps each group's base rate
            group["initial_lr"] *= ratio
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]  # what get_last_lr reads
    return old


def follow_schedule(scheduler) -> None:
    """Set each optimizer group's rate to what the scheduler's schedule gives at its current step.

    A resumed LambdaLR brings back its step, and the optimizer the rate the *saved* schedule gave
    for the next step; when the schedule itself changed (another `--max_steps`: finetune._resumed),
    the next step must already use the new one, not only the steps after the scheduler next steps."""
    for group, base, multiplier in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * multiplier(scheduler.last_epoch)  # LambdaLR's own rule
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]  # what get_last_lr reads


@dataclass(frozen=True)
class Packing:
    """`--pack`: games packed whole into rows of `max_seq_length` tokens (`packing.py`); `varlen`:
    flash-attention's variable-length path (the rows flattened, no mask), else SDPA with the mask."""
    max_seq_length: int
    varlen: bool = False


def assemble_micro_batches(sampler: GlobalBatchSampler, sequences: list[list[int]], step: int, rank: int,
                           world_size: int, micro_batch_size: int, pad_token_id: int,
                           device: torch.device, multiple: int = 1,
                           pack: Packing | None = None) -> tuple[list[dict], int]:
    """This rank's micro-batches of optimizer step `step`, collated (padded to a multiple of
    `multiple` tokens) and on `device`, and the number of target tokens in the whole global batch:
    what `train_step` takes. `rank` and `world_size` are the data-parallel ones.

    The sampler knows every rank's share of the global batch (`batches.py`), so every rank counts
    the whole batch's targets itself, with no communication: a sequence of n tokens has n - 1
    targets, as position t predicts token t + 1.

    With `pack`, a step's batch is the same global batch of games, dealt out by tokens instead of
    by the sampler's slices (`packing.layout`): the same games and the same target count, so the
    loss, its normalisation and `--resume` do not change; each of the A micro-batches holds packed rows."""
    games = sampler.global_batch(step)
    num_targets = sum(len(sequences[i]) - 1 for i in games)  # every rank can count it
    if pack is None:
        groups = [collate([sequences[i] for i in ids], pad_token_id, multiple)
                  for ids in sampler.micro_batches(step, rank, world_size, micro_batch_size)]
    else:
        accumulation = sampler.accumulation_steps(world_size, micro_batch_size)
        mine = packing.layout([len(sequences[i]) for i in games], world_size, accumulation, pack.max_seq_length)[rank]
        groups = [packing.collate_packed([[sequences[games[k]] for k in row] for row in rows], pad_token_id, multiple)
                  for rows in mine]
        if pack.varlen:
            groups = [packing.flatten_for_varlen(batch) for batch in groups]
    micro_batches = [{name: None if tensor is None else tensor.to(device) for name, tensor in batch.items()}
                     for batch in groups]
    return micro_batches, num_targets


def step_token_counts(sampler: GlobalBatchSampler, sequences: list[list[int]], step: int, world_size: int,
                      micro_batch_size: int, multiple: int = 1, pack: Packing | None = None) -> dict:
    """The real and padded tokens every data-parallel rank computes at step `step`, for the step's
    record (`packing.token_counts`), from the layout alone: no tensor, no communication."""
    games = sampler.global_batch(step)
    if pack is None:
        per_rank = []
        for rank in range(world_size):
            lengths = [[len(sequences[i]) for i in ids]
                       for ids in sampler.micro_batches(step, rank, world_size, micro_batch_size)]
            per_rank.append([(sum(n), len(n) * (-(-max(n) // multiple) * multiple)) for n in lengths])
        return packing.token_counts(per_rank)
    accumulation = sampler.accumulation_steps(world_size, micro_batch_size)
    lengths = [len(sequences[i]) for i in games]
    per_rank = [[(sum(lengths[k] for row in rows for k in row), packing.positions(lengths, [rows], multiple))
                 for rows in rows_by_micro_batch]
                for rows_by_micro_batch in packing.layout(lengths, world_size, accumulation, pack.max_seq_length)]
    return packing.token_counts(per_rank)


def token_loss_sum(model, batch: dict, strategy) -> torch.Tensor:
    """The summed next-token cross-entropy of a micro-batch (not the mean: see module doc)."""
    with strategy.autocast():
        # use_cache=False: a key/value cache only helps generation; in training it is dead memory.
        # Packed rows (`packing.py`) bring their own position ids, from 0 in each game; a padded batch
        # passes none (the model counts 0..s-1), so any model that takes input_ids and a mask will do
        # (the exercises' TinyLM takes no position ids).
        packed = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                       **packed).logits
    # Position t predicts token t+1; padding carries the label -100 and is ignored. The softmax
    # over the vocabulary runs in at least fp32: bf16 logits would round the loss visibly.
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    # Under tensor parallelism the logits are this rank's slice of the vocabulary, and the strategy
    # computes the loss from the slices (`Strategy.cross_entropy_sum`); otherwise `cross_entropy_sum` below.
    return strategy.cross_entropy_sum(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of next-token logits over the whole vocabulary; -100 is ignored."""
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")


def train_step(model, strategy, micro_batches, num_targets: int, world_size: int) -> torch.Tensor:
    """Forward and backward over this rank's micro-batches of one step; return its summed loss."""
    schedule = strategy.schedule(model)
    if schedule is not None:  # lesson 12: the micro-batches stream through the stages by a schedule
        with strategy.loss_context():  # PyTorch's tensor-parallel loss: the schedule runs forwards and backwards
            return schedule.step(micro_batches, num_targets)
    loss_sum = 0.0
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        # Only the last micro-batch communicates; the others just add to the local gradients. (With
        # --accumulate_sharded the strategy's no_sync is a null context: each micro-batch reduce-
        # scatters and keeps only its shard, `strategy/base.Strategy.no_sync`.)
        # The loss's context holds over backward too: PyTorch's tensor-parallel loss needs it there.
        with nullcontext() if last else strategy.no_sync(model), strategy.loss_context():
            loss = token_loss_sum(model, batch, strategy)
            # Strategies average gradients over ranks, so scale by world_size / global target count.
            (loss * world_size / num_targets).backward()
        loss_sum = loss_sum + loss.detach()  # stays on the device: no GPU sync per micro-batch
    return loss_sum
