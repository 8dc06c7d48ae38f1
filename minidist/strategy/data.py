"""The data-parallel strategies: how the model's state is spread over the data-parallel ranks.

Each strategy is a name (`ddp`, `zero1`, `zero2`, `fsdp`, `hsdp`) and an implementation: `torch`
(PyTorch's own DistributedDataParallel and FSDP2 `fully_shard`, the reference) or `minidist`
(written by hand in `parallel/ddp.py`, `zero.py` and `fsdp.py`, checked against the reference).
`Strategy` (`base.py`) is what they share and what the loop calls; each class here says only what
its strategy does differently: how it loads the model, wraps it (`wrap_data_parallel`, after the
axes have cut it: `base.py`), builds the optimizer, holds its gradient for clipping
(`gradient_pieces`), gathers its weights (`whole_weights`) and which checkpoint form it has
(`form_kind`). None of them knows which axes a run has.

`Strategy` itself is what a model replicated on every rank needs (both DDPs). ZeRO and FSDP by hand
share `ShardedByHand`: weights and optimizer states live in flat shards (`flat.py`), which
clipping, saving and loading reach through the wrapper (`flats()`, `full_parameters`).
"""

from contextlib import contextmanager

import torch
from torch import nn

from minidist.parallel import precision
from minidist.runtime import torch_features
from minidist.strategy.base import Strategy, _local, wrap_policy_classes
from minidist.strategy.clip import alike_ranges
from minidist.strategy.options import ADAMW_OPTIONS


class TorchDDP(Strategy):
    """PyTorch's DistributedDataParallel: every rank holds everything; gradients all-reduced."""

    autocast_weights = True

    def wrap_data_parallel(self, model):
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(self.env.device)
        device_ids = [self.env.device.index] if self.env.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, process_group=self.mesh.group)


class MinidistDDP(Strategy):
    """The hand-written DDP of `ddp.py`: bucketed with overlap, or naive (`--ddp_variant naive`)."""

    autocast_weights = True

    def wrap_data_parallel(self, model):
        from minidist.parallel import ddp

        model = model.to(self.env.device)
        # DDP's gradients have the fp32 parameters' dtype (fp64 in a test): reduced as they are,
        # unless --reduce_dtype bf16 asks for half the bytes.
        reduce_dtype = precision.reduction_dtype(next(model.parameters()).dtype, self.mp)
        if self.options.value("ddp_variant") == "naive":
            return ddp.NaiveDDP(model, self.mesh.group, reduce_dtype=reduce_dtype)
        return ddp.BucketedDDP(model, self.mesh.group, self.options.value("bucket_cap_mb"), reduce_dtype)


class ShardedByHand(Strategy):
    """ZeRO and FSDP by hand: the optimizer steps flat fp32 shards (`flat.py`), and clipping,
    saving and loading work on them. The parameters carry the compute dtype: no autocast."""

    form_kind = "flat"

    def gradient_pieces(self, model, alike):
        """Each flat's gradient shard: the data-parallel ranks hold different ones."""
        return [(grad, []) for grad in model.gradient_shards()], [self.mesh.shard_group]

    def whole_weights(self, model):
        full = model.full_parameters(keep=self.mesh.dp_rank == 0)  # every rank takes part in the gathers
        return full if self.mesh.dp_rank == 0 else None


class MinidistZeRO(ShardedByHand):
    """ZeRO stage 1 (`--strategy zero1`) or 2 (`zero2`): the model wrapped by `zero.ZeroDP`, the
    optimizer `zero.ShardedOptimizer` over its buckets."""

    def wrap_data_parallel(self, model):
        from minidist.parallel.zero import ZeroDP

        zero_stage = int(self.options.strategy[-1])  # 1 or 2
        return ZeroDP(model.to(self.env.device), zero_stage, self.mp, self.options.value("bucket_cap_mb"),
                      self.mesh.shard_group, self.options.cpu_offload, self.options.accumulate_sharded)

    def build_optimizer(self, model, lr, weight_decay=0.0):
        from minidist.parallel.zero import ShardedOptimizer

        return ShardedOptimizer(model.buckets, torch.optim.AdamW, model.group, lr=lr, weight_decay=weight_decay,
                                **ADAMW_OPTIONS)

    def layout_of(self, whole_model) -> list:
        """The buckets ZeRO makes of `whole_model` (built on the meta device): (name, shape) of each
        parameter of each (`state/data.run_buckets`)."""
        from minidist.strategy.state.data import run_buckets

        return run_buckets(whole_model, self.options.value("bucket_cap_mb"))


