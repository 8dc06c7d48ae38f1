"""Strategies: how the model's state is spread over the ranks, behind one small interface.

The training loop in `finetune.py` never asks which strategy it runs. It picks one by name and
implementation from `STRATEGY_CLASSES` (a dict: `get_strategy(options, env)`), then calls:

    strategy.check_model(name)                  # --tp_size: can the model be cut that many ways?
    model = strategy.load_model(name)           # FSDP: the weights read on rank 0 only
    strategy.checkpoint_activations(model)      # with --gradient_checkpointing
    model = strategy.wrap(model)                # replicate (DDP) or shard (ZeRO, FSDP); --tp_size: cut first
    optimizer = strategy.build_optimizer(model, lr, weight_decay)
    with strategy.no_sync(model), strategy.loss_context():  # micro-batches that only accumulate (or,
        loss = strategy.cross_entropy_sum(...)  # with --accumulate_sharded, reduce-scatter each: no_sync)
        loss.backward()
    strategy.clip_grad_norm_(model, max_norm); optimizer.step()

and, to save, `strategy.full_state_dict(model)` (the weights) or `strategy.get_state_dict` and
`set_state_dict` (model and optimizer, for checkpoints: `state.py`). Each strategy is a name
(`ddp`, `zero1`, `zero2`, `fsdp`, `hsdp`) and an implementation: `torch` (PyTorch's own
DistributedDataParallel and FSDP2 `fully_shard`, the reference) or `minidist` (written by hand
in `ddp.py`, `zero.py` and `fsdp.py`, checked against the reference). What a strategy reads is
a `ParallelOptions` (`options.py`) and a `DataParallelMesh` (`mesh.py`: its process groups).
With `--tp_size` (lesson 11) the mesh has a tensor-parallel dimension too: the strategy cuts the
model over it before wrapping it over the data-parallel one (`cut_layers`: `tensor/llama.py` by
hand, `tensor/reference.py` for PyTorch's), and the places the cut shows are the loss (from the
vocabulary's slices), clipping (a norm summed over the slices) and the weights it saves.
With `--pp_size` (lesson 12) each rank keeps one stage of the model (`cut_stage`, after the
tensor-parallel cut and before the data-parallel wrapper), `step.train_step` hands the step to
`pipeline_step` (a schedule over the micro-batches: `pipeline/loop.py`), clipping sums the stages'
squares, the saved weights are the stages joined, and the legal-move rate generates through the
stages (`continue_fn`).

`Strategy` itself is what a model replicated on every rank needs (both DDPs): one class per
strategy below overrides only what it does differently. ZeRO and FSDP by hand share
`ShardedByHand`: weights and optimizer states live in flat shards (`flat.py`). Saving and
loading reach them through the wrapper's `flats()` (`flat_state.py`, `full_parameters`);
clipping asks the wrapper, which takes the norm of its sharded gradients
(`flat.clip_sharded_grad_norm_`).

Both implementations *average* gradients over ranks, as PyTorch's DDP does. The loop divides
each rank's summed token loss by the token count of the whole global batch and multiplies by
the world size, so the average of the ranks' gradients is the gradient of the global batch.
"""

from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from minidist.parallel import across_nodes, comm, precision
from minidist.parallel.mesh import DataParallelMesh, data_parallel_mesh
from minidist.parallel.options import ADAMW_OPTIONS, ParallelOptions


