"""The parallel options of a run, in one place: one dataclass, built once from the command line.

    options = ParallelOptions.from_args(args)   # finetune.py, after ParallelOptions.add_arguments(parser)
    strategy = get_strategy(options, env)       # strategy/ reads it
    estimate(shape, Setup(options=options, ...))  # memory/estimator.py reads the same object

Each field is one flag of `python -m minidist.finetune`. Its metadata says what the flag's help
is, which values it takes, and which strategies it applies to; `add_arguments` and `check` read
that, so **adding an option touches its field here and the code that uses it**, nothing else.

The options that only the hand-written strategies have (`reduce_dtype`, `bucket_cap_mb`,
`ddp_variant`) default to None, "not given": a learner who gives one where it does nothing (to
PyTorch's FSDP, say) is told so, instead of being silently ignored. `value` reads an option
with its default filled in.

Hybrid sharding is `--strategy hsdp` with `--hsdp_shard_size N` (the ranks that shard one copy,
by default the ranks of a node: `mesh.build_mesh` builds the groups). `cpu_offload`
(ZeRO-Offload: `offload.py`) applies to the strategies that shard the optimizer states, by hand
or PyTorch's FSDP2 (its `CPUOffloadPolicy`); DDP has no shard to put on the host.

`tp_size` and `sequence_parallel` cut each layer over ranks that see the same batch (lesson 11);
`pp_size` and `pp_schedule` cut the model by depth into stages, the accumulation steps becoming the
pipeline's micro-batches (lesson 12). Each composes with the data-parallel strategies its list names
(`TENSOR_PARALLEL_WITH`, `PIPELINE_WITH`); the rest is refused in one line.

`accumulate_sharded` chooses how micro-batches accumulate where gradients are sharded (ZeRO-2,
FSDP, HSDP, by hand or FSDP2): by default under `no_sync`, each rank keeping full-size gradients
until the last micro-batch; with it, each micro-batch is reduce-scattered and only the shard's sum
is kept (`strategy/base.Strategy.no_sync` says why, and what it costs). ZeRO-1 and DDP keep full
gradients anyway: there it would mean nothing, and is refused.
"""

import argparse
import math
from dataclasses import dataclass, field, fields

from minidist.runtime import torch_features

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")  # over one group of all the ranks (lesson 00's tables go over these)
HYBRID = ("hsdp",)  # FSDP within each node, its copies across nodes (mesh.py)
IMPLEMENTATIONS = ("minidist", "torch")
DTYPES = ("fp32", "bf16")
DDP_VARIANTS = ("bucketed", "naive")
EVERY = ("minidist", "torch"), STRATEGIES + HYBRID  # (implementations, strategies) an option applies to
# What tensor parallelism (lesson 11) composes with over the data-parallel dimension, so far.
TENSOR_PARALLEL_WITH = ("minidist/ddp", "minidist/fsdp", "torch/fsdp")
# What pipeline parallelism (lesson 12) composes with over the data-parallel dimension, so far. The
# hand-written FSDP's units are gathered again by each micro-batch's backward (fsdp.py, "Under a pipeline").
PIPELINE_WITH = ("minidist/ddp", "minidist/zero1", "minidist/fsdp", "torch/fsdp")
PIPELINE_SCHEDULES = ("gpipe", "1f1b")  # pipeline/schedules.py

# AdamW's hyper-parameters besides the learning rate and weight decay (the flags): betas as in
# Llama's pretraining (Touvron et al. 2023, section 2.2). Every optimizer here is built with them,
# and with the multi-tensor ("foreach") implementation, which PyTorch picks by default on a GPU
# only: on the CPU too it then makes the temporaries a GPU would (`memory/estimator.py` counts
# them), with the same numbers, bit for bit, as the one-tensor-at-a-time loop.
ADAMW_BETAS = (0.9, 0.95)
ADAMW_OPTIONS = {"betas": ADAMW_BETAS, "foreach": True}


