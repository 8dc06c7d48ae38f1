"""Pipeline parallelism in the training loop (`finetune.py`, `--pp_size P`): what changes, and where.

The loop itself does not change: it assembles this rank's micro-batches, calls `step.train_step`,
clips, steps the optimizer, writes the final model. Under a pipeline five things differ, and the
strategy (`parallel/strategy.py`) asks this module for each:

1. **The model is a stage.** After loading (and, with `--tp_size`, after the layers are cut),
   each rank keeps its stage of the model (`stages.Stage`: its layers, the embedding on the first,
   the final norm, head and loss on the last) and the data-parallel wrapper goes around the stage,
   over the stage's data-parallel ranks (`mesh.py`'s grid). The other stages' layers are dropped
   before anything moves to the GPU.
2. **The step runs a schedule.** The loop's micro-batches (`--gradient_accumulation_steps`) are
   the pipeline's: `Pipeline.step` runs the schedule's table (`--pp_schedule`, `schedules.py`)
   through the executor, whose backwards reduce gradients over the data-parallel ranks once, after
   the last micro-batch (the strategy's `no_sync` around the others, as in `step.train_step`).
   With `--impl torch` PyTorch's own schedules run the same stage (`reference.py`), and FSDP2
   decides itself which backward reduce-scatters.
   The loss lives on the last stage; it is summed over the pipeline (zeros elsewhere) so that
   every rank returns the step's loss, as without a pipeline.
3. **Clipping sums over the stages.** Each stage holds different parameters: the squares of its
   gradients add up over the pipeline's ranks (`norm_groups`), as over FSDP's shards.
4. **The whole model is the stages' parts joined** (`join_stages`): the final model, and a full
   checkpoint (of every strategy here, with --tp_size too), which then loads at any
   pipeline size (`checkpoint.py`: sharded checkpoints too, each stage's shards under the whole
   model's names).
5. **Evaluation generates through the stages** (`generate.py`): no rank holds the whole model.
"""

import torch
import torch.distributed as dist

from minidist.parallel.flat import collective_device
from minidist.parallel.pipeline import executor, schedules
from minidist.parallel.pipeline.stages import Stage


def cut_stage(model, mesh) -> Stage:
    """This rank's stage of `model` (a Hugging Face Llama); the rest of the model can go."""
    return Stage(model, mesh.pp_rank, mesh.pp_size)


class Pipeline:
    """The step of a pipeline: `step(micro_batches, num_targets)` runs the schedule over them on
    `module` (the stage, or the data-parallel wrapper around it) and returns the summed loss of this
    data-parallel rank's micro-batches, on every stage. `no_sync` (a zero-argument callable giving a
    context) holds the backwards that must not reduce gradients yet; `dtype` and `device` are those
    of what crosses a cut (the executor's receive buffers)."""

    def __init__(self, stage: Stage, module, mesh, schedule: str, no_sync=None, dtype=None, device=None,
                 impl: str = "minidist"):
        self.stage, self.mesh, self.schedule, self.impl = stage, mesh, schedule, impl
        self.executor = executor.Executor(stage, group=mesh.pp_group, dp_size=mesh.size, no_sync=no_sync,
                                          module=module, dtype=dtype, device=device)
        self.executor.synchronize = False  # no wait for the GPU at each action: the timeline is not read here
        self.torch_executor = None  # --impl torch: PyTorch's, built for the step's number of micro-batches

    def step(self, micro_batches: list[dict], num_targets: int) -> torch.Tensor:
        if self.impl == "torch":
            if self.torch_executor is None:
                from minidist.parallel.pipeline.reference import TorchExecutor

                self.torch_executor = TorchExecutor(self.stage, self.schedule, len(micro_batches),
                                                    self.mesh.pp_group, self.mesh.size, self.executor.dtype)
            loss_sum = self.torch_executor.step(micro_batches, num_targets)
        else:
            table = schedules.table(self.schedule, len(micro_batches), self.stage.pp)
            loss_sum = self.executor.step(table, micro_batches, num_targets)
        if loss_sum is None:  # not the last stage: it adds nothing to the sum below
            loss_sum = torch.zeros((), device=micro_batches[0]["input_ids"].device, dtype=torch.float32)
        loss_sum = loss_sum.float().to(collective_device(loss_sum, self.mesh.pp_group))
        dist.all_reduce(loss_sum, group=self.mesh.pp_group)  # one number: not counted in the step's bytes
        return loss_sum


def norm_groups(mesh) -> list:
    """The groups over which the squares of a clipped gradient are summed, besides the data- and
    tensor-parallel ones: the pipeline's stages (none without a pipeline)."""
    return [mesh.pp_group] if mesh.pp_group is not None else []


def join_stages(state: dict | None, mesh) -> dict | None:
    """Every stage's weights (`state`, by the whole model's names, on the CPU, held by the stage's
    first data-parallel and tensor-parallel rank; None on the others) joined on rank 0, which
    returns the whole model's; every other rank returns None. Every rank calls it.

    The holders are one pipeline group, the one at data-parallel and tensor-parallel rank 0: the
    later stages send their tensors to its first, one at a time, after their names and shapes.
    Once, outside any training step: not counted in a step's bytes (`dist` directly, not `comm`)."""
    tp_rank = 0 if mesh.tp_group is None else dist.get_rank(mesh.tp_group)
    if mesh.rank != 0 or tp_rank != 0:
        return None
    group, first = mesh.pp_group, dist.get_global_rank(mesh.pp_group, 0)
    shapes = [(name, tuple(t.shape), t.dtype) for name, t in state.items()]
    every = [None] * mesh.pp_size
    dist.gather_object(shapes, every if mesh.pp_rank == 0 else None, dst=first, group=group)
    probe = next(iter(state.values()))
    device = collective_device(probe, group)  # NCCL sends GPU tensors only
    if mesh.pp_rank != 0:
        for tensor in state.values():
            dist.send(tensor.to(device).contiguous(), dst=first, group=group)
        return None
    whole = dict(state)
    for stage in range(1, mesh.pp_size):
        src = dist.get_global_rank(group, stage)
        for name, shape, dtype in every[stage]:
            buffer = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buffer, src=src, group=group)
            whole[name] = buffer.cpu()
    return whole

