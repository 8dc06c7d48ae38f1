"""Checkpoints of flat shards: the hand-written ZeRO's and FSDP's side of `state.py`.

`state.py` saves whatever `strategy.get_state_dict` hands it, in two forms. For ZeRO and FSDP
by hand, what a rank holds is a list of flat fp32 shards (ZeRO's buckets, FSDP's units, each laid
out by a `flat.FlatLayout`), which the wrapper hands out with `flats()`, and AdamW's moments for
them. This module turns them into the two forms:

- *full*: every flat is all-gathered; rank 0 gets the weights by their original names (a
  `from_pretrained` folder), and the moments as whole flat tensors, one per flat, unpadded;
- *sharded*: each rank's shard becomes a `DTensor` (`torch.distributed.tensor`) of the whole
  flat, placed `Shard(0)` on the shard dimension of the mesh (`mesh.py`). DCP then writes each
  rank's piece and records where it sits, so another number of ranks reads back the slices it
  owns. For this to line up, a flat is cut as `torch.chunk` cuts: ceil(numel / N) elements per
  rank, the last ones shorter (the zero padding is not saved), which is exactly `FlatLayout`'s.
  Under HSDP the shard is placed (Replicate(), Shard(0)) on the 2-D (replicate, shard) mesh.

Loading reverses it: the full form scatters the flats from rank 0; the sharded form lets DCP fill
the DTensors, which are views of the shards themselves, wherever they live (a `--cpu_offload` run's
on the host), and copies them into the shards (a no-op for those views). Then `refresh_weights()`:
ZeRO's model all-gathers its weights from the loaded masters; FSDP's does nothing, as it gathers
them before every use.
"""

import torch
import torch.distributed as dist

from minidist.parallel.flat import gather_flat, scatter_flat
from minidist.parallel.comm import broadcast_from_first_copy

MOMENTS = ("exp_avg", "exp_avg_sq")


def keyed_flats(model) -> list:
    """(key, flat) for each of the wrapper's flats: the key names the flat by its first parameter."""
    return [(f"flat{i}.{flat.key}", flat) for i, flat in enumerate(model.flats())]


def shard_dtensor(layout, shard: torch.Tensor, mesh):
    """This rank's shard as its piece of the whole (unpadded) flat, for DCP; under HSDP placed
    (Replicate(), Shard(0)) on the 2-D mesh: DCP writes one copy and reads into every copy.

    With tensor parallelism (`--tp_size T`) each tp rank's flat holds its own slices, another
    tensor: the flats of a unit are the T rows of one (T, numel) tensor on the (dp_shard, tp) grid,
    each row cut over the data-parallel ranks as without it (`strategy/state/tensor.py` says why)."""
    from torch.distributed.tensor import Shard

    local = shard.detach()[:layout.valid(mesh.shard_rank)]
    if mesh.tp_size > 1:
        grid = stage_grid(mesh)
        return as_dtensor(local.view(1, -1), grid, (Shard(1), Shard(0)), (mesh.tp_size, layout.numel))
    return as_dtensor(local, mesh.shard_device_mesh(), tuple(mesh.placements()), (layout.numel,))


def stage_grid(mesh):
    """The `(dp_shard, tp)` grid of the ranks that hold this rank's keys: the run's, or under a
    pipeline (`--pp_size`) its stage's, a sub-mesh of the `(pp, dp_shard, tp)` grid: another stage's
    ranks hold other keys, and DCP writes each key from the grid of the ranks that hold it."""
    from minidist.parallel.mesh import device_mesh

    if mesh.pp_size > 1:
        return mesh.grid()["dp_shard", "tp"]
    return device_mesh(mesh.device_type, (mesh.dp_size, mesh.tp_size), ("dp_shard", "tp"))