class Strategy:
    """The interface, and what a model that every rank holds whole needs (DDP)."""

    autocast_weights = False  # True: fp32 weights, bf16 matmuls under autocast (DDP; precision.py)

    def __init__(self, options: ParallelOptions, env, mesh: DataParallelMesh | None = None):
        self.options, self.env, self._mesh = options, env, mesh
        self.mp = precision.policy(options.mixed_precision, options.value("reduce_dtype"))

    @property
    def mesh(self) -> DataParallelMesh:
        """The process groups this strategy communicates over (read when it first communicates);
        HSDP's shard groups hold `--hsdp_shard_size` ranks, by default the ranks of a node."""
        if self._mesh is None:
            hybrid = self.options.strategy == "hsdp"
            self._mesh = data_parallel_mesh(self.options.hsdp_shard_size or self.env.local_world_size if hybrid else None,
                                            self.options.tp_size, self.options.pp_size)
            across_nodes.split.tensor_group = self._mesh.tp_group  # metrics.jsonl: tensor parallelism's bytes apart
        return self._mesh

    # ------------------------------------------------------------------ tensor parallelism (lesson 11)
    # With --tp_size T the model is first cut over the mesh's tensor-parallel group (`tensor/llama.py`),
    # then wrapped over its data-parallel group as without it. These are the places the cut shows.
    @property
    def tensor_parallel(self) -> bool:
        return self.options.tp_size > 1

    def cut_layers(self, model: nn.Module) -> nn.Module:
        """Cut each layer's matrices over the tensor-parallel ranks, in place (without --tp_size:
        nothing). Called by `wrap` before the data-parallel wrapper goes around the cut model."""
        if self.tensor_parallel:
            from minidist.parallel.tensor.llama import parallelize_llama, split_parameters

            for line in parallelize_llama(model, self.mesh.tp_group, self.options.sequence_parallel):
                if self.env.is_main:
                    print(line)
            self._split = split_parameters(model)  # names of the sliced parameters: saving, clipping
            self._vocabulary = model.lm_head.start, model.lm_head.vocab_size  # this rank's first token id, the real size
        return model

    def check_model(self, name_or_path: str) -> None:
        """Raise ValueError, in one sentence, if the model cannot be cut over --tp_size ranks (its
        heads, its MLP, its layers' names) or into --pp_size stages (a layer each at least, untied
        embeddings), before anything is loaded: built on the meta device."""
        from minidist.hf import models

        if self.tensor_parallel:
            from minidist.parallel.tensor.llama import check_splittable

            check_splittable(models.build_on_meta(name_or_path), self.options.tp_size)
        if self.pipeline:
            from minidist.parallel.pipeline.stages import Stage

            Stage(models.build_on_meta(name_or_path), 0, self.options.pp_size)  # refuses what cannot be cut

    @property
    def sequence_multiple(self) -> int:
        """Batches are padded to a multiple of this many tokens: sequence parallelism cuts the
        sequence into --tp_size equal chunks."""
        return self.options.tp_size if self.options.sequence_parallel else 1

    def cross_entropy_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed cross-entropy of next-token `logits` against `targets` (-100: ignored). Under
        tensor parallelism each rank holds a slice of the vocabulary's logits, and the loss is
        computed from the slices (`tensor/vocab.py`), the same on every tensor-parallel rank."""
        if not self.tensor_parallel:
            return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")  # as step.cross_entropy_sum
        from minidist.parallel.tensor.vocab import vocab_parallel_cross_entropy

        start, vocab_size = self._vocabulary
        return vocab_parallel_cross_entropy(logits, targets, start, vocab_size, self.mesh.tp_group).sum()

    def loss_context(self):
        """The context a micro-batch's forward, loss and backward run in (`step.train_step`): none,
        but PyTorch's tensor-parallel loss (`TorchFSDP`)."""
        return nullcontext()

    # ------------------------------------------------------------------ pipeline parallelism (lesson 12)
    # With --pp_size P each rank keeps one stage of the model (`pipeline/loop.py` says what changes):
    # cut after the tensor-parallel cut and before the data-parallel wrapper, stepped by a schedule.
    @property
    def pipeline(self) -> bool:
        return self.options.pp_size > 1

    def cut_stage(self, model: nn.Module) -> nn.Module:
        """This rank's stage of `model` (without --pp_size: the model). The rest of the model is
        dropped with the caller's reference to it, before anything moves to the GPU."""
        if not self.pipeline:
            return model
        from minidist.parallel.pipeline.loop import cut_stage

        stage = cut_stage(model, self.mesh)
        if self.tensor_parallel:
            stage.loss_sum = self.cross_entropy_sum  # the last stage's loss from the vocabulary's slices
        stage.autocast = self.autocast  # DDP's mixed precision: fp32 weights, bf16 matmuls
        # What crosses a cut: the residual stream, in the weights' dtype (fp32 under autocast, whose
        # sums with the fp32 residual stay fp32), or bf16 where the weights themselves compute in it.
        self._activation_dtype = (torch.bfloat16 if self.options.mixed_precision == "bf16" and not self.autocast_weights
                                  else next(stage.parameters()).dtype)
        self._stage = stage
        return stage

    def pipeline_step(self, model, micro_batches: list[dict], num_targets: int) -> torch.Tensor:
        """One step's forwards and backwards through the stages, by `--pp_schedule`
        (`step.train_step` calls it under --pp_size); the summed loss of this data-parallel rank's
        micro-batches, on every stage."""
        if getattr(self, "_pipeline", None) is None:
            from minidist.parallel.pipeline.loop import Pipeline

            self._pipeline = Pipeline(self._stage, model, self.mesh, self.options.value("pp_schedule"),
                                      no_sync=lambda: self.no_sync(model), dtype=self._activation_dtype,
                                      device=self.env.device, impl=self.options.impl)
        with self.loss_context():  # PyTorch's tensor-parallel loss: the schedule runs forwards and backwards
            return self._pipeline.step(micro_batches, num_targets)

    def continue_fn(self):
        """What the legal-move rate generates with (`legal_moves.legal_move_rate`): None, its own
        `generate`; under a pipeline, greedy decoding through the stages (`pipeline/generate.py`)."""
        if not self.pipeline:
            return None
        from minidist.parallel.pipeline.generate import continue_fn

        return continue_fn(self._stage, self.mesh.pp_group, self._activation_dtype)

    def _norm_groups(self) -> list:
        """Groups the squares of a clipped gradient are summed over besides the data- and tensor-
        parallel ones: the pipeline's stages, each holding other parameters (none without one)."""
        from minidist.parallel.pipeline.loop import norm_groups

        return norm_groups(self.mesh)

    def model_to_save(self, model, name_or_path: str | None = None) -> nn.Module:
        """The Hugging Face model the final model (or a full checkpoint) is written through
        (`save_pretrained` with the gathered weights): the unwrapped model; under a pipeline, where no
        rank holds it, the whole model built on the meta device (its config and class, no memory),
        from `name_or_path` or else the folder the stage's model was loaded from."""
        if not self.pipeline:
            return self.unwrap(model)
        from minidist.hf import models

        return models.build_on_meta(name_or_path or self._stage.config.name_or_path)

    def _full(self, state) -> dict | None:
        """The whole model's weights on rank 0 (None elsewhere) from `state`: a zero-argument
        callable giving this rank's weights, called on the ranks that hold a whole copy of their
        stage or slice (data-parallel rank 0). Slices are joined over the tensor-parallel ranks, and
        stages over the pipeline's (`pipeline/loop.join_stages`)."""
        mine = None
        if self.mesh.rank == 0:
            mine = state()
            if self.tensor_parallel:
                from minidist.parallel.tensor.whole import whole_weights

                mine = whole_weights(mine, self._split, self.mesh.tp_group)
        if self.pipeline:
            from minidist.parallel.pipeline.loop import join_stages

            return join_stages(mine, self.mesh)
        return mine if self.env.is_main else None

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
        raise NotImplementedError

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The Hugging Face model inside the wrapper (for `save_pretrained`, `config`)."""
        return model.module

    def build_optimizer(self, model, lr, weight_decay=0.0) -> torch.optim.Optimizer:
        # Frozen parameters get no optimizer state at all: that is where LoRA saves its memory.
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **ADAMW_OPTIONS)

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

    def take_comm_bytes(self, split: bool = False) -> float | dict | None:
        """Bytes this rank sent for gradients and parameters since the last call (the count then
        starts again), counted by `comm.py` under the ring algorithm; None for PyTorch's own
        strategies, which do not go through `comm.py`. split=True (every rank must call it then):
        a dict of the total, its parts within a node and across nodes, and every rank's bytes across
        nodes (`across_nodes.take_split`); None in each for torch."""
        if self.options.impl != "minidist":
            return dict.fromkeys(across_nodes.SPLIT_KEYS) if split else None
        return across_nodes.take_split(self.mesh.group, self.env.device) if split else comm.counter.take()

    def clip_grad_norm_(self, model, max_norm: float) -> torch.Tensor:
        """Clip the gradients to `max_norm`; their norm before clipping, as a tensor on the device
        (read it when the number is needed: each read makes the host wait for the device)."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if self.pipeline:  # this stage's norm, then the stages' squares summed
            norm = torch.nn.utils.get_total_norm(grads, 2.0)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
            return _clip_by_stages(grads, norm, max_norm, self._norm_groups())
        # (torch's clip takes the parameters, and reads their .grad)
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor

    def full_state_dict(self, model) -> dict | None:
        """The whole model's weights on rank 0, on the CPU (None on other ranks). Every rank calls it."""
        return self._full(lambda: {k: v.detach().cpu() for k, v in self.unwrap(model).state_dict().items()})

    def get_state_dict(self, model, optimizer, full: bool) -> tuple[dict, dict]:
        """The model's and the optimizer's state for a checkpoint (`state.py`), keyed by parameter name.

        full=True: whole tensors on rank 0's CPU, empty dicts elsewhere. full=False: each rank's
        own shards (DTensors where sharded), which DCP writes in parallel and reshards on load.
        PyTorch's helpers handle plain modules, DDP and FSDP2; the strategies that shard by hand
        (`ShardedByHand`) hand out and take back their flat shards instead."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        if self.pipeline and full:  # the stages joined on rank 0, as a run without a pipeline writes them
            from minidist.parallel.pipeline.checkpoint import joined_state_dict

            return joined_state_dict(self.unwrap(model), optimizer, self.mesh)
        options = StateDictOptions(full_state_dict=full, cpu_offload=full)
        return get_state_dict(self.unwrap(model), optimizer, options=options)

    def set_state_dict(self, model, optimizer, model_state_dict, optim_state_dict, full: bool) -> None:
        """Load what `get_state_dict` gave; full=True: rank 0 holds it and broadcasts, the others pass {}."""
        from torch.distributed.checkpoint import state_dict as dsd

        if self.pipeline:  # full: each stage takes its keys of any pp size's; sharded: its own param names
            from minidist.parallel.pipeline import checkpoint

            if full:
                return checkpoint.load_stage(self.unwrap(model), optimizer, model_state_dict, optim_state_dict)
            live = dsd.get_optimizer_state_dict(self.unwrap(model), optimizer)["param_groups"]
            optim_state_dict["param_groups"] = checkpoint.own_param_groups(optim_state_dict["param_groups"], live)
        options = dsd.StateDictOptions(full_state_dict=full, broadcast_from_rank0=full)
        # Two calls, not set_state_dict: it would take the empty model dict of ranks > 0 to mean
        # "optimizer only", and those ranks would skip the broadcasts rank 0 sends.
        dsd.set_optimizer_state_dict(self.unwrap(model), optimizer, optim_state_dict, options=options)
        dsd.set_model_state_dict(self.unwrap(model), model_state_dict, options=options)


class TorchDDP(Strategy):
    """PyTorch's DistributedDataParallel: every rank holds everything; gradients all-reduced."""

    autocast_weights = True

    def wrap(self, model):
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(self.env.device)
        device_ids = [self.env.device.index] if self.env.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, process_group=self.mesh.group)


