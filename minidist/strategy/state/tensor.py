"""Checkpoints of a tensor-parallel run: sharded at its own layout, full at any tp size.

A tensor-parallel rank holds a slice of each cut matrix (`llama.split_parameters` names them, with
the dimension each is cut along) and a copy of everything else (the norms), and AdamW's moments
have the same shapes as the weights. `state.py` saves whatever the strategy hands it in two forms,
and this module makes both out of the slices:

- **sharded**: each slice is shown to DCP as what it is, this rank's part of one whole tensor: a
  `DTensor` on the run's 2-D mesh `(dp_shard, tp)` (`mesh.py`), placed `Shard(dim)` along `tp` and
  `Replicate()` along the data-parallel ranks, which all hold the same slices (DDP). DCP then
  writes one piece per slice, once, under the parameter's own name, and records where it sits in
  the whole. The copied norms stay plain tensors: DCP writes one copy and reads it into every rank.
  The vocabulary's slices are of the *padded* vocabulary (`vocab.padded_vocab_size`), so the saved
  embedding and head have the padded number of rows.

  FSDP's side (`flat_state.py`) saves flat shards, and with tensor parallelism the flat of unit i
  on tp rank r holds rank r's slices: T different tensors, one per tp rank, of the same length.
  They are saved as the rows of one `(T, numel)` tensor, placed `(Shard(1), Shard(0))`: the
  data-parallel ranks cut each row as without tp, and the tp ranks own one row each. That keeps one
  key per unit, as without tp, and the same mesh as the DDP side; keys per tp rank (`tp1.flat3`)
  would work too, but would need a DTensor on each tp rank's own sub-mesh, and hide that the T
  rows are one unit. A row is not a slice of any one weight, so this form resumes at the same tp
  size only (DCP could cut the rows anew for another number of data-parallel ranks, and a DDP
  slice too, but that is not tested, so `check_layout` refuses it).

- **full**: exactly what the same strategy writes without tensor parallelism: the weights whole by
  name (`whole_weights` joins the slices, the padding dropped) in a `from_pretrained` folder,
  and the moments whole too (DDP: by parameter name, as `torch.distributed.checkpoint.state_dict`
  writes them; FSDP: one whole flat per unit, laid out as a tp 1 run lays it out). So it loads at
  any tp size, 1 included (a run without `--tp_size`, which reads it with the code it always had),
  and loading it under tensor parallelism reverses the join: rank 0 broadcasts each whole tensor,
  one at a time, and each rank keeps its own slice (padded again, `slice_of`).

A full save joins one tensor at a time, and only rank 0 keeps the whole state: the other ranks of
its tp group hold one whole tensor at a time (`joined_on_rank0`). A sharded checkpoint records its
tp size and number of data-parallel ranks (`LAYOUT`), and a resume at another layout is refused in
one line (a full checkpoint is the way to change it) once DCP has read it. Under FSDP, DCP's
planner stops first, since the rows it would read have another shape than the ones it was given;
`checkpoint/data_only.py` says that in one line too.
"""

import torch
import torch.distributed as dist

from minidist.parallel import comm
from minidist.parallel.flat_state import MOMENTS, as_dtensor, keyed_flats, stage_grid
from minidist.parallel.tensor.vocab import padded_vocab_size
from minidist.runtime.errors import UsageError

LAYOUT = "tensor_parallel_layout"  # a sharded checkpoint's (tp size, data-parallel ranks)


# ---------------------------------------------------------------- slices joined into whole tensors
def whole_weights(state: dict[str, torch.Tensor], cut: dict[str, tuple[int, int | None]], group) -> dict:
    """Every rank's slices of `state` (this rank's weights, by name, on the CPU) joined along the
    dimension each was cut, the vocabulary's padding dropped: the whole model's weights, on every
    rank of `group`, one tensor at a time. Outside any training step, so not counted as a step's
    bytes (`dist` directly, not `comm`)."""
    n = dist.get_world_size(group)
    whole = {}
    for name, tensor in state.items():
        if name not in cut:
            whole[name] = tensor
            continue
        dim, real = cut[name]
        device = comm.collective_device(tensor, group)  # NCCL gathers GPU tensors only
        slices = tensor.to(device).contiguous()
        gathered = slices.new_empty((n, *slices.shape))
        dist.all_gather_into_tensor(gathered.view(-1), slices.view(-1), group=group)  # flat: as gloo wants
        joined = torch.cat(gathered.unbind(0), dim=dim)
        whole[name] = (joined if real is None else joined.narrow(dim, 0, real)).to(tensor.device)
    return whole