def as_dtensor(local: torch.Tensor, device_mesh, placements: tuple, shape):
    """`local`, this rank's piece, as a DTensor of the whole `shape` placed on `device_mesh`.

    The piece stays where the shard is, a view of it: DCP saves from it and loads into it. Not
    `DTensor.from_local`, which moves a tensor that is not on the mesh's device type there: under
    NCCL that mesh is `cuda`, so every save and sharded load of a `--cpu_offload` run would copy
    the host's masters and moments to the GPU (12P/N bytes, +20 GB per rank for CodeLlama-7b on
    4 GPUs), the memory offload exists to free. The DTensor is built from its spec (the mesh, the
    placements, the whole tensor's shape) as FSDP2 builds its own around host shards under
    `CPUOffloadPolicy` (`_fsdp_common._from_local_no_grad`)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    stride = torch.empty(shape, device="meta").stride()
    spec = DTensorSpec(device_mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)


def _ensure_state(optimizer, flats) -> None:
    """AdamW's state as its first step would create it (step 0, zero moments), if no step has run
    yet: a resume needs tensors to load into. AdamW then finds it and uses it unchanged."""
    for _, flat in flats:
        if not optimizer.state.get(flat.shard):
            optimizer.state[flat.shard] = {"step": torch.tensor(0.0), **{m: torch.zeros_like(flat.shard) for m in MOMENTS}}


def get_state_dict(model, optimizer, full: bool, env, mesh) -> tuple[dict, dict]:
    flats = keyed_flats(model)
    _ensure_state(optimizer, flats)
    lr = torch.tensor([g["lr"] for g in optimizer.param_groups], dtype=torch.float64)
    group = mesh.shard_group
    holder = mesh.dp_rank == 0  # rank 0; with --tp_size, data-parallel rank 0 of every slice
    if full:
        # Every rank joins the gathers, one flat at a time; only rank 0 keeps them, in CPU memory.
        weights = model.full_parameters(keep=holder)
        optim = {}
        for key, flat in flats:
            state = optimizer.state[flat.shard]
            for m in MOMENTS:
                whole = gather_flat(flat.layout, state[m], group)
                if holder:
                    optim.setdefault(key, {})[m] = whole[:flat.layout.numel].to("cpu", copy=True)
                del whole
            if holder:
                optim[key]["step"] = state["step"].detach().cpu().clone()
        if not holder:
            return {}, {}
        return weights, {"flats": optim, "lr": lr}
    model_sd = {key: shard_dtensor(flat.layout, flat.shard, mesh) for key, flat in flats}
    optim = {}
    for key, flat in flats:
        state = optimizer.state[flat.shard]
        optim[key] = {**{m: shard_dtensor(flat.layout, state[m], mesh) for m in MOMENTS},
                      "step": state["step"]}
    return model_sd, {"flats": optim, "lr": lr}


def set_state_dict(model, optimizer, model_sd: dict, optim_sd: dict, full: bool, env, mesh) -> None:
    flats = keyed_flats(model)
    _ensure_state(optimizer, flats)
    group, holder = mesh.shard_group, mesh.dp_rank == 0  # rank 0; with --tp_size, data-parallel rank 0 of every slice
    for key, flat in flats:
        state, layout = optimizer.state[flat.shard], flat.layout
        if full:
            names = [n[0] for n in flat.names]
            whole = layout.flatten([model_sd[n] for n in names], torch.float32) if holder else None
            saved = optim_sd["flats"].get(key, {}) if holder else {}
            if mesh.replicate_rank == 0:  # HSDP: rank 0 scatters to its own node; the copies get them from there
                scatter_flat(layout, whole, flat.shard, group)
                for m in MOMENTS:
                    scatter_flat(layout, saved.get(m), state[m], group)
            broadcast_from_first_copy([flat.shard] + [state[m] for m in MOMENTS], mesh.replicate_group)
            step = (saved["step"].float().reshape(1) if env.is_main else torch.zeros(1)).to(env.device)
            dist.broadcast(step, src=0)
            state["step"] = step.reshape(()).cpu()
        else:
            valid = layout.valid(mesh.shard_rank)
            with torch.no_grad():
                flat.shard[:valid].copy_(model_sd[key].to_local().reshape(-1))  # with --tp_size: a (1, valid) row
                for m in MOMENTS:
                    state[m][:valid].copy_(optim_sd["flats"][key][m].to_local().reshape(-1))
            state["step"] = optim_sd["flats"][key]["step"].detach().clone()
    lr = optim_sd["lr"] if not full or env.is_main else torch.zeros(len(optimizer.param_groups), dtype=torch.float64)
    lr = lr.to(env.device)
    if full:
        dist.broadcast(lr, src=0)
    for param_group, value in zip(optimizer.param_groups, lr.tolist()):
        param_group["lr"] = value
    model.refresh_weights()  # ZeRO: the model's weights from the loaded masters; FSDP: nothing to do