class MinidistDDP(Strategy):
    """The hand-written DDP of `ddp.py`: bucketed with overlap, or naive (`--ddp_variant naive`)."""

    autocast_weights = True

    def get_state_dict(self, model, optimizer, full):
        if not self.tensor_parallel:
            return super().get_state_dict(model, optimizer, full)
        from minidist.parallel.tensor import checkpoint

        if self.pipeline and full:  # the slices joined over tp, then the stages over pp (pipeline/checkpoint.py)
            from minidist.parallel.pipeline.checkpoint import joined_state_dict

            return joined_state_dict(self.unwrap(model), optimizer, self.mesh, cut=self._split)
        # The slices, as parts of whole tensors (sharded) or joined (full): tensor/checkpoint.py
        return checkpoint.replicated_state_dict(self.unwrap(model), optimizer, full, self._split, self.mesh)

    def set_state_dict(self, model, optimizer, model_state_dict, optim_state_dict, full):
        if not self.tensor_parallel:
            return super().set_state_dict(model, optimizer, model_state_dict, optim_state_dict, full)
        from minidist.parallel.tensor import checkpoint

        if self.pipeline:  # full: each stage takes its keys' slices; sharded: its own param names (pipeline/checkpoint.py)
            from minidist.parallel.pipeline import checkpoint as stages

            if full:
                return stages.load_stage(self.unwrap(model), optimizer, model_state_dict, optim_state_dict,
                                         cut=self._split, tp_group=self.mesh.tp_group)
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            live = get_optimizer_state_dict(self.unwrap(model), optimizer)["param_groups"]
            optim_state_dict["param_groups"] = stages.own_param_groups(optim_state_dict["param_groups"], live)
        # Each rank keeps its slices (a full checkpoint: of any tp size)
        checkpoint.load_replicated(self.unwrap(model), optimizer, model_state_dict, optim_state_dict, full,
                                   self._split, self.mesh)

    def wrap(self, model):
        from minidist.parallel import ddp

        # --tp_size: each rank keeps its slices; --pp_size: its stage, before it moves to the GPU
        model = self.cut_stage(self.cut_layers(model)).to(self.env.device)
        # DDP's gradients have the fp32 parameters' dtype (fp64 in a test): reduced as they are,
        # unless --reduce_dtype bf16 asks for half the bytes.
        reduce_dtype = precision.reduction_dtype(next(model.parameters()).dtype, self.mp)
        if self.options.value("ddp_variant") == "naive":
            return ddp.NaiveDDP(model, self.mesh.group, reduce_dtype=reduce_dtype)
        return ddp.BucketedDDP(model, self.mesh.group, self.options.value("bucket_cap_mb"), reduce_dtype)

    def clip_grad_norm_(self, model, max_norm):
        if not self.tensor_parallel:
            return super().clip_grad_norm_(model, max_norm)
        from minidist.parallel.tensor import whole

        # Each rank holds slices: the norm is summed over the tensor-parallel group (tensor/whole.py).
        pieces = [(p.grad, [] if name in self._split else [slice(None)])
                  for name, p in self.unwrap(model).named_parameters() if p.grad is not None]
        return whole.clip_grad_norm_(pieces, max_norm, self.mesh.tp_group, also=self._norm_groups())


