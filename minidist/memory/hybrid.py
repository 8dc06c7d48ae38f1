"""HSDP in the memory estimate: FSDP over one shard group, plus the all-reduce across the copies.

Hybrid sharding (`--strategy hsdp`, `parallel/mesh.py`) shards the model states over the S ranks
of a shard group and keeps R = N / S copies of them (Zhao et al. 2023, "PyTorch FSDP", section
3.2.2). A rank therefore holds exactly what FSDP on S ranks holds: 16P/S bytes of model states
(fp32 shard, its gradient, AdamW's two moments), the same gathered units, the same activations
(its micro-batch does not depend on the layout). So the estimate of hsdp with S ranks per copy
is the estimate of fsdp on S ranks (`as_fsdp`), plus one term:

- **the replicate all-reduce.** After a unit's reduce-scatter, its gradient shard (in the
  reduce dtype, fp32 by default) is all-reduced across the R copies. The hand-written FSDP
  (`parallel/unit.py`) keeps that shard alive while the next unit's backward computes and waits
  for it then, one unit after its reduce-scatter output would have been let go: one more shard
  of the largest unit, 4 x ceil(unit / S) bytes in fp32, alive in backward (the `backward`
  moment). PyTorch's FSDP2 all-reduces its reduce-scatter output likewise, one unit at a time.

Without `--hsdp_shard_size` the estimate assumes all `--world_size` ranks on one node (S = N,
no copies): the estimator does not know the ranks per node the loop reads from its launcher.
"""

import math
from dataclasses import replace


def shard_size(setup) -> int:
    """S: the ranks that shard one copy (`--hsdp_shard_size`, else every rank), checked."""
    s = setup.options.hsdp_shard_size or setup.world_size
    if setup.world_size % s:
        raise ValueError(f"--hsdp_shard_size must divide the {setup.world_size} ranks into equal groups, got {s}")
    return s


def as_fsdp(setup):
    """The FSDP setup on S ranks whose memory per rank an HSDP setup has (any other setup unchanged)."""
    if setup.options.strategy != "hsdp":
        return setup
    options = replace(setup.options, strategy="fsdp", hsdp_shard_size=None)
    return replace(setup, options=options, world_size=shard_size(setup))


def all_reduce_buffer(shape, setup) -> int:
    """Bytes of the gradient shard the replicate all-reduce keeps alive in backward (0 without copies),
    for `shape`, the shape of what is trained (LoRA: the adapters' units, `lora_terms.trained_shape`)."""
    if setup.options.strategy != "hsdp" or shard_size(setup) == setup.world_size:
        return 0
    wrapped = setup.options.layer_wrap_policy and shape.layer_params
    unit = max(shape.root_params, shape.layer_params) if wrapped else shape.num_params
    reduce_bytes = 2 if setup.options.value("reduce_dtype") == "bf16" else 4
    return reduce_bytes * math.ceil(unit / shard_size(setup))


def add_all_reduce(at: dict, extra: int) -> dict:
    """The moments of `moments.py` with the all-reduce's shard alive in backward (if there is one)."""
    if extra:
        at["backward"]["replicate all-reduce"] = extra
    return at
