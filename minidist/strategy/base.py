"""The strategy: one data-parallel choice plus the axes, applied in order, behind the interface the
loop calls.

The training loop (`finetune.py`) picks a strategy by name and implementation (`get_strategy`) and
never asks which one it runs. It calls, in this order:

    strategy.check_model(name)                  # can each axis cut this model? (before loading)
    model = strategy.load_model(name)           # FSDP: the weights read on rank 0 only
    strategy.checkpoint_activations(model)      # with --gradient_checkpointing
    model = strategy.wrap(model)                # each axis cuts, then the data-parallel wrapper
    optimizer = strategy.build_optimizer(model, lr, weight_decay)
    step.train_step(model, strategy, ...)       # strategy.schedule (a pipeline's) or micro-batches under
                                                # strategy.no_sync, strategy.loss_context, strategy.autocast,
                                                # the loss from strategy.cross_entropy_sum
    strategy.clip_grad_norm_(model, max_norm); optimizer.step()
    strategy.take_comm_bytes(split=True)        # the step's bytes, for metrics.jsonl

and `strategy.continue_fn()` to generate for the legal-move rate, `strategy.full_state_dict(model)`
and `strategy.model_to_save(model)` to write the final model, `strategy.get_state_dict` and
`set_state_dict` for checkpoints (`checkpoint/state.py`), and `strategy.mesh`, `sequence_multiple`,
`options` and `env` to read the layout.

**How a run is composed.** `Strategy` holds the axes the options ask for (`axes`: tensor, then
pipeline by hand; PyTorch's order is the pipeline's stage first, then its slices, as torchtitan
applies them), each built with the mesh and owning what it learns when it cuts. The subclasses in
`data.py` are the data-parallel strategies, and each says only how it loads, wraps, steps and saves
a model: none of them knows which axes exist. Where an axis shows (the loss, clipping, the whole
weights, the checkpoint's form), this class asks the axes in order.

Both implementations *average* gradients over ranks, as PyTorch's DDP does. The loop divides
each rank's summed token loss by the token count of the whole global batch and multiplies by
the world size, so the average of the ranks' gradients is the gradient of the global batch.
"""

import math
from contextlib import ExitStack, contextmanager, nullcontext

import torch
from torch import nn

from minidist.parallel import across_nodes, comm, precision
from minidist.parallel.mesh import Mesh, build_mesh
from minidist.step import cross_entropy_sum
from minidist.strategy import clip, state
from minidist.strategy.options import ADAMW_OPTIONS, ParallelOptions