class ShardedByHand(Strategy):
    """ZeRO and FSDP by hand: the optimizer steps flat fp32 shards (`flat.py`), and clipping,
    saving and loading work on them. The parameters carry the compute dtype: no autocast."""

    def clip_grad_norm_(self, model, max_norm):
        return model.clip_grad_norm_(max_norm, also=self._norm_groups())  # a gradient that is sharded: flat.py

    def full_state_dict(self, model):
        full = model.full_parameters(keep=self.mesh.rank == 0)  # every rank takes part in the gathers
        return self._full(lambda: full)  # data-parallel rank 0 of each slice and stage holds it

    def get_state_dict(self, model, optimizer, full):
        from minidist.parallel import flat_state

        model_sd, optim_sd = flat_state.get_state_dict(model, optimizer, full, self.env, self.mesh)
        if self.tensor_parallel:  # full: the slices joined, as a tp 1 run writes them; sharded: its layout noted
            from minidist.parallel.tensor import checkpoint

            if full:
                model_sd, optim_sd = checkpoint.whole_flats(model, model_sd, optim_sd, self._split, self.mesh)
                if not self.pipeline:
                    return model_sd, optim_sd
            else:
                optim_sd[checkpoint.LAYOUT] = checkpoint.layout(self.mesh)
        if self.pipeline:  # each stage's flats, its layout noted; full: as pp 1 writes it (with tp: of whole parameters)
            from minidist.parallel.pipeline import checkpoint

            if full:
                return checkpoint.joined_flats(model, model_sd, optim_sd, self.mesh, self._run_flats(model))
            optim_sd[checkpoint.LAYOUT] = checkpoint.layout(self.mesh)
        return model_sd, optim_sd

    def _run_flats(self, model) -> list:
        """The flats of a run without a pipeline: the buckets ZeRO makes of the whole model
        (`pipeline/checkpoint.run_buckets`; FSDP: its units, `MinidistFSDP._run_flats`)."""
        from minidist.parallel.pipeline.checkpoint import run_buckets

        return run_buckets(self.model_to_save(model), self.options.value("bucket_cap_mb"))

    def set_state_dict(self, model, optimizer, model_state_dict, optim_state_dict, full):
        from minidist.parallel import flat_state

        if self.tensor_parallel:  # full: rank 0's whole state cut into each slice's; sharded: the same layout
            from minidist.parallel.tensor import checkpoint

            if full and not self.pipeline:  # under a pipeline, sharded_flats below keeps each rank's slices
                model_state_dict, optim_state_dict = checkpoint.sliced_flats(model, model_state_dict, optim_state_dict,
                                                                             self._split, self.mesh)
            elif not full:
                checkpoint.check_layout(optim_state_dict.pop(checkpoint.LAYOUT), self.mesh)
        if self.pipeline:  # a stage's flats: at the layout that wrote them; full: rank 0's pp 1 flats cut into them
            from minidist.parallel.pipeline import checkpoint

            if full:  # with --tp_size: each rank's slices of them
                cut = self._split if self.tensor_parallel else None
                model_state_dict, optim_state_dict = checkpoint.sharded_flats(model, model_state_dict, optim_state_dict,
                                                                              self.mesh, self._run_flats(model), cut)
                full = False  # each rank now holds its own shards, as from a sharded checkpoint
            else:
                checkpoint.check_layout(optim_state_dict.pop(checkpoint.LAYOUT), self.mesh)
        flat_state.set_state_dict(model, optimizer, model_state_dict, optim_state_dict, full, self.env, self.mesh)


