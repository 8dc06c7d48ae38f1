"""Strategies: how the model's state is spread over the ranks, behind one small interface.

The training loop in `finetune.py` never asks which strategy it runs. It calls:

    model = strategy.load_model(name)           # FSDP by hand: the weights on rank 0 only
    strategy.checkpoint_activations(model)      # with --gradient_checkpointing
    model = strategy.wrap(model)                # replicate (DDP) or shard (ZeRO, FSDP)
    optimizer = strategy.build_optimizer(model, lr, weight_decay)
    with strategy.no_sync(model):               # micro-batches that only accumulate
        loss.backward()
    strategy.clip_grad_norm_(model, max_norm); optimizer.step()

and, to save, `strategy.full_state_dict(model)` (the weights) or `strategy.get_state_dict` and
`set_state_dict` (model and optimizer, for checkpoints: `state.py`). Each strategy is a name
(`ddp`, `zero1`, `zero2`, `fsdp`) and an implementation: `torch` (PyTorch's own
DistributedDataParallel and FSDP2 `fully_shard`, the reference) or `minidist` (written by hand
in `ddp.py`, `zero.py` and `fsdp.py`, checked against the reference).

Both implementations *average* gradients over ranks, as PyTorch's DDP does. The loop divides
each rank's summed token loss by the token count of the whole global batch and multiplies by
the world size, so the average of the ranks' gradients is the gradient of the global batch.
"""

from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from minidist import precision
from minidist.distributed import device_mesh

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
IMPLEMENTATIONS = ("minidist", "torch")
DDP_VARIANTS = ("bucketed", "naive")


