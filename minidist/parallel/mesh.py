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

ZeRO and FSDP (`--strategy fsdp`) shard over every rank (replicate 1), and DDP all-reduces over
every rank. HSDP (`--strategy hsdp`) gives both dimensions a size: S ranks shard one copy
(`--hsdp_shard_size`, by default the ranks of a node) and R = N / S copies replicate it. Ranks of
a node are consecutive under torchrun and SLURM, so the ranks are laid out as an R x S grid, row j
the node j: shard group j = ranks [jS, (j+1)S), which talk over NVLink inside a node, and
replicate group i = ranks {i, i+S, i+2S, ...}, one per node, which talk over the slower network
between nodes. The grid is a 2-D `DeviceMesh` (`init_device_mesh(device, (R, S),
mesh_dim_names=("dp_replicate", "dp_shard"))`), and both groups are taken from it: the
hand-written FSDP and PyTorch's FSDP2 then run on the same groups.

**Tensor parallelism** (`--tp_size T`, lesson 11: `tensor/`) adds a dimension inside the data one:
T consecutive ranks (of one node, where NVLink joins them) cut each layer's matrices among
themselves and see the same batch, and the data-parallel dimension runs across these groups. The
ranks are a D x T grid, `("dp_shard", "tp")`: tensor-parallel group i = ranks [iT, (i+1)T), and
data-parallel group j = ranks {j, j+T, j+2T, ...}, the ranks holding the same slices. Every field
below is then the data-parallel one (D ranks), and `tp_group` holds the other.

**Pipeline parallelism** (`--pp_size P`, lesson 12: `pipeline/`) adds a dimension outside both:
the ranks are a P x D x T grid, `("pp", "dp_shard", "tp")`, rank = stage x D x T + d x T + t, as
torchtitan orders its mesh (pipeline outermost). Stage s holds ranks [sDT, (s+1)DT): with 4 GPUs a
node and P = 2 on 2 nodes, each node holds one stage, and only the activations between the stages
cross the network. The pipeline group of a rank holds the P ranks at its (d, t) place, one per
stage; every field below is then its stage's data-parallel one, and `pp_group` holds the other.
All stages of a pipeline read the same micro-batches (`pipeline/stages.py`).