class MinidistZeRO(ShardedByHand):
    """ZeRO stage 1 (`--strategy zero1`) or 2 (`zero2`): the model wrapped by `zero.ZeroDP`, the
    optimizer `zero.ShardedOptimizer` over its buckets."""

    def wrap(self, model):
        from minidist.parallel.zero import ZeroDP

        stage = int(self.options.strategy[-1])
        model = self.cut_stage(model)  # --pp_size: this rank's stage only
        return ZeroDP(model.to(self.env.device), stage, self.mp, self.options.value("bucket_cap_mb"),
                      self.mesh.shard_group, self.options.cpu_offload, self.options.accumulate_sharded)

    def build_optimizer(self, model, lr, weight_decay=0.0):
        from minidist.parallel.zero import ShardedOptimizer

        return ShardedOptimizer(model.buckets, torch.optim.AdamW, model.group, lr=lr, weight_decay=weight_decay,
                                **ADAMW_OPTIONS)


class MinidistFSDP(ShardedByHand):
    """FSDP (ZeRO-3) by hand: one unit per decoder layer and the root, or one unit in all. The
    wrapped model's parameters are its fp32 shards, so `Strategy.build_optimizer` fits as it is."""

    def load_model(self, name_or_path):
        """Only rank 0 reads the weights; the others build the model on the meta device (shapes,
        no memory) and receive their shards when `wrap` scatters them (`load_on_rank0`). With
        --tp_size T, the T ranks of data-parallel rank 0 read them, each to cut its own slices from;
        with --pp_size, data-parallel rank 0 of each stage, which keeps its stage's layers (`wrap`:
        the stage is cut before it is sharded, and each stage's ranks get their shards from it)."""
        return load_on_rank0(name_or_path, self.env, loads=self.mesh.rank == 0)

    def wrap(self, model):
        from minidist.parallel.fsdp import FullyShardedDataParallel

        model = self.cut_layers(model)  # --tp_size: slices, on the meta device where nothing was read
        model = self.cut_stage(model)  # --pp_size: this rank's stage
        classes = wrap_policy_classes(model) if self.options.layer_wrap_policy else ()
        return FullyShardedDataParallel(model, classes, self.mp, self.env.device, self.mesh.shard_group,
                                        self.mesh.replicate_group, self.options.cpu_offload)  # HSDP: the copies

    def _run_flats(self, model) -> list:
        """The units FSDP makes of the whole model without a pipeline (`pipeline/checkpoint.run_units`)."""
        from minidist.parallel.pipeline.checkpoint import run_units

        whole = self.model_to_save(model)
        return run_units(whole, wrap_policy_classes(whole) if self.options.layer_wrap_policy else ())

    def clip_grad_norm_(self, model, max_norm):
        if not self.tensor_parallel:
            return super().clip_grad_norm_(model, max_norm)
        from minidist.parallel.tensor import whole

        pieces = []  # each unit's gradient shard, and where in it the norms' (every slice's alike) lie
        for unit in model.units:
            if unit.flat_param.grad is not None:
                layout, shard = unit.layout, unit.layout.shard_slice
                params = [(name, layout.offsets[k], layout.shapes[k].numel()) for _, _, name, k in unit.slots]
                pieces.append((unit.flat_param.grad, whole.replicated_ranges(params, shard.start, shard.stop,
                                                                             self._split)))
        return whole.clip_grad_norm_(pieces, max_norm, self.mesh.tp_group, self.mesh.shard_group,
                                     also=self._norm_groups())


