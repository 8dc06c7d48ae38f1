"""PyTorch's own pipeline beside the hand-written one: the same stages run by
`torch.distributed.pipelining`'s `ScheduleGPipe` and `Schedule1F1B`, as the reference the lesson
and the tests compare `executor.py` with.

Both cut the model the same way: PyTorch's manual `PipelineStage` is built around the very
`stages.Stage` the hand-written executor runs (`stages.balance` chose its layers), so the two
differ only in how the micro-batches are scheduled and sent. The loss is the executor's too: the
last stage's summed token loss, scaled in PyTorch's `loss_fn` by the data-parallel size over the
global batch's target count (`step.py`'s module doc says why a sum over the global count), and
the micro-batches are the loop's gradient-accumulation steps.

**What crosses, and in which argument.** PyTorch's stage calls its module as
`module(*args, **kwargs)` and treats the two differently:

- the positional arguments are what crosses a cut. Stage 0 gets them from the caller (its token
  ids, which it embeds); every other stage gets them from the stage before, in a buffer PyTorch
  allocated from the shape it was told, and sends their gradient back. So the only positional
  argument is the token ids on stage 0 and the hidden states after it, as in `p2p.py`.
- the keyword arguments never cross: each rank hands its own copy of the micro-batch's attention
  mask and labels to its own stage (every stage reads the same micro-batches, `stages.py`), and
  PyTorch gives them to the module as they are. The last stage computes its loss from its labels.

`stages.Stage.forward` takes that call as well as the hand-written executor's `(hidden, batch)`,
so PyTorch's stage is built around the `Stage` itself.

**The stage itself, for FSDP2's sake.** Under `--impl torch --strategy fsdp` the stage *is* FSDP2's
module (`fully_shard` changes its class in place), and PyTorch's stage checks for that
(`isinstance(submod, FSDPModule)`): it runs every micro-batch's backward with gradient sync off and
resharding after backward off (`backward_maybe_with_nosync`), and after the last one calls FSDP2's
post-backward itself (`perform_reduce_grad`): one reduce-scatter per unit per step, whatever the
number of micro-batches. Handed a module around the stage, it would see no FSDP2 module, and FSDP2
would reduce-scatter after every micro-batch's backward: m times the bytes
(`tests/parallel/test_pipeline_reduce_scatters.py` counts them, for both FSDPs). The price is
PyTorch's choice too: a stage's units stay gathered from their first backward to the step's end.

PyTorch's schedule also wants a `target` per micro-batch on the last stage, to pass to `loss_fn`;
the labels go there too, but `loss_fn` does not need them: the stage has already summed the loss.

**Shapes told, not inferred.** Given an example input and output (on the meta device: no memory),
a `PipelineStage` is "static": it skips the dry run by which it would otherwise infer the shapes
(a forward and a backward on the first micro-batch's shapes, and a pickled shape message per cut). Every
rank knows the shapes from its own micro-batches, as the hand-written receive does. Before its
first step the stages still vote, one int32 forward and one back per cut, on whether every stage
was told its shapes. (Untold, each cut also carries a pickled shape message each way, an int64 size
then the pickle, 166 bytes forward here; and the last stage's dry run calls `loss_fn` on empty,
uninitialised activations, which `loss_fn` below would add to the step's loss. Both were seen by
running the tests with the shapes left out: the losses came out wrong, one of them NaN.)

**Fixed shapes per step.** A `PipelineStage` allocates its receive buffers once, one per
micro-batch (activations and gradients), at the shape it was told: the micro-batches of a step
must all have it. The loop collates each micro-batch to its own longest sequence, so this executor
right-pads every micro-batch of a step to the step's longest (attention mask 0, labels -100: no
loss, no gradient, and the real tokens' positions unchanged), and builds a new stage and schedule
when that shape changes from the last step's (and so votes again). Packed micro-batches (`--pack`),
whose numbers of rows differ, also get rows of padding, and their mask is made again from the
padded document ids (`_padded_packed`).

**1F1B needs m >= p in PyTorch.** `Schedule1F1B` refuses fewer micro-batches than stages, where
the hand-written table caps its warm-up (`schedules.py`); with m < p its first stages run every
forward before any backward anyway, so here "1f1b" with m < p runs `ScheduleGPipe`, which computes
the same gradients. `schedule_class` says which ran.

**Not counted by `comm.counter`.** PyTorch sends with its own `isend` / `batch_isend_irecv`, not
through `p2p.py`, so the bytes the hand-written pipeline counts are not counted here; the tests
count them by wrapping `torch.distributed.isend`: the same activations and gradients as by hand,
plus the vote.

**Under tensor parallelism too** (`--impl torch --strategy fsdp --pp_size P --tp_size T`, the 3-D
mesh of `mesh.py`), the loop composes PyTorch's three as torchtitan does: the model cut into stages
first, then each stage's layers over its tensor-parallel ranks (`tensor/reference.py`'s plan, by
`parallelize_module`), then `fully_shard` over its data-parallel ranks, and this executor runs the
stage over the pipeline group. Nothing here changes for it: what crosses a cut is still a plain
(rows, tokens, hidden) tensor, whole on every tensor-parallel rank (the row-parallel output projections
and the embedding end in an all-reduce), so the shapes told above still hold; the gradient sent back
is whole too (the block's entry all-reduces it, Megatron's f). The last stage's loss comes from the
logits cut by vocabulary, under `loss_parallel()`, which the strategy holds around the whole schedule
(`strategy/pipeline.Pipeline.step`): the schedule runs the forwards and the backwards inside `step`,
and DTensor's loss needs the context for both (left out, the first forward raised "aten.nll_loss_forward
.default got mixed torch.Tensor and DTensor": seen).

Checked on CPU ranks (gloo) only.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from minidist import packing
from minidist.parallel.pipeline import schedules


class TorchExecutor:
    """Runs one step's micro-batches on `stage` with PyTorch's schedule `schedule_name` ("gpipe" or
    "1f1b"), `m` micro-batches per step; `group`: the pipeline's process group (None: the world), in
    which the stage's rank is its place; `dp_size`: the data-parallel world the loss is scaled by;
    `dtype`: what crosses a cut (default: the parameters' dtype).

    `step(micro_batches, num_targets)` takes what `executor.Executor.step` takes, less the table."""

    # PyTorch's default divides the gradients by m after the step (right for a loss averaged per
    # micro-batch); this loss is already divided by the global batch's target count.
    scale_grads = False

    def __init__(self, stage, schedule_name: str, m: int, group=None, dp_size: int = 1, dtype=None):
        schedules.table(schedule_name, m, stage.pp)  # the hand-written executor's refusals, in its words
        if dist.get_rank(group) != stage.rank or dist.get_world_size(group) != stage.pp:
            raise ValueError(f"stage {stage.rank} of {stage.pp} must run on rank {stage.rank} of a group of "
                             f"{stage.pp}, not rank {dist.get_rank(group)} of {dist.get_world_size(group)}")
        self.stage, self.m, self.group, self.dp_size = stage, m, group, dp_size
        self.module = stage  # FSDP2's module itself, where FSDP2 shards it (module doc)
        use_1f1b = schedule_name == "1f1b" and m >= stage.pp  # PyTorch refuses 1F1B with m < p (module doc)
        self.schedule_class = Schedule1F1B if use_1f1b else ScheduleGPipe
        parameter = next(stage.parameters())
        # What crosses a cut has the compute dtype (`dtype`: bf16 under FSDP2's mixed precision, whose
        # parameters stay fp32); told the parameters' dtype instead, PyTorch's fp32 receive buffers
        # would take bf16 activations, and the loop's first bf16 step came out NaN.
        self.dtype, self.device = dtype or parameter.dtype, parameter.device
        self.shape, self.schedule = None, None

    def step(self, micro_batches: list[dict], num_targets: int):
        """Forward and backward of the step's micro-batches by PyTorch's schedule; return the step's
        summed loss (not scaled) on the last stage, None on the others."""
        if len(micro_batches) != self.m:
            raise ValueError(f"this pipeline was built for {self.m} micro-batches per step, not {len(micro_batches)}")
        batch = padded(micro_batches)
        self.build(batch["input_ids"].shape)
        self.num_targets, self.loss_sum = num_targets, None
        inputs = (batch["input_ids"],) if self.stage.is_first else ()
        target = batch["labels"] if self.stage.is_last else None
        # PyTorch cuts the concatenated batch back into the m micro-batches (equal rows: the same cut).
        packed = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}  # `--pack`'s rows
        self.schedule.step(*inputs, target=target, return_outputs=False, attention_mask=batch["attention_mask"],
                           labels=batch["labels"], **packed)
        return self.loss_sum

    def loss_fn(self, loss_sum: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The last stage's loss for backward, as the executor's: the summed token loss the stage
        returned, times dp_size over the global batch's targets (`target` is not needed: module doc).
        The unscaled sum is kept for `step` to return."""
        self.loss_sum = loss_sum.detach() if self.loss_sum is None else self.loss_sum + loss_sum.detach()
        return loss_sum * self.dp_size / self.num_targets

    def build(self, shape: torch.Size) -> None:
        """A stage and a schedule told the shapes of micro-batches cut from a batch of `shape`
        (rows, tokens), unless the last step's were the same (module doc: fixed shapes)."""
        if shape == self.shape:
            return
        rows, tokens = shape[0] // self.m, shape[1]
        hidden = torch.empty(rows, tokens, self.stage.config.hidden_size, dtype=self.dtype, device="meta",
                             requires_grad=True)  # requires_grad: a gradient comes back for it
        ids = torch.empty(rows, tokens, dtype=torch.long, device="meta")
        loss = torch.empty((), dtype=torch.promote_types(self.dtype, torch.float32), device="meta", requires_grad=True)
        pipeline_stage = PipelineStage(self.module, self.stage.rank, self.stage.pp, self.device,
                                       input_args=ids if self.stage.is_first else hidden,
                                       output_args=loss if self.stage.is_last else hidden, group=self.group)
        self.schedule = self.schedule_class(pipeline_stage, self.m, loss_fn=self.loss_fn, scale_grads=self.scale_grads)
        self.shape = shape


def padded(micro_batches: list[dict]) -> dict:
    """The micro-batches right-padded to the longest and concatenated by rows: PyTorch's stage needs
    one shape for every micro-batch of a step (module doc). Padding adds no loss and no gradient."""
    if "document_ids" in micro_batches[0]:
        return _padded_packed(micro_batches)
    rows = {len(batch["input_ids"]) for batch in micro_batches}
    if len(rows) > 1:
        raise ValueError(f"PyTorch's pipeline needs micro-batches of equal rows, not {sorted(rows)}")
    tokens = max(batch["input_ids"].shape[1] for batch in micro_batches)
    fill = {"input_ids": 0, "attention_mask": 0, "labels": -100}
    return {key: torch.cat([F.pad(batch[key], (0, tokens - batch[key].shape[1]), value=value)
                            for batch in micro_batches])
            for key, value in fill.items()}


def _padded_packed(micro_batches: list[dict]) -> dict:
    """Packed micro-batches (`packing.py`, `--pack`), which hold different numbers of rows, brought
    to one shape: rows of padding added (document 0, labels -100), every row right-padded to the
    longest, then concatenated by rows; the block-diagonal mask is made again from the padded
    document ids, so that each padding position sees itself alone. Padding adds no loss and no gradient."""
    rows = max(len(batch["input_ids"]) for batch in micro_batches)
    tokens = max(batch["input_ids"].shape[1] for batch in micro_batches)
    fill = {"input_ids": 0, "labels": -100, "position_ids": 0, "document_ids": packing.PADDING}
    batch = {key: torch.cat([F.pad(b[key], (0, tokens - b[key].shape[1], 0, rows - len(b[key])), value=value)
                             for b in micro_batches])
             for key, value in fill.items()}
    return {**batch, "attention_mask": packing.document_mask(batch["document_ids"])}
