"""The process-group layout: which ranks split the model states, and which hold copies of them.

Data parallelism has two dimensions (PyTorch's "hybrid sharding", HSDP: Zhao et al. 2023, "PyTorch
FSDP", section 3.2.2; torchtitan calls them `dp_shard` and `dp_replicate`):

- **shard**: the ranks that split the model states among themselves. ZeRO and FSDP
  reduce-scatter gradients and all-gather weights over this group, and a sharded checkpoint is
  cut along it.
- **replicate**: how many groups hold the same shards. Gradients are then also all-reduced across
  them. DDP is the extreme case: nothing is split and every rank is a copy.

Every rank sees its own micro-batches whatever the layout, so the global batch is split over
all `size = shard_size x replicate_size` data-parallel ranks.

Today each strategy uses one dimension over the whole world: ZeRO and FSDP shard over every
rank (replicate 1), and DDP all-reduces over every rank. HSDP, which shards within a node and
replicates across nodes (NVLink inside, the slower network between), would give both
dimensions a size above 1; this object is where that choice is made, and every piece of the run
reads its groups from it: the loop (how the batch is split), both FSDPs and ZeRO (`shard_group`),
DDP (`group`), the byte counter (each collective counts by the size of its own group) and the
checkpoints (`shard_device_mesh`).
"""

from dataclasses import dataclass

import torch.distributed as dist

from minidist.distributed import device_mesh


@dataclass(frozen=True)
class DataParallelMesh:
    """The data-parallel ranks of this run, named by dimension (see the module docstring)."""

    group: dist.ProcessGroup  # every data-parallel rank: DDP all-reduces over it
    shard_group: dist.ProcessGroup  # the ranks that split the model states (ZeRO, FSDP)
    rank: int  # this rank's index among the data-parallel ranks
    size: int  # data-parallel ranks: shard_size x replicate_size
    shard_size: int
    replicate_size: int = 1  # > 1 is HSDP: not built yet

    @property
    def shard_rank(self) -> int:
        return dist.get_rank(self.shard_group)

    def shard_device_mesh(self):
        """The shard dimension as a 1-D `DeviceMesh`: what FSDP2 and DCP's DTensors are placed on."""
        if self.shard_group is not dist.group.WORLD:
            raise NotImplementedError("a shard group smaller than the world (HSDP) is not built yet")
        return device_mesh()


def data_parallel_mesh() -> DataParallelMesh:
    """Today's layout: every rank of the process group is a data-parallel rank, and ZeRO and FSDP
    shard over all of them (init_distributed must have run)."""
    world = dist.group.WORLD
    size = dist.get_world_size(world)
    return DataParallelMesh(group=world, shard_group=world, rank=dist.get_rank(world), size=size, shard_size=size)