This object is where the choice is made, and every piece of the run reads its groups from it:
the loop (how the batch is split), both FSDPs and ZeRO (`shard_group`, `replicate_group`), DDP
(`group`) and the checkpoints (`shard_device_mesh`, `placements`). The byte counter does not
read it: each collective counts by the size of the group it runs over (`comm.py`), and which
ring links cross nodes comes from the ranks per node, `LOCAL_WORLD_SIZE` (`across_nodes.py`).
"""

from dataclasses import dataclass

import torch.distributed as dist

MESH_DIM_NAMES = ("dp_replicate", "dp_shard")  # torchtitan's names, outer dimension first


@dataclass(frozen=True)
class Mesh:
    """This run's process groups, named by dimension (see the module docstring): the data-parallel
    ones (`group`, `shard_group`, `replicate_group`, with this rank's `dp_rank` among `dp_size`),
    and the tensor- and pipeline-parallel ones where the run has them."""

    group: dist.ProcessGroup  # every data-parallel rank: DDP all-reduces over it
    shard_group: dist.ProcessGroup  # the ranks that split the model states (ZeRO, FSDP)
    dp_rank: int  # this rank's index among the data-parallel ranks (not its global rank)
    dp_size: int  # data-parallel ranks: shard_size x replicate_size
    shard_size: int
    replicate_size: int = 1  # > 1 is HSDP
    replicate_group: dist.ProcessGroup | None = None  # HSDP: the ranks holding the same shard, one per node
    tp_size: int = 1  # > 1: tensor parallelism (tensor/), over tp_group
    tp_group: dist.ProcessGroup | None = None  # the ranks that cut each layer among themselves, on the same batch
    pp_size: int = 1  # > 1: pipeline parallelism (pipeline/), over pp_group
    pp_group: dist.ProcessGroup | None = None  # the stages of this rank's pipeline, one rank each, in order
    device_type: str = "cpu"  # where the ranks compute: the DeviceMeshes below are built on it

    @property
    def pp_rank(self) -> int:
        """This rank's stage; 0 without a pipeline."""
        return 0 if self.pp_group is None else dist.get_rank(self.pp_group)

    @property
    def tp_rank(self) -> int:
        """This rank's place in its tensor-parallel group; 0 without tensor parallelism."""
        return 0 if self.tp_group is None else dist.get_rank(self.tp_group)

    @property
    def shard_rank(self) -> int:
        return dist.get_rank(self.shard_group)

    @property
    def replicate_rank(self) -> int:
        """Which copy this rank belongs to (its node, under HSDP); 0 without replicas."""
        return 0 if self.replicate_group is None else dist.get_rank(self.replicate_group)

    def shard_device_mesh(self):
        """What FSDP2 and DCP's DTensors are placed on: the 1-D mesh of the shard dimension, or
        under HSDP the 2-D (replicate, shard) mesh, on which FSDP2 replicates along dim 0 and
        shards along dim 1."""
        if self.tp_group is not None or self.pp_group is not None:  # the data-parallel dimension of the grid
            return self.grid()["dp_shard"]
        if self.replicate_group is None:
            return device_mesh(self.device_type)
        return device_mesh(self.device_type, (self.replicate_size, self.shard_size), MESH_DIM_NAMES)

    def tp_device_mesh(self):
        """PyTorch's tensor parallelism (`tensor/reference.py`): the tensor-parallel dimension of the
        (dp, tp) grid, as a `DeviceMesh`."""
        return self.grid()["tp"]

    def grid(self):
        """The (pp, dp_shard, tp) grid of the module docstring as a `DeviceMesh`, without the
        dimensions of size 1 where there is no pipeline, or no tensor parallelism."""
        return _grid(self.device_type, self.pp_size, self.dp_size, self.tp_size)

    def placements(self) -> tuple:
        """How a flat shard sits on `shard_device_mesh()`: Shard(0), and Replicate() first under
        HSDP (every copy holds the same shards: DCP writes one of them and reads into all)."""
        from torch.distributed.tensor import Replicate, Shard

        return (Shard(0),) if self.replicate_group is None else (Replicate(), Shard(0))


_device_meshes = {}  # (device type, shape, names) -> DeviceMesh, built once: every rank asks in the same order


def device_mesh(device_type: str, shape: tuple[int, ...] | None = None, names: tuple[str, ...] | None = None):
    """A ``DeviceMesh`` of all ranks for FSDP2 and DCP, 1-D by default (HSDP's is 2-D), on
    `device_type` ("cuda", or "cpu" for gloo's ranks); made once per device type and shape, and
    released by `release_device_meshes` when the run leaves its process group."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = shape or (dist.get_world_size(),)
    key = device_type, shape, names  # a 2 x 2 grid is (pp, dp_shard) or (dp_shard, tp): named apart
    if key not in _device_meshes:
        _device_meshes[key] = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return _device_meshes[key]


def release_device_meshes() -> None:
    """Forget every mesh built, and the process groups each holds (before the process group is destroyed)."""
    for mesh in _device_meshes.values():
        # A private field: the mesh outlives us in DTensor's caches. Older meshes (torch 2.6) keep
        # the groups' names only (`_dim_group_infos`), not the groups: nothing to let go of there.
        registry = getattr(mesh, "_pg_registry", None)
        if registry is not None:
            registry.clear()
    _device_meshes.clear()


def _grid(device_type: str, pp_size: int, dp_size: int, tp_size: int):
    dims = [(n, name) for n, name in ((pp_size, "pp"), (dp_size, "dp_shard"), (tp_size, "tp"))
            if n > 1 or name == "dp_shard"]
    return device_mesh(device_type, tuple(n for n, _ in dims), tuple(name for _, name in dims))


def build_mesh(shard_size: int | None = None, tp_size: int = 1, pp_size: int = 1, device_type: str = "cpu") -> Mesh:
    """This run's groups over every rank of the process group (which must be initialised), the
    ranks computing on `device_type`. Without tp or pp every rank is a data-parallel rank.

    shard_size None: ZeRO and FSDP shard over all of them. Otherwise HSDP: groups of `shard_size`
    consecutive ranks shard, and the ranks at the same place in each group replicate. tp_size > 1
    (not with HSDP): groups of `tp_size` consecutive ranks are tensor-parallel, and the data-parallel
    ranks are one per group (the module docstring's grid). pp_size > 1 (not with HSDP): the ranks
    are cut into pp_size stages of consecutive ranks, each stage such a (dp, tp) grid."""
    world = dist.group.WORLD
    size, rank = dist.get_world_size(world), dist.get_rank(world)
    if tp_size > 1 or pp_size > 1:
        return _model_parallel_mesh(size, rank, tp_size, pp_size, device_type)
    if shard_size is None:
        return Mesh(group=world, shard_group=world, dp_rank=rank, dp_size=size, shard_size=size, device_type=device_type)
    if shard_size < 1 or size % shard_size:
        raise ValueError(f"--hsdp_shard_size must divide the {size} ranks into equal groups, got {shard_size}")
    mesh = device_mesh(device_type, (size // shard_size, shard_size), MESH_DIM_NAMES)  # every rank builds every group
    return Mesh(group=world, shard_group=mesh.get_group("dp_shard"), dp_rank=rank, dp_size=size,
                shard_size=shard_size, replicate_size=size // shard_size,
                replicate_group=mesh.get_group("dp_replicate"), device_type=device_type)


def _model_parallel_mesh(size: int, rank: int, tp_size: int, pp_size: int, device_type: str) -> Mesh:
    """The (pp, dp, tp) grid's groups for this rank (module docstring)."""
    if size % (tp_size * pp_size):
        what = "tensor-parallel groups" if pp_size == 1 else ("pipeline stages" if tp_size == 1 else
                                                               "pipeline stages of equal tensor-parallel groups")
        flags = " x ".join(f"--{name} {n}" for name, n in (("pp_size", pp_size), ("tp_size", tp_size)) if n > 1)
        raise ValueError(f"{flags} must divide the {size} ranks into equal {what}")
    dp_size = size // (tp_size * pp_size)
    mesh = _grid(device_type, pp_size, dp_size, tp_size)
    dp_group = mesh.get_group("dp_shard")
    return Mesh(group=dp_group, shard_group=dp_group, dp_rank=(rank // tp_size) % dp_size, dp_size=dp_size,
                shard_size=dp_size, tp_size=tp_size, tp_group=mesh.get_group("tp") if tp_size > 1 else None,
                pp_size=pp_size, pp_group=mesh.get_group("pp") if pp_size > 1 else None, device_type=device_type)