class Strategy:
    """The shared part: a device, a precision, AdamW over the trainable parameters."""

    def __init__(self, env, mixed_precision="fp32", layer_wrap_policy=True):
        self.env = env
        self.mixed_precision = mixed_precision
        self.layer_wrap_policy = layer_wrap_policy

    def load_model(self, name_or_path: str) -> nn.Module:
        """Every rank loads the whole model (in fp32, on the CPU); `wrap` moves or shards it."""
        from minidist import models

        return models.load_model(name_or_path)

    def checkpoint_activations(self, model: nn.Module) -> None:
        """Recompute each decoder layer in backward (`--gradient_checkpointing`): transformers' own."""
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def wrap(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The Hugging Face model inside the wrapper (for `save_pretrained`, `config`)."""
        return model

    def build_optimizer(self, model, lr, weight_decay=0.0):
        # Frozen parameters get no optimizer state at all: that is where LoRA saves its memory.
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)

    def no_sync(self, model):
        """Inside this context backward only accumulates local gradients: no communication."""
        return nullcontext()

    def autocast(self):
        """The compute precision of forward and backward (parameters stay fp32 masters)."""
        return nullcontext()

    def comm_bytes(self) -> float | None:
        """Bytes this rank sent for gradients and parameters since the last call, counted by
        `comm.py` under the ring algorithm; None where PyTorch does the communication itself."""
        return None

    def clip_grad_norm_(self, model, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def full_state_dict(self, model) -> dict | None:
        """The whole model's weights on rank 0, on the CPU (None on other ranks). Every rank calls it."""
        raise NotImplementedError

    def get_state_dict(self, model, optimizer, full: bool) -> tuple[dict, dict]:
        """The model's and the optimizer's state for a checkpoint (`state.py`), keyed by parameter name.

        full=True: whole tensors on rank 0's CPU, empty dicts elsewhere. full=False: each rank's
        own shards (DTensors where sharded), which DCP writes in parallel and reshards on load.
        PyTorch's helpers handle plain modules, DDP and FSDP2; a strategy that shards by hand
        (ZeRO, FSDP) overrides this and `set_state_dict` to hand out and take back its shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=full, cpu_offload=full)
        return get_state_dict(self.unwrap(model), optimizer, options=options)

    def set_state_dict(self, model, optimizer, model_state_dict, optim_state_dict, full: bool) -> None:
        """Load what `get_state_dict` gave; full=True: rank 0 holds it and broadcasts, the others pass {}."""
        from torch.distributed.checkpoint import state_dict as dsd

        options = dsd.StateDictOptions(full_state_dict=full, broadcast_from_rank0=full)
        # Two calls, not set_state_dict: it would take the empty model dict of ranks > 0 to mean
        # "optimizer only", and those ranks would skip the broadcasts rank 0 sends.
        dsd.set_optimizer_state_dict(self.unwrap(model), optimizer, optim_state_dict, options=options)
        dsd.set_model_state_dict(self.unwrap(model), model_state_dict, options=options)


class TorchDDP(Strategy):
    """PyTorch's DistributedDataParallel: every rank holds everything; gradients all-reduced."""

    def wrap(self, model):
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(self.env.device)
        device_ids = [self.env.device.index] if self.env.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    def unwrap(self, model):
        return model.module

    def no_sync(self, model):
        return model.no_sync()

    def autocast(self):
        # Automatic mixed precision: fp32 weights, matmuls in bf16, gradients and all-reduce in fp32.
        if self.mixed_precision == "bf16":
            return torch.autocast(self.env.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def full_state_dict(self, model):
        if not self.env.is_main:
            return None
        return {k: v.detach().cpu() for k, v in model.module.state_dict().items()}


class Minidist(Strategy):
    """What every hand-written strategy shares: its collectives are counted (`comm.py`), its
    mixed precision is `precision.py`'s policy, and `--gradient_checkpointing` is
    `activation_checkpointing.py`'s, one decoder layer at a time."""

    def __init__(self, env, mixed_precision="fp32", layer_wrap_policy=True, reduce_dtype=None, bucket_cap_mb=25.0):
        super().__init__(env, mixed_precision, layer_wrap_policy)
        self.mp = precision.policy(mixed_precision, reduce_dtype)
        if bucket_cap_mb <= 0:
            raise ValueError(f"--bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.bucket_cap_mb = bucket_cap_mb

    def checkpoint_activations(self, model):
        from minidist.activation_checkpointing import checkpoint_layers

        checkpoint_layers(model, wrap_policy_classes(model))

    def comm_bytes(self):
        from minidist import comm

        sent = comm.counter.bytes_sent
        comm.counter.reset()
        return sent


class MinidistDDP(Minidist, TorchDDP):
    """The hand-written DDP of `ddp.py`: bucketed with overlap, or naive (`--ddp_variant naive`).

    Everything but `wrap` is as for PyTorch's DDP: the wrapper keeps the model in `.module` and
    has a `no_sync()`, so unwrapping, autocast and saving are the same."""

    def __init__(self, env, mixed_precision="fp32", layer_wrap_policy=True, reduce_dtype=None, bucket_cap_mb=25.0,
                 ddp_variant="bucketed"):
        super().__init__(env, mixed_precision, layer_wrap_policy, reduce_dtype, bucket_cap_mb)
        if ddp_variant not in DDP_VARIANTS:
            raise ValueError(f"unknown --ddp_variant {ddp_variant!r}: choose from {DDP_VARIANTS}")
        self.ddp_variant = ddp_variant

    def wrap(self, model):
        from minidist import ddp

        model = model.to(self.env.device)
        # DDP's gradients have the fp32 parameters' dtype (fp64 in a test): reduced as they are,
        # unless --reduce_dtype bf16 asks for half the bytes.
        reduce_dtype = precision.reduction_dtype(next(model.parameters()).dtype, self.mp)
        if self.ddp_variant == "naive":
            return ddp.NaiveDDP(model, reduce_dtype=reduce_dtype)
        return ddp.BucketedDDP(model, bucket_cap_mb=self.bucket_cap_mb, reduce_dtype=reduce_dtype)


class MinidistSharded(Minidist):
    """ZeRO-1, ZeRO-2 and FSDP by hand (`zero.py`, `fsdp.py`): the wrapper steps, clips and saves
    its own shards. Its parameters carry the compute dtype, so no autocast is needed."""

    def unwrap(self, model):
        return model.module

    def build_optimizer(self, model, lr, weight_decay=0.0):
        return model.build_optimizer(lr, weight_decay)

    def no_sync(self, model):
        return model.no_sync()

    def clip_grad_norm_(self, model, max_norm):
        return model.clip_grad_norm_(max_norm)

    def full_state_dict(self, model):
        full = model.full_parameters()  # every rank takes part in the gathers
        return {k: v.detach().cpu().clone() for k, v in full.items()} if self.env.is_main else None

    def get_state_dict(self, model, optimizer, full):
        from minidist import sharded_state

        return sharded_state.get_state_dict(model, optimizer, full, self.env)

    def set_state_dict(self, model, optimizer, model_state_dict, optim_state_dict, full):
        from minidist import sharded_state

        sharded_state.set_state_dict(model, optimizer, model_state_dict, optim_state_dict, full, self.env)


class MinidistZero(MinidistSharded):
    """ZeRO stage 1 (`--strategy zero1`) or 2 (`zero2`)."""

    def __init__(self, env, stage, **kwargs):
        super().__init__(env, **kwargs)
        self.stage = stage

    def wrap(self, model):
        from minidist.zero import ZeroDP

        return ZeroDP(model.to(self.env.device), self.stage, self.mp, self.bucket_cap_mb)


class MinidistFSDP(MinidistSharded):
    """FSDP (ZeRO-3) by hand: one unit per decoder layer and the root, or one unit in all."""

    def load_model(self, name_or_path):
        """Only rank 0 reads the weights; the others build the model on the meta device (shapes,
        no memory) and receive their shards when `wrap` scatters them."""
        if self.env.rank == 0:
            return super().load_model(name_or_path)
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(name_or_path), dtype=torch.float32)

    def wrap(self, model):
        from minidist.fsdp import FullyShardedDataParallel

        classes = wrap_policy_classes(model) if self.layer_wrap_policy else ()
        return FullyShardedDataParallel(model, classes, self.mp, device=self.env.device)


def wrap_policy_classes(model: nn.Module) -> set[str]:
    """The layer classes that become FSDP units: the model's repeated blocks.

    Hugging Face models list them in `_no_split_modules` (`LlamaDecoderLayer`, `GPT2Block`),
    the same list `accelerate` uses to place whole blocks on one device.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise ValueError(f"{type(model).__name__} names no layer class in _no_split_modules; use --no_layer_wrap_policy")
    return names


class TorchFSDP(Strategy):
    """PyTorch's FSDP2 (`fully_shard`): one unit per decoder layer, then the root for the rest."""

    def wrap(self, model):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = device_mesh()
        mp = None
        if self.mixed_precision == "bf16":
            # Parameters are all-gathered in bf16, gradients reduce-scattered in fp32.
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kwargs = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
        if self.layer_wrap_policy:
            classes = wrap_policy_classes(model)
            for module in model.modules():
                if type(module).__name__ in classes:
                    fully_shard(module, **kwargs)
        # The root unit holds what is left (embeddings, final norm, output layer). fully_shard
        # moves each shard onto the mesh's device, so the full model never sits on one GPU.
        fully_shard(model, **kwargs)
        return model

    @contextmanager
    def no_sync(self, model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def full_state_dict(self, model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Gathers one tensor at a time to rank 0's CPU memory: no GPU ever holds the whole model.
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)
        return state if self.env.is_main else None


def get_strategy(name: str, impl: str, env, mixed_precision="fp32", layer_wrap_policy=True, **options) -> Strategy:
    """Pick a strategy by name and implementation; say in one line if it is not built yet.

    `options` go to the hand-written strategies: `reduce_dtype` (all of them), `bucket_cap_mb`
    (DDP, ZeRO) and `ddp_variant` (DDP)."""
    if name not in STRATEGIES or impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown strategy {impl}/{name}: choose --strategy from {STRATEGIES}, --impl from {IMPLEMENTATIONS}")
    if impl == "torch" and name in ("zero1", "zero2"):
        raise NotImplementedError(f"PyTorch has no {name} of its own (its ZeroRedundancyOptimizer is ZeRO-1 "
                                  f"for DDP only): use --impl minidist --strategy {name}")
    only = {"ddp_variant": ("ddp",), "bucket_cap_mb": ("ddp", "zero1", "zero2"), "reduce_dtype": STRATEGIES}
    for key in options:
        if impl != "minidist" or name not in only[key]:
            where = " or ".join(only[key])
            raise ValueError(f"--{key} only applies to --impl minidist with --strategy {where}, not {impl}/{name}")
    kwargs = {"mixed_precision": mixed_precision, "layer_wrap_policy": layer_wrap_policy, **options}
    if impl == "torch":
        return {"ddp": TorchDDP, "fsdp": TorchFSDP}[name](env, mixed_precision, layer_wrap_policy)
    if name == "ddp":
        return MinidistDDP(env, **kwargs)
    if name == "fsdp":
        return MinidistFSDP(env, **kwargs)
    return MinidistZero(env, stage=int(name[-1]), **kwargs)