# ---------------------------------------------------------------- slices as parts of whole tensors
def sliced(local: torch.Tensor, dim: int, mesh):
    """A cut parameter's slice (or a moment of it) as its part of the whole tensor: a DTensor on the
    run's `(dp_shard, tp)` grid, the one `mesh.py` cut its groups from, Shard(dim) over tp."""
    from torch.distributed.tensor import Replicate, Shard

    shape = list(local.shape)
    shape[dim] *= mesh.tp_size
    return as_dtensor(local.detach(), stage_grid(mesh), (Replicate(), Shard(dim)), shape)


def slice_of(whole: torch.Tensor, cut: tuple[int, int | None] | None, tp_group) -> torch.Tensor:
    """This tp rank's slice of a whole tensor, as `linear.py` and `vocab.py` cut it: an equal chunk
    along the dimension, the vocabulary first padded with zero rows. `cut` None: a copied tensor."""
    if cut is None:
        return whole
    dim, real = cut
    n = dist.get_world_size(tp_group)
    if real is not None:
        pad = [0, 0] * (whole.dim() - 1 - dim) + [0, padded_vocab_size(real, n) - whole.shape[dim]]
        whole = torch.nn.functional.pad(whole, pad)
    return whole.chunk(n, dim)[dist.get_rank(tp_group)].clone()


