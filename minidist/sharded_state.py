"""Checkpoints of flat shards: the hand-written ZeRO's and FSDP's side of `state.py`.

`state.py` saves whatever `strategy.get_state_dict` hands it, in two forms. For ZeRO and FSDP
by hand, what a rank holds is a list of flat fp32 shards (`zero.FlatParameter`: ZeRO's buckets,
FSDP's units) and AdamW's moments for them. This module turns them into the two forms:

- *full*: every flat is all-gathered; rank 0 gets the weights by their original names (a
  `from_pretrained` folder), and the moments as whole flat tensors, one per flat, unpadded;
- *sharded*: each rank's shard becomes a `DTensor` (`torch.distributed.tensor`) of the whole
  flat, placed `Shard(0)` on a 1-D mesh of the ranks. DCP then writes each rank's piece and
  records where it sits, so another number of ranks reads back the slices it owns. For this to
  line up, a flat is cut as `torch.chunk` cuts: ceil(numel / N) elements per rank, the last ones
  shorter (the zero padding is not saved), which is exactly `FlatParameter`'s layout.

Loading reverses it: the full form scatters the flats from rank 0; the sharded form lets DCP fill
the DTensors and copies them into the shards. ZeRO's model then all-gathers its weights from
the loaded masters; FSDP gathers them anyway before every use.
"""

import torch
import torch.distributed as dist

from minidist import comm
from minidist.distributed import device_mesh

MOMENTS = ("exp_avg", "exp_avg_sq")


def _flats(model) -> list:
    """(key, FlatParameter, fp32 shard, names of the flat's parameters in order) for each flat."""
    out = []
    if hasattr(model, "units"):  # fsdp.FullyShardedDataParallel
        for i, unit in enumerate(model.units):
            names = {}
            for _, _, name, k in unit.slots:
                names.setdefault(k, name)  # a tied weight: its first name
            names = [names[k] for k in range(len(names))]
            out.append((f"flat{i}.{names[0]}", unit.flat, unit.flat_param, names))
    else:  # zero.ZeroDP
        name_of = {id(p): n for n, p in model.module.named_parameters()}
        for i, bucket in enumerate(model.buckets):
            names = [name_of[id(p)] for p in bucket.params]
            out.append((f"flat{i}.{names[0]}", bucket.flat, bucket.master, names))
    return out


def _valid(flat, rank: int) -> int:
    """How many of rank `rank`'s shard elements are real parameters (the rest is padding)."""
    return max(0, min(flat.shard_numel, flat.numel - rank * flat.shard_numel))


def _gather_flat(flat, shard: torch.Tensor) -> torch.Tensor:
    """The whole flat (unpadded, fp32) on every rank."""
    full = torch.empty(flat.padded_numel, dtype=torch.float32, device=shard.device)
    dist.all_gather_into_tensor(full, shard.detach().float().contiguous())
    return full[:flat.numel]


def _scatter_flat(flat, full: torch.Tensor | None, out: torch.Tensor) -> None:
    """Rank 0's whole flat `full` (unpadded) cut into shards; this rank's lands in `out`."""
    chunks = None
    if dist.get_rank() == 0:
        padded = torch.nn.functional.pad(full.float().reshape(-1), (0, flat.padded_numel - flat.numel))
        chunks = list(padded.to(out.device).chunk(dist.get_world_size()))
    received = torch.empty(flat.shard_numel, dtype=torch.float32, device=out.device)
    comm.scatter(received, chunks, src=0)
    with torch.no_grad():
        out.copy_(received)


def _dtensor(flat, shard: torch.Tensor, mesh):
    """This rank's shard as its piece of the whole (unpadded) flat, for DCP."""
    from torch.distributed.tensor import DTensor, Shard

    local = shard.detach()[:_valid(flat, dist.get_rank())]
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size([flat.numel]), stride=(1,))


def _ensure_state(optimizer, flats) -> None:
    """AdamW's state as its first step would create it (step 0, zero moments), if no step has run
    yet: a resume needs tensors to load into. AdamW then finds it and uses it unchanged."""
    for _, _, shard, _ in flats:
        if not optimizer.state.get(shard):
            optimizer.state[shard] = {"step": torch.tensor(0.0), **{m: torch.zeros_like(shard) for m in MOMENTS}}


def get_state_dict(model, optimizer, full: bool, env) -> tuple[dict, dict]:
    flats = _flats(model)
    _ensure_state(optimizer, flats)
    lr = torch.tensor([g["lr"] for g in optimizer.param_groups], dtype=torch.float64)
    if full:
        weights = model.full_parameters()  # every rank joins the gathers
        optim = {}
        for key, flat, shard, _ in flats:
            state = optimizer.state[shard]
            optim[key] = {m: _gather_flat(flat, state[m]).cpu() for m in MOMENTS}
            optim[key]["step"] = state["step"].detach().cpu().clone()
        if not env.is_main:
            return {}, {}
        return {k: v.detach().cpu().clone() for k, v in weights.items()}, {"flats": optim, "lr": lr}
    mesh = device_mesh()
    model_sd = {key: _dtensor(flat, shard, mesh) for key, flat, shard, _ in flats}
    optim = {}
    for key, flat, shard, _ in flats:
        state = optimizer.state[shard]
        optim[key] = {**{m: _dtensor(flat, state[m], mesh) for m in MOMENTS}, "step": state["step"]}
    return model_sd, {"flats": optim, "lr": lr}


def set_state_dict(model, optimizer, model_sd: dict, optim_sd: dict, full: bool, env) -> None:
    flats = _flats(model)
    _ensure_state(optimizer, flats)
    for key, flat, shard, names in flats:
        state = optimizer.state[shard]
        if full:
            whole = flat.flatten([model_sd[n] for n in names], torch.float32) if env.is_main else None
            _scatter_flat(flat, whole, shard)
            saved = optim_sd["flats"].get(key, {}) if env.is_main else {}
            for m in MOMENTS:
                _scatter_flat(flat, saved.get(m), state[m])
            step = (saved["step"].float().reshape(1) if env.is_main else torch.zeros(1)).to(shard.device)
            dist.broadcast(step, src=0)
            state["step"] = step.reshape(()).cpu()
        else:
            valid = _valid(flat, env.rank)
            with torch.no_grad():
                shard[:valid].copy_(model_sd[key].to_local())
                for m in MOMENTS:
                    state[m][:valid].copy_(optim_sd["flats"][key][m].to_local())
            state["step"] = optim_sd["flats"][key]["step"].detach().clone()
    lr = optim_sd["lr"] if not full or env.is_main else torch.zeros(len(optimizer.param_groups), dtype=torch.float64)
    lr = lr.to(env.device)
    if full:
        dist.broadcast(lr, src=0)
    for group, value in zip(optimizer.param_groups, lr.tolist()):
        group["lr"] = value
    if hasattr(model, "refresh_weights"):  # ZeRO: the model's weights from the loaded masters
        model.refresh_weights()