def _option(default, help, choices=None, applies=EVERY, flag_type=None):
    return field(default=default, metadata={"help": help, "choices": choices, "applies": applies, "type": flag_type})


@dataclass(frozen=True)
class ParallelOptions:
    """How the model is spread over the ranks and how it computes: every parallel option of a run."""

    strategy: str = _option("fsdp", "how the model states are spread over the ranks", STRATEGIES + HYBRID)
    impl: str = _option("torch", "minidist (by hand) or torch (PyTorch's own, the reference)", IMPLEMENTATIONS)
    layer_wrap_policy: bool = _option(True, "FSDP: one unit per decoder layer (off: the whole model is one unit)",
                                      applies=(IMPLEMENTATIONS, ("fsdp", "hsdp")))
    hsdp_shard_size: int | None = _option(None, "HSDP: the ranks that shard one copy (default: the ranks per node)",
                                          applies=(IMPLEMENTATIONS, ("hsdp",)), flag_type=int)
    mixed_precision: str = _option("fp32", "the compute dtype of forward and backward (masters stay fp32)", DTYPES)
    gradient_checkpointing: bool = _option(False, "recompute each decoder layer in backward instead of saving it")
    reduce_dtype: str | None = _option(None, "the dtype gradients are summed in", DTYPES,
                                       (("minidist",), STRATEGIES + HYBRID))
    bucket_cap_mb: float | None = _option(None, "gradient bucket size in MB",
                                          applies=(("minidist",), ("ddp", "zero1", "zero2")), flag_type=float)
    ddp_variant: str | None = _option(None, "bucketed or naive", DDP_VARIANTS, (("minidist",), ("ddp",)))
    cpu_offload: bool = _option(False, "ZeRO-Offload: fp32 masters, optimizer states and the step in host memory, "
                                "on the CPU (not with ddp)")
    accumulate_sharded: bool = _option(False, "with accumulation: reduce-scatter every micro-batch and keep only the "
                                       "shard's gradient, instead of full gradients under no_sync",
                                       applies=(IMPLEMENTATIONS, ("zero2", "fsdp", "hsdp")))
    tp_size: int = _option(1, "tensor parallelism: each layer's matrices cut over this many ranks, which see the "
                           "same batch (lesson 11)", flag_type=int)
    sequence_parallel: bool = _option(False, "with --tp_size: the norms and the residual stream cut along the "
                                      "sequence between the blocks")
    pp_size: int = _option(1, "pipeline parallelism: the decoder layers cut into this many stages, one per rank, "
                           "the micro-batches (--gradient_accumulation_steps) streamed through them (lesson 12)",
                           flag_type=int)
    pp_schedule: str | None = _option(None, "with --pp_size: the order of each stage's forwards and backwards",
                                      PIPELINE_SCHEDULES)

    DEFAULTS = {"reduce_dtype": "fp32", "bucket_cap_mb": 25.0, "ddp_variant": "bucketed", "pp_schedule": "1f1b"}

    def value(self, name: str):
        """The option as the strategy uses it: what was given, or its default."""
        given = getattr(self, name)
        return self.DEFAULTS.get(name) if given is None else given

    @property
    def name(self) -> str:
        return f"{self.impl}/{self.strategy}"

    def check(self) -> "ParallelOptions":
        """Raise ValueError (one line, naming the flag) for a value or a combination that cannot run."""
        for f in fields(self):
            value, choices = getattr(self, f.name), f.metadata["choices"]
            if choices and value is not None and value not in choices:
                raise ValueError(f"--{f.name} must be one of {', '.join(choices)}, got {value!r}")
        if self.impl == "torch" and self.strategy in ("zero1", "zero2"):
            raise NotImplementedError(f"PyTorch has no {self.strategy} of its own (its ZeroRedundancyOptimizer is "
                                      f"ZeRO-1 for DDP only): use --impl minidist --strategy {self.strategy}")
        for f in fields(self):
            impls, strategies = f.metadata["applies"]
            given = getattr(self, f.name) is not None if f.default is None else (
                f.default is False and getattr(self, f.name))  # an on/off flag turned on
            if given and (self.impl not in impls or self.strategy not in strategies):
                raise ValueError(f"--{f.name} only applies to --impl {' or '.join(impls)} with --strategy "
                                 f"{' or '.join(strategies)}, not {self.name}")
        if self.hsdp_shard_size is not None and self.hsdp_shard_size < 1:
            raise ValueError(f"--hsdp_shard_size must be at least 1, got {self.hsdp_shard_size}")
        if self.cpu_offload and self.strategy == "ddp":
            raise ValueError(f"--cpu_offload needs sharded optimizer states, which {self.name} does not have: use "
                             f"--impl minidist --strategy zero1 or zero2, or --strategy fsdp (either --impl)")
        if self.bucket_cap_mb is not None and not 0 < self.bucket_cap_mb < math.inf:  # NaN too: no bucket ever fills
            raise ValueError(f"--bucket_cap_mb must be a positive, finite number of MB, got {self.bucket_cap_mb}")
        self._check_tensor_parallel()
        self._check_pipeline()
        return self

    def _check_tensor_parallel(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"--tp_size must be at least 1, got {self.tp_size}")
        if self.sequence_parallel and self.tp_size == 1:
            raise ValueError("--sequence_parallel cuts the sequence over the tensor-parallel ranks: it needs "
                             "--tp_size 2 or more")
        if self.tp_size > 1 and self.name not in TENSOR_PARALLEL_WITH:
            raise ValueError(f"--tp_size composes with {' or '.join(TENSOR_PARALLEL_WITH)} over the data-parallel "
                             f"ranks, not {self.name}")
        if self.tp_size > 1 and self.cpu_offload:
            raise ValueError("--cpu_offload with --tp_size has not been built: use one or the other")

    def _check_pipeline(self) -> None:
        if self.pp_size < 1:
            raise ValueError(f"--pp_size must be at least 1, got {self.pp_size}")
        if self.pp_schedule is not None and self.pp_size == 1:
            raise ValueError("--pp_schedule orders the stages of a pipeline: it needs --pp_size 2 or more")
        if self.pp_size == 1:
            return
        if self.name not in PIPELINE_WITH:
            raise ValueError(f"--pp_size composes with {' or '.join(PIPELINE_WITH)} over the data-parallel ranks, "
                             f"not {self.name}")
        # accumulate_sharded: PyTorch's schedule decides itself which backward reduce-scatters; the hand-written
        # FSDP's sharded accumulation under a pipeline has not been tried.
        for flag in ("sequence_parallel", "cpu_offload", "accumulate_sharded"):
            if getattr(self, flag):
                raise ValueError(f"--{flag} with --pp_size has not been built: use one or the other")
        if self.impl == "torch":  # PyTorch's schedules: their scale_grads, which torch 2.6's lack
            torch_features.require("pipeline_scale_grads")

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """One flag per field: `--strategy`, `--no_layer_wrap_policy` for a True flag, `--gradient_checkpointing`."""
        for f in fields(ParallelOptions):
            help, choices = f.metadata["help"], f.metadata["choices"]
            if f.name in ParallelOptions.DEFAULTS:  # None means "not given"; the help says what that is
                help += f" (default {ParallelOptions.DEFAULTS[f.name]})"
            if f.default is True:
                parser.add_argument(f"--no_{f.name}", dest=f.name, action="store_false", help=help)
            elif f.default is False:
                parser.add_argument(f"--{f.name}", action="store_true", help=help)
            else:
                parser.add_argument(f"--{f.name}", default=f.default, choices=choices, help=help,
                                    type=f.metadata["type"] or str)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ParallelOptions":
        """The options from parsed flags (`add_arguments`), checked."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)}).check()