@torch.no_grad()
def slices_from_rank0(whole: dict | None, cut_of, group, tp_group, wanted=None) -> dict:
    """Rank 0's whole tensors (`whole`, by key; None elsewhere) sent over `group`, one at a time, and
    this rank's slice of each kept (`cut_of(key)`: how it is cut, or None), on the CPU; with `wanted`,
    only the keys `wanted(key)` says this rank holds (under a pipeline: its stage's). Outside any
    step: `dist`, not the counted `comm`."""
    names = [{key: (tensor.shape, tensor.dtype) for key, tensor in whole.items()} if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(names, src=0, group=group)
    kept = {}
    for key, (shape, dtype) in names[0].items():
        tensor = whole[key] if dist.get_rank() == 0 else torch.empty(shape, dtype=dtype)
        sent = tensor.to(comm.collective_device(tensor, group)).contiguous()
        dist.broadcast(sent, src=0, group=group)
        if wanted is None or wanted(key):
            kept[key] = slice_of(sent, cut_of(key), tp_group).cpu()
        del sent
    return kept


def joined_on_rank0(tensors: dict, cut: dict, group) -> dict:
    """`whole_weights` one tensor at a time, each kept by the first rank of `group` alone (rank
    0, or under a pipeline its stage's first): the other ranks of `group` hold one whole tensor at a
    time, not the whole state (81 GB for CodeLlama-7b with AdamW)."""
    kept = {}
    for name, tensor in tensors.items():
        whole = whole_weights({name: tensor}, cut, group)[name]
        if dist.get_rank(group) == 0:
            kept[name] = whole
        del whole
    return kept


def layout(mesh) -> torch.Tensor:
    """What a sharded checkpoint records of the run's layout (`LAYOUT`): its tp size, its data-parallel ranks."""
    return torch.tensor([mesh.tp_size, mesh.dp_size])


def check_layout(saved: torch.Tensor, mesh) -> None:
    """Refuse, in one line (a UsageError, on every rank alike), a sharded checkpoint of another tp size
    or number of data-parallel ranks: not tested, so not offered, though DCP could cut a DDP slice
    or a flat's row anew for another number of data-parallel ranks."""
    tp, dp = saved.tolist()
    if (tp, dp) != (mesh.tp_size, mesh.dp_size):
        raise UsageError(f"this sharded checkpoint was written at --tp_size {tp} on {dp} data-parallel ranks, and "
                         f"this run has {mesh.tp_size} on {mesh.dp_size}: a sharded checkpoint of tensor parallelism "
                         f"resumes at its own layout; resume with that layout, or save with --checkpoint_format full")


# ---------------------------------------------------------------- DDP: a model every data-parallel rank holds
def sliced_state_dict(model_sd: dict, optim_sd: dict, cut: dict, mesh) -> tuple[dict, dict]:
    """This rank's state of a cut model that DDP replicates, keyed by parameter name as PyTorch's
    state-dict helpers key it, with each slice shown as its part of the whole tensor (a DTensor)."""
    model_sd = {name: sliced(t, cut[name][0], mesh) if name in cut else t for name, t in model_sd.items()}
    # New dicts: the optimizer's own per-parameter dicts are the ones `state` holds, and must keep plain tensors.
    optim_sd["state"] = {name: {**state, **{m: sliced(state[m], cut[name][0], mesh) for m in MOMENTS}}
                         if name in cut else state for name, state in optim_sd["state"].items()}
    return model_sd, {**optim_sd, LAYOUT: layout(mesh)}


def joined_over_tp(model_sd: dict, optim_sd: dict, cut: dict, mesh) -> tuple[dict, dict]:
    """The whole weights and moments on the CPU of tp rank 0 of data-parallel rank 0 (rank 0, or under
    a pipeline each stage's first rank, which `state/pipeline.py` then joins), from the slices of
    the tp ranks of data-parallel rank 0 (the others hold the same); {} elsewhere."""
    if mesh.dp_rank != 0:
        return {}, {}
    cpu = {name: t.detach().to("cpu", copy=True) for name, t in model_sd.items()}
    weights = joined_on_rank0(cpu, cut, mesh.tp_group)
    state = {name: {"step": s["step"].detach().cpu().clone()} for name, s in optim_sd["state"].items()}
    for m in MOMENTS:
        moments = {name: s[m].detach().to("cpu", copy=True) for name, s in optim_sd["state"].items()}
        for name, whole in joined_on_rank0(moments, cut, mesh.tp_group).items():
            state[name][m] = whole
    if dist.get_rank(mesh.tp_group) != 0:
        return {}, {}
    return weights, {"state": state, "param_groups": optim_sd["param_groups"]}


def own_slices(model_sd: dict, optim_sd: dict, cut: dict, mesh) -> tuple[dict, dict]:
    """A full checkpoint of any tp size (whole tensors by name, on rank 0; the others pass {}) as this
    rank's slices of each weight and moment, every rank receiving them from rank 0."""
    model_sd = slices_from_rank0(model_sd if dist.get_rank() == 0 else None, cut.get, None, mesh.tp_group)
    return model_sd, _sliced_optimizer(optim_sd, cut, mesh)


def local_slices(model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
    """What DCP filled into `sliced_state_dict`'s DTensors, as the plain slices the model holds."""
    from torch.distributed.tensor import DTensor

    model_sd = {name: t.to_local() if isinstance(t, DTensor) else t for name, t in model_sd.items()}
    for state in optim_sd["state"].values():
        state.update({m: state[m].to_local() for m in MOMENTS if isinstance(state[m], DTensor)})
    return model_sd, optim_sd


def _sliced_optimizer(optim_sd: dict, cut: dict, mesh) -> dict:
    """Rank 0's whole optimizer state (by parameter name) as this rank's: its slice of each moment."""
    whole = None
    if dist.get_rank() == 0:
        whole = {(name, key): t for name, s in optim_sd["state"].items() for key, t in s.items()}
    groups = [optim_sd["param_groups"] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(groups, src=0)
    state = {}
    for (name, key), t in slices_from_rank0(whole, lambda k: cut.get(k[0]) if k[1] in MOMENTS else None,
                                             None, mesh.tp_group).items():
        state.setdefault(name, {})[key] = t
    return {"state": state, "param_groups": groups[0]}


# ---------------------------------------------------------------- FSDP: flat shards of the slices
def whole_flats(model, model_sd: dict, optim_sd: dict, cut: dict, mesh) -> tuple[dict, dict]:
    """A full checkpoint of FSDP under tensor parallelism, as FSDP writes it without: `model_sd` and
    `optim_sd` are what `flat_state.get_state_dict` gave the tp ranks of data-parallel rank 0 (their
    slices' weights, and each unit's whole flat of moments); each moment flat is cut into its
    parameters, each joined over tp, and laid out again whole. On the first rank of the tp group of
    data-parallel rank 0 (rank 0, or under a pipeline each stage's first, which `state/pipeline.py`
    then joins); {} elsewhere."""
    if mesh.dp_rank != 0:
        return {}, {}
    weights = joined_on_rank0(model_sd, cut, mesh.tp_group)
    flats = {}
    for key, flat in keyed_flats(model):
        saved, names = optim_sd["flats"][key], [n[0] for n in flat.names]
        flats[key] = {"step": saved["step"]}
        for m in MOMENTS:
            joined = joined_on_rank0(dict(zip(names, flat.layout.views(saved[m]))), cut, mesh.tp_group)
            flats[key][m] = torch.cat([joined[name].reshape(-1) for name in names]) if joined else None
    if dist.get_rank(mesh.tp_group) != 0:
        return {}, {}
    return weights, {"flats": flats, "lr": optim_sd["lr"]}


def sliced_flats(model, model_sd: dict, optim_sd: dict, cut: dict, mesh) -> tuple[dict, dict]:
    """A full FSDP checkpoint of any tp size (whole, on rank 0) as each tp rank of data-parallel rank 0
    needs it for `flat_state.set_state_dict` to scatter: its slices' weights by name, and each unit's
    moments as the whole flat of its slices. {} on the other ranks, which receive their shards."""
    if mesh.dp_rank != 0:
        return {}, {}
    rank0 = dist.get_rank() == 0
    weights = slices_from_rank0(model_sd if rank0 else None, cut.get, mesh.tp_group, mesh.tp_group)
    whole = {}
    for key, flat in keyed_flats(model) if rank0 else ():
        names, saved = [n[0] for n in flat.names], optim_sd["flats"][key]
        whole[key, None, "step"] = saved["step"]
        sizes = [model_sd[name].numel() for name in names]  # the whole parameters, one after the other
        for m in MOMENTS:
            for name, piece in zip(names, saved[m].split(sizes)):
                whole[key, name, m] = piece.view(model_sd[name].shape)
    pieces = slices_from_rank0(whole if rank0 else None, lambda k: cut.get(k[1]), mesh.tp_group, mesh.tp_group)
    flats = {}
    for key, flat in keyed_flats(model):
        flats[key] = {"step": pieces[key, None, "step"]}
        for m in MOMENTS:
            flats[key][m] = torch.cat([pieces[key, n[0], m].reshape(-1) for n in flat.names])
    return weights, {"flats": flats, "lr": optim_sd["lr"] if rank0 else None}


# ---------------------------------------------------------------- the form: one link of the chain
class TensorParallelForm:
    """The tensor axis's link in the checkpoint chain (`state/__init__.py`), for the hand-written
    cut (`tensor/llama.py`; PyTorch's own cut is made of DTensors, which the data-parallel form
    saves as they are). `cut`: the sliced parameters' names, with the dimension each is cut along."""

    def __init__(self, cut: dict):
        self.cut = cut

    def get(self, strategy, model, optimizer, how: str, below) -> tuple[dict, dict]:
        mesh = strategy.mesh
        if strategy.form_kind == "flat":  # a unit's flat holds this rank's slices
            model_sd, optim_sd = below(how)
            if how == "full":  # whole flats, as a tp 1 run lays them out
                return whole_flats(model, model_sd, optim_sd, self.cut, mesh)
            optim_sd[LAYOUT] = layout(mesh)
            return model_sd, optim_sd
        model_sd, optim_sd = below("sharded")  # by parameter: this rank's own slices
        if how == "full":  # joined, on the first rank of the tp group of data-parallel rank 0
            return joined_over_tp(model_sd, optim_sd, self.cut, mesh)
        return sliced_state_dict(model_sd, optim_sd, self.cut, mesh)

    def set(self, strategy, model, optimizer, model_sd: dict, optim_sd: dict, how: str, below) -> None:
        mesh = strategy.mesh
        if how == "sharded":
            check_layout(optim_sd.pop(LAYOUT), mesh)
        if strategy.form_kind == "flat":
            if how == "full":  # each tp rank of data-parallel rank 0 gets its slices' flats, whole, to scatter
                model_sd, optim_sd = sliced_flats(model, model_sd, optim_sd, self.cut, mesh)
            return below(model_sd, optim_sd, how)
        if how == "full":  # every rank keeps its slices (of a checkpoint of any tp size)
            return below(*own_slices(model_sd, optim_sd, self.cut, mesh), "own")
        return below(*local_slices(model_sd, optim_sd), "own" if how == "own" else "sharded")
