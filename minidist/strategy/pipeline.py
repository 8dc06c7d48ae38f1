"""The pipeline axis (`--pp_size P`, lesson 12): where cutting the model by depth into P stages
shows in a run, and nothing else.

The mechanism is `parallel/pipeline/`: `stages.py` cuts a stage, `schedules.py` writes GPipe and
1F1B as lists of actions, `executor.py` plays them, `p2p.py` sends what crosses a cut. A run applies
it after the tensor-parallel cut (by hand; PyTorch's order is the stage first) and before the
data-parallel wrapper goes around the stage (`Strategy.wrap`), over the stage's data-parallel
ranks. Then five things differ, each a method here:

1. **The model is a stage** (`cut`): its layers, the embedding on the first, the final norm, head
   and loss on the last. The other stages' layers are dropped before anything moves to the GPU.
2. **The step runs a schedule** (`schedule`: a `Pipeline`, which `step.train_step` hands the
   micro-batches to). Its backwards reduce gradients over the data-parallel ranks once, after the
   last micro-batch (the strategy's `no_sync` around the others). With `--impl torch` PyTorch's own
   schedules run the same stage (`reference.py`). The loss lives on the last stage; it is summed over
   the pipeline (zeros elsewhere) so that every rank returns the step's loss.
3. **Clipping sums over the stages** (`norm_groups`): each holds different parameters.
4. **The whole model is the stages joined** (`join_weights`, and a checkpoint's link of the chain:
   `form`, `state/pipeline.py`), and the model to save is built from the config (`model_to_save`).
5. **Evaluation generates through the stages** (`continue_fn`, `generate.py`): no rank holds the
   whole model.
"""

import torch
import torch.distributed as dist

from minidist.parallel import comm
from minidist.parallel.pipeline import executor, schedules
from minidist.parallel.pipeline.stages import Stage
from minidist.strategy.axis import Axis
from minidist.strategy.state.pipeline import PipelineForm, join_stages


class Pipeline:
    """The step of a pipeline: `step(micro_batches, num_targets)` runs the schedule over them on
    `module` (the stage, or the data-parallel wrapper around it) and returns the summed loss of this
    data-parallel rank's micro-batches, on every stage. `no_sync` (a zero-argument callable giving a
    context) holds the backwards that must not reduce gradients yet; `dtype` and `device` are those
    of what crosses a cut (the executor's receive buffers)."""

    def __init__(self, stage: Stage, module, mesh, schedule: str, no_sync=None, dtype=None, device=None,
                 impl: str = "minidist"):
        self.stage, self.mesh, self.schedule, self.impl = stage, mesh, schedule, impl
        self.executor = executor.Executor(stage, group=mesh.pp_group, dp_size=mesh.dp_size, no_sync=no_sync,
                                          module=module, dtype=dtype, device=device)
        self.executor.synchronize = False  # no wait for the GPU at each action: the timeline is not read here
        self.torch_executor = None  # --impl torch: PyTorch's, built for the step's number of micro-batches

    def step(self, micro_batches: list[dict], num_targets: int) -> torch.Tensor:
        if self.impl == "torch":
            if self.torch_executor is None:
                from minidist.parallel.pipeline.reference import TorchExecutor

                self.torch_executor = TorchExecutor(self.stage, self.schedule, len(micro_batches),
                                                    self.mesh.pp_group, self.mesh.dp_size, self.executor.dtype)
            loss_sum = self.torch_executor.step(micro_batches, num_targets)
        else:
            table = schedules.table(self.schedule, len(micro_batches), self.stage.pp)
            loss_sum = self.executor.step(table, micro_batches, num_targets)
        if loss_sum is None:  # not the last stage: it adds nothing to the sum below
            loss_sum = torch.zeros((), device=micro_batches[0]["input_ids"].device, dtype=torch.float32)
        loss_sum = loss_sum.float().to(comm.collective_device(loss_sum, self.mesh.pp_group))
        dist.all_reduce(loss_sum, group=self.mesh.pp_group)  # one number: not counted in the step's bytes
        return loss_sum


class PipelineAxis(Axis):
    """The stages by hand, or PyTorch's schedules on the same stage (`--impl torch`). What it makes
    when it cuts (`stage`, and the dtype of what crosses a cut) it keeps, for the schedule,
    generation and saving."""

    name = "pipeline"
    holds_parts = True  # each stage's ranks hold another part of the model

    def __init__(self, options, env, mesh):
        super().__init__(options, env, mesh)
        self.size, self.group = mesh.pp_size, mesh.pp_group
        self.stage: Stage | None = None
        self.pipeline: Pipeline | None = None
        self.form = PipelineForm()

    def describe(self) -> str:
        return f" x pipeline {self.size} ({self.options.value('pp_schedule')})"

    @staticmethod
    def check_model(options, meta_model) -> None:
        Stage(meta_model, 0, options.pp_size)  # refuses what cannot be cut: a layer each at least, untied embeddings

    def check_packing(self, varlen: bool) -> None:
        if varlen and self.options.impl == "torch":
            raise ValueError("--pack with flash-attention and PyTorch's pipeline has not been built: its stages cut one "
                             "batch into equal micro-batches by rows, and varlen's are one row each; use --impl minidist")

    def cut(self, model, strategy=None):
        """This rank's stage of `model` (a Hugging Face Llama, maybe already cut by tensor
        parallelism); the rest of the model goes with the caller's reference to it."""
        stage = Stage(model, self.mesh.pp_rank, self.size)
        stage.loss_sum = strategy.cross_entropy_sum  # the last stage's loss (from the vocabulary's slices under tp)
        stage.autocast = strategy.autocast  # DDP's mixed precision: fp32 weights, bf16 matmuls
        # What crosses a cut: the residual stream, in the weights' dtype (fp32 under autocast, whose
        # sums with the fp32 residual stay fp32), or bf16 where the weights themselves compute in it.
        self.dtype = (torch.bfloat16 if self.options.mixed_precision == "bf16" and not strategy.autocast_weights
                      else next(stage.parameters()).dtype)
        self.stage = stage
        self.form.cut = strategy.cut_names()  # a full checkpoint's load slices too, under tp
        return stage

    def schedule(self, strategy, model) -> "Pipeline":
        """The step's schedule over this stage (`model`: the data-parallel wrapper around it), built once."""
        if self.pipeline is None:
            self.pipeline = Pipeline(self.stage, model, self.mesh, self.options.value("pp_schedule"),
                                     no_sync=lambda: strategy.no_sync(model), dtype=self.dtype,
                                     device=self.env.device, impl=self.options.impl)
        return self.pipeline

    def continue_fn(self, ready=None):
        from minidist.parallel.pipeline.generate import continue_fn

        return continue_fn(self.stage, self.group, self.dtype)

    def norm_groups(self) -> list:
        return [self.group]

    def model_to_save(self, name_or_path: str | None = None):
        """The whole model built on the meta device (its config and class, no memory), from
        `name_or_path` or else the folder the stage's model was loaded from: no rank holds it."""
        from minidist.hf import models

        return models.build_on_meta(name_or_path or self.stage.config.name_or_path)

    def join_weights(self, weights: dict | None) -> dict | None:
        return join_stages(weights, self.mesh)