class TorchFSDP(Strategy):
    """PyTorch's FSDP2 (`fully_shard`): one unit per decoder layer, then the root for the rest.
    On HSDP's 2-D mesh (`--strategy hsdp`) fully_shard replicates along dim 0 and shards along
    dim 1."""

    def load_model(self, name_or_path):
        """Only rank 0 reads the weights; the others build the model on the meta device (shapes,
        no memory), and `wrap` broadcasts rank 0's weights into every rank's shards (`load_on_rank0`).
        With --tp_size T, the T ranks of data-parallel rank 0 read them: `parallelize_module` sends
        each tensor-parallel rank its slices from the first one's weights. Under --pp_size every rank
        reads them, as DDP's do: the broadcast from rank 0 would send stage 0's weights to every stage."""
        if self.pipeline:
            return super().load_model(name_or_path)
        return load_on_rank0(name_or_path, self.env, loads=self.mesh.rank == 0)

    def wrap(self, model):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        # Rank 0's weights, whole, taken before fully_shard turns its parameters into shards: every
        # rank's shards are loaded from them below. The other ranks may hold shapes only, or weights
        # of their own: rank 0's win, as in DDP. Under --pp_size every rank read the weights (`load_model`).
        model = self.cut_stage(model)
        full = model.state_dict() if self.env.rank == 0 else {}
        kwargs = {"mesh": self.mesh.shard_device_mesh()}
        if self.options.cpu_offload:  # sharded parameters, gradients and optimizer states on the host
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())  # pinning needs a GPU
        if self.options.mixed_precision == "bf16":
            # Parameters are all-gathered in bf16, gradients reduce-scattered in fp32.
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        self.cut_layers(model)  # --tp_size: PyTorch's own tensor parallelism first, on the tp dimension
        if self.options.layer_wrap_policy:
            classes = wrap_policy_classes(model)
            for module in model.modules():
                if type(module).__name__ in classes:
                    fully_shard(module, **kwargs)
        # The root unit holds what is left (embeddings, final norm, output layer). fully_shard
        # moves each shard onto the mesh's device, so the full model never sits on one GPU.
        fully_shard(model, **kwargs)
        if self.env.world_size > 1 and not self.pipeline:  # a pipeline's ranks all read the weights
            self._load_from_rank0(model, full)
        return model

    def _load_from_rank0(self, model, full: dict) -> None:
        """Fill every rank's shards and buffers from rank 0's weights (`full` there, {} elsewhere).

        A rank whose model was built on the meta device first gets memory, uninitialised
        (`to_empty`): its shards where FSDP2 keeps them (the GPU, or the host with --cpu_offload),
        its buffers on the compute device, where fully_shard moved rank 0's. Buffers that no
        state dict holds (non-persistent: Llama's rotary frequencies) are computed when the model
        is built, so rank 0's are right: they are broadcast. Then PyTorch's distributed state-dict
        API sends the weights from rank 0 one tensor at a time, and each rank keeps its own shard
        of each: no rank but 0 ever holds the whole model."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        device = self.env.device
        if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            model.to_empty(device="cpu" if self.options.cpu_offload else device)
        computed = []  # the buffers no state dict holds
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None and buf.device != device:
                    module._buffers[name] = buf = buf.to(device)
                if buf is not None and name in module._non_persistent_buffers_set:
                    computed.append(buf)
        for buf in computed:
            dist.broadcast(buf, src=0)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full, options=options)

    def unwrap(self, model):
        return model  # fully_shard changes the model in place: there is no wrapper

    # PyTorch's tensor parallelism (`tensor/reference.py`): `parallelize_module`, then fully_shard on
    # the data-parallel dimension, as torchtitan composes them. Its logits are a DTensor cut by vocabulary.
    # Under --pp_size the stage is cut first (`wrap`), then its own layers (pp x tp x dp: torchtitan's order).
    def cut_layers(self, model):
        if self.tensor_parallel:
            from minidist.parallel.tensor.reference import parallelize_llama_torch

            for line in parallelize_llama_torch(model, self.mesh.tp_device_mesh(), self.options.sequence_parallel):
                if self.env.is_main:
                    print(line)
            if hasattr(model, "lm_head"):  # --pp_size: the last stage's
                model.lm_head.register_forward_hook(_whole_logits_in_eval)
        return model

    def clip_grad_norm_(self, model, max_norm):
        if not self.tensor_parallel:
            return super().clip_grad_norm_(model, max_norm)
        # The norms' weights are sharded over the data-parallel dimension only, the cut matrices over
        # both: DTensors on two meshes, which torch's clip_grad_norm_ cannot stack. So each mesh's
        # gradients give their norm, and the whole norm is theirs combined.
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        by_mesh = {}
        for grad in grads:
            by_mesh.setdefault(grad.device_mesh, []).append(grad)
        norms = [torch.nn.utils.get_total_norm(same, 2.0).full_tensor() for same in by_mesh.values()]
        norm = torch.linalg.vector_norm(torch.stack(norms))
        if self.pipeline:  # this stage's norm: the stages' squares summed
            return _clip_by_stages(grads, norm, max_norm, self._norm_groups())
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # the same formula as torch's clip_grad_norm_
        with torch.no_grad():
            for grad in grads:  # each rank scales its own shard; the DTensor is a view of it
                grad.to_local().mul_(scale)
        return norm

    def cross_entropy_sum(self, logits, targets):
        if not self.tensor_parallel:
            return super().cross_entropy_sum(logits, targets)
        # inside loss_context: PyTorch's loss_parallel takes the DTensor logits cut by vocabulary. The local
        # tensor is a view: under --pp_size it is the output of the stage FSDP2 wraps, which warns of views
        # (an in-place op on one would skip its pre-backward hook), so a copy of it, one number.
        return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum").to_local().clone()

    def loss_context(self):
        if not self.tensor_parallel:
            return nullcontext()
        from minidist.parallel.tensor.reference import loss_parallel

        return loss_parallel()

    @contextmanager
    def _accumulate_locally(self, model):
        model.set_requires_gradient_sync(False)  # --accumulate_sharded leaves it True: a reduce-scatter per micro-batch
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def full_state_dict(self, model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Gathers one tensor at a time to rank 0's CPU memory: no GPU ever holds the whole model.
        # PyTorch's rank 0 is the world's; under a pipeline every stage's first rank keeps its stage,
        # which then stays whole on the GPUs of the stage until it moves to the CPU and is joined.
        options = StateDictOptions(full_state_dict=True, cpu_offload=not self.pipeline)
        state = get_model_state_dict(model, options=options)
        if self.pipeline and self.tensor_parallel:  # whole over the slices too (DTensors gathered): join the stages
            from minidist.parallel.pipeline.loop import join_stages

            return join_stages({name: tensor.cpu() for name, tensor in state.items()} if self.mesh.rank == 0 else None,
                               self.mesh)
        if self.pipeline:
            return self._full(lambda: {name: tensor.cpu() for name, tensor in state.items()})
        return state if self.env.is_main else None


def _clip_by_stages(grads: list, stage_norm: torch.Tensor, max_norm: float, groups: list) -> torch.Tensor:
    """Clip `grads` (this stage's) by the whole model's norm: this stage's `stage_norm` squared, summed
    over `groups` (the pipeline), one number each. Returns the whole norm, as torch's clip does."""
    import torch.distributed as dist

    total = stage_norm.float().pow(2)
    for group in groups:
        dist.all_reduce(total, group=group)  # a single number: not counted in the step's bytes
    norm = total.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # the same formula as torch's clip_grad_norm_
    with torch.no_grad():
        for grad in grads:
            (grad.to_local() if hasattr(grad, "to_local") else grad).mul_(scale.to(grad.device, grad.dtype))
    return norm


def _whole_logits_in_eval(head, inputs, logits):
    """In eval mode (generation) the whole vocabulary's logits, a plain tensor on every rank, as
    the hand-written head gives them (`tensor/vocab.py`); in training the DTensor stays cut."""
    return logits if head.training else logits.full_tensor()


def load_on_rank0(name_or_path: str, env, loads: bool | None = None) -> nn.Module:
    """The model as both FSDPs load it: rank 0 reads the weights (`from_pretrained`, fp32, on the
    CPU: 27 GB for CodeLlama-7b), every other rank builds the same model on the meta device and
    opens no weights file. A node then holds the weights once, not once per rank (4 x 27 GB).
    `wrap` sends each rank its shards from rank 0's copy. `loads` says which ranks read (default:
    rank 0 alone; tensor parallelism: one per slice).

    Reading 7B can outlast the process group's timeout (600 s), which the others would spend
    inside wrap's first collective. So all wait for rank 0 here, on a CPU barrier with an hour's
    timeout (`distributed.wait_for_rank0`)."""
    from minidist.hf import models
    from minidist.runtime.distributed import wait_for_rank0

    loads = env.rank == 0 if loads is None else loads
    model = models.load_model(name_or_path) if loads else models.build_on_meta(name_or_path)
    wait_for_rank0()
    return model


def wrap_policy_classes(model: nn.Module) -> set[str]:
    """The layer classes that become FSDP units: the model's repeated blocks.

    Hugging Face models list them in `_no_split_modules` (`LlamaDecoderLayer`, `GPT2Block`),
    the same list `accelerate` uses to place whole blocks on one device.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise ValueError(f"{type(model).__name__} names no layer class in _no_split_modules; use --no_layer_wrap_policy")
    return names


# Which class runs which strategy: (implementation, name) -> class. PyTorch has no ZeRO-1/2 of its own.
STRATEGY_CLASSES = {
    ("torch", "ddp"): TorchDDP, ("torch", "fsdp"): TorchFSDP,
    ("minidist", "ddp"): MinidistDDP, ("minidist", "zero1"): MinidistZeRO, ("minidist", "zero2"): MinidistZeRO,
    ("minidist", "fsdp"): MinidistFSDP,
    # HSDP is FSDP on a 2-D mesh: the same classes, over the groups `mesh.py` builds for it.
    ("torch", "hsdp"): TorchFSDP, ("minidist", "hsdp"): MinidistFSDP,
}


def get_strategy(options: ParallelOptions, env, mesh: DataParallelMesh | None = None) -> Strategy:
    """The strategy `options` name, on the process groups of `mesh` (default: every rank data-parallel).
    Raises ValueError or NotImplementedError, in one line naming the flag, for options that cannot run."""
    options.check()
    return STRATEGY_CLASSES[(options.impl, options.strategy)](options, env, mesh)