class Strategy:
    """The interface, and what every data-parallel strategy shares (`data.py` has the strategies)."""

    autocast_weights = False  # True: fp32 weights, bf16 matmuls under autocast (DDP; precision.py)
    form_kind = "by_parameter"  # its checkpoint form (`state/data.py`): "by_parameter" or "flat"
    torch_order = False  # PyTorch's implementations cut the stage first, then its slices

    def __init__(self, options: ParallelOptions, env, mesh: Mesh | None = None):
        self.options, self.env, self._mesh = options, env, mesh
        self.mp = precision.policy(options.mixed_precision, options.value("reduce_dtype"))
        self._axes = None

    # ------------------------------------------------------------------ the layout
    @property
    def mesh(self) -> Mesh:
        """The process groups this strategy communicates over (built when first read, after the
        process group exists); HSDP's shard groups hold `--hsdp_shard_size` ranks, by default the
        ranks of a node."""
        if self._mesh is None:
            hybrid = self.options.strategy == "hsdp"
            self._mesh = build_mesh(self.options.hsdp_shard_size or self.env.local_world_size if hybrid else None,
                                    self.options.tp_size, self.options.pp_size, self.env.device.type)
            across_nodes.split.tensor_group = self._mesh.tp_group  # metrics.jsonl: tensor parallelism's bytes apart
            across_nodes.split.ranks_per_node = self.env.local_world_size
        return self._mesh

    def axis_classes(self) -> list:
        """The classes of this run's axes, in the order they cut the model, from the options alone."""
        from minidist.strategy import pipeline, tensor

        kinds = []
        if self.options.tp_size > 1:
            kinds.append(tensor.TorchTensorAxis if self.options.impl == "torch" else tensor.TensorAxis)
        if self.options.pp_size > 1:
            kinds.append(pipeline.PipelineAxis)
        return kinds[::-1] if self.torch_order else kinds

    @property
    def axes(self) -> list:
        """The axes of this run, in the order they cut the model (none: data parallelism alone),
        each built with the mesh (the process groups then exist)."""
        if self._axes is None:
            self._axes = [kind(self.options, self.env, self.mesh) for kind in self.axis_classes()]
        return self._axes

    def axis(self, name: str):
        """This run's axis of that name (`tensor`, `pipeline`), or None."""
        return next((axis for axis in self.axes if axis.name == name), None)

    @property
    def one_holder(self) -> bool:
        """True where every rank holds a piece of the same whole (no axis cut the model into parts
        that different ranks hold whole): rank 0 then holds everything gathered."""
        return not any(axis.holds_parts for axis in self.axes)

    @property
    def holder(self) -> bool:
        """Whether this rank is the first of the ranks holding its part of the model: data-parallel
        rank 0, and the first of its tensor-parallel group (each stage of a pipeline has one)."""
        return self.mesh.dp_rank == 0 and self.mesh.tp_rank == 0

    def describe(self) -> str:
        """The first log line's words for the axes ("" without any), in the mesh's order, innermost first."""
        return "".join(axis.describe() for axis in (self.axes[::-1] if self.torch_order else self.axes))

    def cut_names(self) -> dict | None:
        """The parameters a hand-written tensor axis sliced (name -> dim, real size), or None."""
        tensor = self.axis("tensor")
        return getattr(tensor, "split", None)

    # ------------------------------------------------------------------ the model
    def check_model(self, name_or_path: str) -> None:
        """Raise ValueError, in one sentence, if an axis cannot cut the model (its heads, its MLP, its
        layers), before anything is loaded: built on the meta device."""
        from minidist.hf import models

        for kind in self.axis_classes():  # before the mesh: the model's own limits are told first
            kind.check_model(self.options, models.build_on_meta(name_or_path))

    def check_packing(self, varlen: bool) -> None:
        """Raise ValueError, in one sentence, if an axis cannot take `--pack`'s micro-batches
        (`varlen`: flash-attention's rows flattened into one, `packing.flatten_for_varlen`)."""
        for axis in self.axes:
            axis.check_packing(varlen)

    def load_model(self, name_or_path: str) -> nn.Module:
        """Every rank loads the whole model (in fp32, on the CPU); `wrap` moves or shards it."""
        from minidist.hf import models

        return models.load_model(name_or_path)

    def checkpoint_activations(self, model: nn.Module) -> None:
        """Recompute each decoder layer in backward (`--gradient_checkpointing`): by hand
        (`recompute.py`) for minidist, transformers' own for the PyTorch reference."""
        if self.options.impl == "minidist":
            from minidist.parallel.recompute import checkpoint_layers

            checkpoint_layers(model, wrap_policy_classes(model))
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def wrap(self, model: nn.Module) -> nn.Module:
        """Each axis cuts the model, in order, then the data-parallel wrapper goes around this rank's part."""
        self.before_cuts(model)
        for axis in self.axes:
            model = axis.cut(model, self)
        return self.wrap_data_parallel(model)

    def before_cuts(self, model: nn.Module) -> None:
        """What a data-parallel strategy takes from the loaded model before any axis cuts it (nothing)."""

    def wrap_data_parallel(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The Hugging Face model (or stage) inside the wrapper (for `save_pretrained`, `config`)."""
        return model.module

    def build_optimizer(self, model, lr, weight_decay=0.0) -> torch.optim.Optimizer:
        # Frozen parameters get no optimizer state at all: that is where LoRA saves its memory.
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **ADAMW_OPTIONS)

    # ------------------------------------------------------------------ the step
    @property
    def sequence_multiple(self) -> int:
        """Batches are padded to a multiple of this many tokens (sequence parallelism cuts the
        sequence into --tp_size equal chunks)."""
        return math.prod(axis.sequence_multiple for axis in self.axes)

    def schedule(self, model):
        """The pipeline's schedule, which takes the step's micro-batches (`step.train_step`); None
        without a pipeline: the micro-batches run one after the other."""
        pipeline = self.axis("pipeline")
        return None if pipeline is None else pipeline.schedule(self, model)

    def cross_entropy_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed cross-entropy of next-token `logits` against `targets` (-100: ignored); from the
        vocabulary's slices where an axis cut the logits (`tensor/vocab.py`)."""
        for axis in self.axes:
            if axis.cross_entropy_sum is not None:
                return axis.cross_entropy_sum(logits, targets)
        return cross_entropy_sum(logits, targets)

    @contextmanager
    def loss_context(self):
        """The context a micro-batch's forward, loss and backward run in (`step.train_step`): each
        axis's (PyTorch's tensor-parallel loss needs one)."""
        with ExitStack() as stack:
            for axis in self.axes:
                stack.enter_context(axis.loss_context())
            yield

    def no_sync(self, model):
        """The context of a micro-batch that is not the step's last (`step.train_step`).

        By default, inside it backward only accumulates local gradients, full-size, with no
        communication: the last micro-batch reduces their sum once. With `--accumulate_sharded`
        (ZeRO-2, FSDP, HSDP) it is a null context: every micro-batch is reduce-scattered and each
        rank adds the new shard into the shard's gradient it keeps (fp32, or `reduce_dtype`), so no
        full-size gradient outlives its micro-batch. Reduce-scatter is linear: k of them sum to the
        one reduce-scatter of the sum, the same gradient. The trade-off, for P parameters on N ranks
        and k micro-batches: no_sync keeps P full gradients (4 bytes each, in the reduce dtype, for
        FSDP) alive through the forward of every micro-batch after the first, and sends one
        reduce-scatter; sharded accumulation keeps P/N of them and sends k reduce-scatters, (k - 1)
        P(N-1)/N more elements a step (the gathers are the same). DeepSpeed's ZeRO-2 and ZeRO-3 do
        this by default, as PyTorch's FSDP does when `no_sync` (FSDP2: `set_requires_gradient_sync
        (False)`) is not used. HSDP all-reduces the shard over its copies after each micro-batch's
        reduce-scatter too, as FSDP2 does unless told `set_requires_all_reduce(False)`."""
        if self.options.accumulate_sharded:
            return nullcontext()
        return self._accumulate_locally(model)

    def _accumulate_locally(self, model):
        """Backward inside this context adds into local, full-size gradients and sends nothing."""
        return model.no_sync()

    def autocast(self):
        """The compute precision of the forward, where the weights stay fp32 (DDP; backward runs
        each operator in the dtype its forward ran in)."""
        return precision.autocast(self.mp, self.env.device) if self.autocast_weights else nullcontext()

    def clip_grad_norm_(self, model, max_norm: float) -> torch.Tensor:
        """Clip the gradients to `max_norm`; their norm before clipping, as a tensor on the device
        (read it when the number is needed: each read makes the host wait for the device). One
        function (`clip.py`) over this strategy's gradient pieces and the groups that hold
        different pieces: the data-parallel strategy's, then each axis's."""
        def alike(name, grad=None):
            return any(axis.alike(name, grad) for axis in self.axes)

        pieces, groups = self.gradient_pieces(model, alike)
        groups = groups + [group for axis in self.axes for group in axis.norm_groups()]
        share = 1 / math.prod(axis.alike_copies for axis in self.axes)
        return clip.clip_grad_norm_(pieces, max_norm, groups, share, self.env.device)

    def gradient_pieces(self, model, alike) -> tuple[list, list]:
        """This rank's gradient pieces for `clip.clip_grad_norm_`, (gradient, where in it the
        parameters `alike` names lie), and the data-parallel groups whose ranks hold different
        pieces: here a model every data-parallel rank holds whole, after the all-reduce (DDP)."""
        pieces = [(_local(p.grad), [slice(None)] if alike(name, p.grad) else [])
                  for name, p in self.unwrap(model).named_parameters() if p.grad is not None]
        return pieces, []

    def take_comm_bytes(self, split: bool = False) -> float | dict | None:
        """Bytes this rank sent for gradients and parameters since the last call (the count then
        starts again), counted by `comm.py` under the ring algorithm; None for PyTorch's own
        strategies, which do not go through `comm.py`. split=True (every rank must call it then):
        a dict of the total, its parts within a node and across nodes, and every rank's bytes across
        nodes (`across_nodes.take_split`); None in each for torch."""
        if self.options.impl != "minidist":
            return dict.fromkeys(across_nodes.SPLIT_KEYS) if split else None
        return across_nodes.take_split(self.mesh.group, self.env.device) if split else comm.counter.take()

    # ------------------------------------------------------------------ generation and the whole model
    def continue_fn(self):
        """What the legal-move rate generates with (`legal_moves.legal_move_rate`): greedy decoding
        on the model inside this strategy's wrapper (`ready_to_generate`), or through the stages of a pipeline."""
        from functools import partial

        from minidist.chess.legal_moves import greedy_continue

        pipeline = self.axis("pipeline")
        if pipeline is not None:
            return pipeline.continue_fn()
        return partial(greedy_continue, ready=self.ready_to_generate)

    def ready_to_generate(self, model):
        """A context giving the Hugging Face model to call `generate` on, and whether it is sharded
        (each forward a collective): here the model inside the wrapper, replicated."""
        return _unwrapped(model)

    def model_to_save(self, model, name_or_path: str | None = None) -> nn.Module:
        """The Hugging Face model the final model (or a full checkpoint) is written through
        (`save_pretrained` with the gathered weights): the unwrapped model; where an axis left no
        rank holding it (a pipeline), the whole model built on the meta device from its config."""
        pipeline = self.axis("pipeline")
        return self.unwrap(model) if pipeline is None else pipeline.model_to_save(name_or_path)

    def full_state_dict(self, model) -> dict | None:
        """The whole model's weights on rank 0, on the CPU (None on other ranks). Every rank calls it:
        the data-parallel strategy's weights, whole over its ranks, then joined by each axis in turn."""
        weights = self.whole_weights(model)
        for axis in self.axes:
            weights = axis.join_weights(weights)
        return weights if self.env.is_main else None

    def whole_weights(self, model) -> dict | None:
        """This rank's part of the model's weights, whole over the data-parallel ranks, on the CPU of
        data-parallel rank 0 (None elsewhere)."""
        if self.mesh.dp_rank != 0:
            return None
        return {k: v.detach().cpu() for k, v in self.unwrap(model).state_dict().items()}

    def get_state_dict(self, model, optimizer, full: bool) -> tuple[dict, dict]:
        """The model's and the optimizer's state for a checkpoint (`checkpoint/state.py`): the chain
        of forms in `state/`. full=True: whole tensors on rank 0's CPU, empty dicts elsewhere;
        full=False: each rank's own pieces (DTensors where sharded), which DCP writes in parallel."""
        return state.get_state_dict(self, model, optimizer, full)

    def set_state_dict(self, model, optimizer, model_state_dict, optim_state_dict, full: bool) -> None:
        """Load what `get_state_dict` gave; full=True: rank 0 holds it and the others pass {}."""
        state.set_state_dict(self, model, optimizer, model_state_dict, optim_state_dict, full)

    def layout_of(self, whole_model) -> list:
        """The flats this strategy makes of `whole_model` (flat strategies only: `data.py`)."""
        raise NotImplementedError


def wrap_policy_classes(model: nn.Module) -> set[str]:
    """The layer classes that become FSDP units: the model's repeated blocks.

    Hugging Face models list them in `_no_split_modules` (`LlamaDecoderLayer`, `GPT2Block`),
    the same list `accelerate` uses to place whole blocks on one device.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise ValueError(f"{type(model).__name__} names no layer class in _no_split_modules; use --no_layer_wrap_policy")
    return names


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's local tensor: FSDP2's is a DTensor, whose local shard is a view of it."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


class _unwrapped:
    """`ready_to_generate` for a replicated model: the model inside `.module`, as it is."""

    def __init__(self, model):
        while hasattr(model, "module"):
            model = model.module
        self.model = model

    def __enter__(self):
        return self.model, False

    def __exit__(self, *exc):
        return False