class MinidistFSDP(ShardedByHand):
    """FSDP (ZeRO-3) by hand: one unit per decoder layer and the root, or one unit in all. The
    wrapped model's parameters are its fp32 shards, so `Strategy.build_optimizer` fits as it is."""

    def load_model(self, name_or_path):
        """Only data-parallel rank 0 reads the weights; the others build the model on the meta device
        (shapes, no memory) and receive their shards when `wrap` scatters them (`load_on_rank0`).
        Where an axis cut the model first, data-parallel rank 0 of each cut reads them: each tensor-
        parallel rank cuts its own slices, each stage keeps its own layers, and each cut's ranks get
        their shards from it."""
        return load_on_rank0(name_or_path, self.env, loads=self.mesh.dp_rank == 0)

    def wrap_data_parallel(self, model):
        from minidist.parallel.fsdp import FullyShardedDataParallel

        classes = wrap_policy_classes(model) if self.options.layer_wrap_policy else ()
        return FullyShardedDataParallel(model, classes, self.mp, self.env.device, self.mesh.shard_group,
                                        self.mesh.replicate_group, self.options.cpu_offload)  # HSDP: the copies

    def gradient_pieces(self, model, alike):
        """Each unit's gradient shard, and where in it the parameters `alike` names lie."""
        pieces = []
        for unit in model.units:
            if unit.flat_param.grad is not None:
                layout, shard = unit.layout, unit.layout.shard_slice
                params = [(name, layout.offsets[k], layout.shapes[k].numel()) for _, _, name, k in unit.slots
                          if alike(name)]
                pieces.append((unit.flat_param.grad, alike_ranges(params, shard.start, shard.stop, alike)))
        return pieces, [self.mesh.shard_group]

    def layout_of(self, whole_model) -> list:
        """The units this FSDP makes of `whole_model` (built on the meta device): (name, shape) of
        each parameter of each (`state/data.run_units`)."""
        from minidist.strategy.state.data import run_units

        return run_units(whole_model, wrap_policy_classes(whole_model) if self.options.layer_wrap_policy else ())

    @contextmanager
    def ready_to_generate(self, model):
        """Each layer unit's hooks fire on every forward call, as FSDP2's do. The root (embeddings,
        final norm, output layer) is gathered by the wrapper's own `forward`, which `generate` on the
        inner model never calls, so it is gathered here for the whole call and freed after: without
        this, the first forward finds no weights."""
        root = model.root
        root.gather()
        root.wait()
        root.use_views()
        try:
            yield model.module, True
        finally:
            root.free()


class TorchFSDP(Strategy):
    """PyTorch's FSDP2 (`fully_shard`): one unit per decoder layer, then the root for the rest.
    On HSDP's 2-D mesh (`--strategy hsdp`) fully_shard replicates along dim 0 and shards along
    dim 1. With tensor parallelism (`--impl torch --tp_size`) the layers are cut first by PyTorch's
    `parallelize_module` and fully_shard goes around the slices, as torchtitan composes them."""

    torch_order = True

    def __init__(self, options, env, mesh=None):
        super().__init__(options, env, mesh)
        if env.device.type == "cpu":  # gloo's ranks: FSDP2 records events on CPU streams (torch_features.py)
            torch_features.require("fsdp2_on_cpu")

    def load_model(self, name_or_path):
        """Only rank 0 reads the weights; the others build the model on the meta device (shapes,
        no memory), and `wrap` broadcasts rank 0's weights into every rank's shards (`load_on_rank0`).
        With --tp_size T, the T ranks of data-parallel rank 0 read them: `parallelize_module` sends
        each tensor-parallel rank its slices from the first one's weights. Where the ranks hold
        different parts (a pipeline's stages) every rank reads them, as DDP's do: the broadcast from
        rank 0 would send its own part to every part."""
        if not self.one_holder:
            return super().load_model(name_or_path)
        return load_on_rank0(name_or_path, self.env, loads=self.mesh.dp_rank == 0)

    def before_cuts(self, model):
        # Rank 0's weights, whole, taken before any cut and before fully_shard turns its parameters into
        # shards: every rank's shards are loaded from them in `wrap_data_parallel`. The other ranks may
        # hold shapes only, or weights of their own: rank 0's win, as in DDP.
        self._rank0_weights = model.state_dict() if self.env.rank == 0 and self.one_holder else {}

    def wrap_data_parallel(self, model):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kwargs = {"mesh": self.mesh.shard_device_mesh()}
        if self.options.cpu_offload:  # sharded parameters, gradients and optimizer states on the host
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())  # pinning needs a GPU
        if self.options.mixed_precision == "bf16":
            # Parameters are all-gathered in bf16, gradients reduce-scattered in fp32.
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if self.options.layer_wrap_policy:
            classes = wrap_policy_classes(model)
            for module in model.modules():
                if type(module).__name__ in classes:
                    fully_shard(module, **kwargs)
        # The root unit holds what is left (embeddings, final norm, output layer). fully_shard
        # moves each shard onto the mesh's device, so the full model never sits on one GPU.
        fully_shard(model, **kwargs)
        if self.env.world_size > 1 and self.one_holder:  # where every rank read its part, it has its weights
            self._load_from_rank0(model, self._rank0_weights)
        self._rank0_weights = None
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

    def gradient_pieces(self, model, alike):
        """Each parameter's gradient shard (a DTensor's local part): the shard ranks hold different ones."""
        pieces = [(_local(p.grad), [slice(None)] if alike(name, p.grad) else [])
                  for name, p in model.named_parameters() if p.grad is not None]
        return pieces, [self.mesh.shard_group]

    @contextmanager
    def _accumulate_locally(self, model):
        model.set_requires_gradient_sync(False)  # --accumulate_sharded leaves it True: a reduce-scatter per micro-batch
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def whole_weights(self, model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Gathers one tensor at a time (DTensors over every dimension they are cut along) to rank 0's
        # CPU memory: no GPU ever holds the whole model. Where the ranks hold different parts (a
        # pipeline's stages), each part's first rank keeps its part, which then stays whole on its GPUs
        # until it moves to the CPU and is joined.
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=self.one_holder))
        return {name: tensor.cpu() for name, tensor in state.items()} if self.mesh.dp_rank == 0 else None

    @contextmanager
    def ready_to_generate(self, model):
        """`fully_shard` knows `forward` only. `register_fsdp_forward_method` runs FSDP2's pre- and
        post-forward around `generate` itself, as PyTorch documents for any other entry point, so the
        root is gathered before `generate` reads anything; inside, every forward still fires each
        layer's hooks."""
        from torch.distributed.fsdp import register_fsdp_forward_method

        if "generate" not in vars(model):  # once: each registration would wrap the method again
            register_fsdp_forward_method(model, "generate")
        yield model, True


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
