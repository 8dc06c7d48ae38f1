"""Checkpoints of a pipeline: sharded per stage, full as one model that loads at any pp size.

A stage keeps the whole model's parameter names (`stages.Stage`: `model.layers.5...` stays 5), so
its state dicts are pieces of the whole model's, keyed as the whole model's: the stages' keys do not
overlap, and together they are every key. `state.py` saves whatever the strategy hands it in two
forms, and this module makes both out of the stages' pieces:

- **sharded** (DCP): each rank hands DCP its own stage's tensors, and DCP writes each key from the
  rank that holds it (once, from one data-parallel copy) and reads it back into whichever rank asks
  for it. Under DDP a stage's tensors are whole, so another pp size simply asks for other keys: DCP
  reshards a DDP checkpoint by itself. With --tp_size they are slices, DTensors on the stage's own
  (dp_shard, tp) grid (`flat_state.stage_grid`), and PyTorch's FSDP2 hands out DTensors on
  the stage's data-parallel ranks: DCP writes each piece under the whole model's name, one folder for
  all stages, as torchtitan does. One thing does overlap: the optimizer's `param_groups` (lr,
  betas, ...), which DCP writes once under one key, with one stage's list of parameter names. On
  load each stage keeps the saved hyperparameters and puts its own names back (`own_param_groups`).
  ZeRO's and the hand-written FSDP's flats are a stage's buckets or units, keyed by their first
  parameter's whole-model name (`flat_state.keyed_flats`), so the stages' keys do not collide
  either; but they are laid out for that stage's parameters: a checkpoint of them resumes at its
  own layout only, which it records (`LAYOUT`) and checks (`check_layout`); a full checkpoint is
  the way to change it.

- **full**: exactly what a run without a pipeline writes: the whole model's weights by name (a
  `from_pretrained` folder) and its optimizer state by parameter name, on rank 0. Each stage's
  tensors are made whole on its first rank (slices joined over tp, FSDP2's shards gathered), then
  the stages are joined on rank 0 (`join_stages`), one tensor at a time: the moments keyed
  (name, moment), the param_groups' names concatenated in stage order. Loading sends every tensor
  from rank 0 to all ranks, one at a time, and each keeps the keys of its own stage (its slice of
  each, with --tp_size: `state/tensor.slices_from_rank0`): so it loads at any pp size, 1
  included (the code a run without --pp_size always had), and with DDP at any tp size too.

  ZeRO-1's and the hand FSDP's full form is theirs without a pipeline (`flat_state.py`): the
  weights by name and the moments as whole flats, laid out in the flats a pp 1 run makes of the
  whole model: ZeRO's buckets (`data.run_buckets`), FSDP's units (`data.run_units`: a stage's layer units
  are a pp 1 run's, but its root holds only its part of the rest). So each stage's flats are cut
  into their parameters, joined by name on rank 0 and laid out again in those flats
  (`joined_flats`); loading cuts them into parameters, each stage keeps its own and lays them out
  in its flats, each rank taking its shard (`sharded_flats`). With --tp_size a stage's FSDP flats
  hold slices: they are joined over tp first (`state/tensor.whole_flats`), and on load each
  rank keeps its slice of every tensor before laying out its flats.
"""

import torch
import torch.distributed as dist

from minidist.parallel import comm
from minidist.parallel.flat_state import MOMENTS, keyed_flats, shard_dtensor
from minidist.runtime.errors import UsageError
from minidist.strategy.state.tensor import slices_from_rank0

LAYOUT = "pipeline_layout"  # a sharded ZeRO checkpoint's (pp size, data-parallel ranks)


# ---------------------------------------------------------------- sharded: what overlaps, and the layout
def own_param_groups(saved: list[dict], live: list[dict]) -> list[dict]:
    """The saved param_groups' hyperparameters with this stage's own parameter names (`live`: this
    rank's optimizer state dict's groups): DCP kept one stage's names under the one key all share."""
    if len(saved) != len(live):
        raise UsageError(f"this checkpoint's optimizer has {len(saved)} parameter groups and this run's {len(live)}: "
                         f"resume with the options that wrote it")
    return [{**group, "params": mine["params"]} for group, mine in zip(saved, live)]


def layout(mesh) -> torch.Tensor:
    """What a sharded ZeRO checkpoint of a pipeline records (`LAYOUT`): its pp size and data-parallel ranks."""
    return torch.tensor([mesh.pp_size, mesh.dp_size])


def check_layout(saved: torch.Tensor, mesh) -> None:
    """Refuse, in one line (a UsageError, on every rank alike), a sharded ZeRO checkpoint of another
    pp size or number of data-parallel ranks: each stage's flats are laid out for its own parameters."""
    pp, dp = saved.tolist()
    if (pp, dp) != (mesh.pp_size, mesh.dp_size):
        raise UsageError(f"this sharded checkpoint was written at --pp_size {pp} on {dp} data-parallel ranks, and this "
                         f"run has {mesh.pp_size} on {mesh.dp_size}: a sharded ZeRO checkpoint of a pipeline resumes at "
                         f"its own layout: resume with that one, or save with --checkpoint_format full")


# ---------------------------------------------------------------- full: the stages joined on rank 0
def join_stages(state: dict | None, mesh) -> dict | None:
    """Every stage's weights (`state`, by the whole model's names, on the CPU, held by the stage's
    first data-parallel and tensor-parallel rank; None on the others) joined on rank 0, which
    returns the whole model's; every other rank returns None. Every rank calls it.

    The holders are one pipeline group, the one at data-parallel and tensor-parallel rank 0: the
    later stages send their tensors to its first, one at a time, after their names and shapes.
    Once, outside any training step: not counted in a step's bytes (`dist` directly, not `comm`)."""
    tp_rank = 0 if mesh.tp_group is None else dist.get_rank(mesh.tp_group)
    if mesh.dp_rank != 0 or tp_rank != 0:
        return None
    group, first = mesh.pp_group, dist.get_global_rank(mesh.pp_group, 0)
    shapes = [(name, tuple(t.shape), t.dtype) for name, t in state.items()]
    every = [None] * mesh.pp_size
    dist.gather_object(shapes, every if mesh.pp_rank == 0 else None, dst=first, group=group)
    probe = next(iter(state.values()))
    device = comm.collective_device(probe, group)  # NCCL sends GPU tensors only
    if mesh.pp_rank != 0:
        for tensor in state.values():
            dist.send(tensor.to(device).contiguous(), dst=first, group=group)
        return None
    whole = dict(state)
    for stage in range(1, mesh.pp_size):
        src = dist.get_global_rank(group, stage)
        for name, shape, dtype in every[stage]:
            buffer = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buffer, src=src, group=group)
            whole[name] = buffer.cpu()
    return whole


def joined_state_dict(model_sd: dict, optim_sd: dict, holder: bool, mesh) -> tuple[dict, dict]:
    """The whole model's weights and optimizer state (by parameter name, as a run without a pipeline
    writes them) on rank 0's CPU, from each stage's, whole on its first rank (`holder`: data-parallel
    and tensor-parallel rank 0; `model_sd`, `optim_sd` there, {} elsewhere); {} on the other ranks.
    Every rank calls it: the moments keyed (name, moment) for `join_stages`, the param_groups' names
    concatenated in stage order."""
    weights = join_stages(model_sd if holder else None, mesh)
    moments = {(name, key): t for name, state in optim_sd.get("state", {}).items() for key, t in state.items()}
    moments = join_stages(moments if holder else None, mesh)
    groups = _joined_param_groups(optim_sd["param_groups"] if holder else None, mesh)
    if dist.get_rank() != 0:
        return {}, {}
    state = {}
    for (name, key), t in moments.items():
        state.setdefault(name, {})[key] = t
    return weights, {"state": state, "param_groups": groups}


def _joined_param_groups(groups: list[dict] | None, mesh) -> list[dict] | None:
    """The stages' param_groups (on their holders) as one list on rank 0: each group's names, stage
    after stage (the order matters not: PyTorch's helpers load by name). None on the other ranks."""
    if groups is None:
        return None
    every = [None] * mesh.pp_size
    dist.gather_object(groups, every if mesh.pp_rank == 0 else None, dst=dist.get_global_rank(mesh.pp_group, 0),
                       group=mesh.pp_group)
    if dist.get_rank() != 0:
        return None
    return [{**group, "params": [name for stage in every for name in stage[i]["params"]]}
            for i, group in enumerate(every[0])]


def load_stage(module, optimizer, model_sd: dict, optim_sd: dict, cut: dict | None = None, tp_group=None) -> None:
    """Load a full checkpoint of any pp size (rank 0 holds it; the others pass {}) into this rank's
    stage (`module`, unwrapped) and its optimizer: rank 0 sends every tensor to all ranks, one at a
    time, and each keeps those of its own stage (with --tp_size, `cut`: its slice of each,
    `state/tensor.slices_from_rank0`). PyTorch's helpers then load the stage's whole tensors as
    a run without a pipeline loads its own (FSDP2: each rank keeps its shard of them)."""
    from torch.distributed.checkpoint import state_dict as dsd

    cut = cut or {}
    mine, live = dsd.get_state_dict(module, optimizer)  # this stage's names, and its optimizer's groups
    rank0 = dist.get_rank() == 0
    model_sd = slices_from_rank0(model_sd if rank0 else None, cut.get, None, tp_group, wanted=lambda name: name in mine)
    moments = {(name, key): t for name, s in optim_sd["state"].items() for key, t in s.items()} if rank0 else None
    state = {}
    for (name, key), t in slices_from_rank0(moments, lambda k: cut.get(k[0]) if k[1] in MOMENTS else None, None,
                                             tp_group, wanted=lambda k: k[0] in mine).items():
        state.setdefault(name, {})[key] = t
    groups = [optim_sd["param_groups"] if rank0 else None]
    dist.broadcast_object_list(groups, src=0)
    optim_sd = {"state": state, "param_groups": own_param_groups(groups[0], live["param_groups"])}
    options = dsd.StateDictOptions(full_state_dict=True)  # every rank holds its stage's tensors whole
    dsd.set_optimizer_state_dict(module, optimizer, optim_sd, options=options)
    dsd.set_model_state_dict(module, model_sd, options=options)


# ---------------------------------------------------------------- full ZeRO and FSDP: the flats as a pp 1 run lays them out
def joined_flats(model, model_sd: dict, optim_sd: dict, mesh, buckets: list) -> tuple[dict, dict]:
    """A full checkpoint of ZeRO or the hand FSDP under a pipeline, as a run without one writes it:
    `model_sd` and `optim_sd` are what `flat_state.get_state_dict` gave each stage's data-parallel
    rank 0 (its weights by name, and its flats' whole moments). Each flat is cut into its parameters,
    the stages joined by name on rank 0, and the moments laid out again in the flats a pp 1 run has
    (`buckets`: the strategy's `layout_of` the whole model, `state/data.py`), keyed as it keys them (`flat_state.keyed_flats`). {} elsewhere.

    With --tp_size the stage's first rank (data-parallel and tp rank 0) holds what
    `state/tensor.whole_flats` joined: whole weights, and flats of whole parameters (not of
    its slices), so a flat is cut by the whole weights' shapes, not by its own layout's."""
    holder = mesh.dp_rank == 0 and (mesh.tp_group is None or dist.get_rank(mesh.tp_group) == 0)
    moments = {} if holder else None
    for key, flat in keyed_flats(model) if holder else ():
        saved, names = optim_sd["flats"][key], [n[0] for n in flat.names]
        shapes = [model_sd[name].shape for name in names]
        for m in MOMENTS:
            pieces = saved[m].split([shape.numel() for shape in shapes])
            moments.update({(name, m): t.view(shape) for name, t, shape in zip(names, pieces, shapes)})
        moments.update({(name, "step"): saved["step"] for name in names})
    weights = join_stages(model_sd if holder else None, mesh)
    moments = join_stages(moments, mesh)
    if dist.get_rank() != 0:
        return {}, {}
    flats = {}
    for i, run in enumerate(buckets):
        flats[f"flat{i}.{run[0][0]}"] = {"step": moments[run[0][0], "step"],
                                         **{m: torch.cat([moments[name, m].reshape(-1) for name, _ in run])
                                            for m in MOMENTS}}
    return weights, {"flats": flats, "lr": optim_sd["lr"]}


def sharded_flats(model, model_sd: dict, optim_sd: dict, mesh, buckets: list, cut: dict | None = None) -> tuple[dict, dict]:
    """A full ZeRO or FSDP checkpoint of any pp size (rank 0 holds it, laid out in the flats of a
    run without a pipeline: `buckets`), as `flat_state.set_state_dict` loads a sharded one into this
    rank's stage: each flat's shard of weights and moments, a DTensor of the whole flat.

    Rank 0 sends a pp 1 flat's tensors at a time, each one to every rank (`slices_from_rank0`); each
    rank keeps its stage's, and as soon as one of its own flats has all its parameters it keeps its
    shard of them and lets the whole tensors go. So a rank holds whole only the flats not yet
    complete (FSDP: one layer unit, then the root's pieces; ZeRO: a bucket or two, the two runs'
    bounds differing), not its whole stage (for CodeLlama-7b at pp 2: 3.4B parameters x 12 bytes of
    weights and moments, 40 GB on every rank); rank 0 holds the whole checkpoint, as without a pipeline.

    With --tp_size (`cut`: the sliced parameters) each rank keeps its slice of each weight and
    moment (`slices_from_rank0`, as `state/tensor.py` loads): its flats are flats of slices."""
    rank0 = dist.get_rank() == 0
    cut = cut or {}
    tp_group = mesh.tp_group if cut else None
    todo = keyed_flats(model)
    mine = {n[0] for _, flat in todo for n in flat.names}
    lr = [optim_sd["lr"] if rank0 else None]
    dist.broadcast_object_list(lr, src=0)
    held, model_sd_out, state = {}, {}, {}
    for i, run in enumerate(buckets):
        sent = _run_tensors(run, model_sd, optim_sd["flats"][f"flat{i}.{run[0][0]}"]) if rank0 else None
        held.update(slices_from_rank0(sent, lambda key: cut.get(key[0]) if key[1] != "step" else None, None,
                                      tp_group, wanted=lambda key: key[0] in mine))
        complete = [(key, flat) for key, flat in todo if all((n[0], "weight") in held for n in flat.names)]
        for key, flat in complete:
            whole = {part: [held.pop((n[0], part)) for n in flat.names] for part in ("weight", "step", *MOMENTS)}
            model_sd_out[key] = _shard(flat.layout, whole["weight"], mesh)
            state[key] = {"step": whole["step"][0], **{m: _shard(flat.layout, whole[m], mesh) for m in MOMENTS}}
            todo.remove((key, flat))
    return model_sd_out, {"flats": state, "lr": lr[0]}


def _run_tensors(run: list, weights: dict, saved: dict) -> dict:
    """A pp 1 run's flat (`run`: its (name, shape)s; `saved`: its whole moments and step) cut into its
    parameters, by (name, "weight" | "step" | moment), with their weights (`weights`, by name)."""
    sizes = [shape.numel() for _, shape in run]
    tensors = {}
    for k, (name, shape) in enumerate(run):
        tensors[name, "weight"] = weights[name]
        tensors[name, "step"] = saved["step"]
        for m in MOMENTS:
            tensors[name, m] = saved[m].split(sizes)[k].view(shape)
    return tensors


def _shard(layout, tensors: list, mesh):
    """This rank's shard of the flat `layout` makes of `tensors` (whole, or this rank's slices, in
    its order), as the DTensor that a sharded checkpoint hands `flat_state.set_state_dict`."""
    # a copy of the shard: a view would keep the whole padded flat alive
    return shard_dtensor(layout, layout.flatten(tensors, torch.float32)[layout.shard_slice].clone(), mesh)


# ---------------------------------------------------------------- the form: one link of the chain
class PipelineForm:
    """The pipeline axis's link in the checkpoint chain (`state/__init__.py`): the stages' pieces,
    keyed by the whole model's names. Full: the stages joined on rank 0, as a pp 1 run writes them
    (flats laid out as its flats, `run_flats`: the strategy's `layout_of` the whole model), and cut
    by stage on load; sharded: each stage's own, its layout noted where it matters (flats).
    `cut`: the tensor axis's sliced parameters (None without one), which a full load slices too."""

    def __init__(self, cut: dict | None = None):
        self.cut = cut

    def get(self, strategy, model, optimizer, how: str, below) -> tuple[dict, dict]:
        mesh = strategy.mesh
        model_sd, optim_sd = below(how)  # full: each stage's, whole on its first rank
        if strategy.form_kind == "flat":
            if how == "full":
                return joined_flats(model, model_sd, optim_sd, mesh, strategy.layout_of(strategy.model_to_save(model)))
            optim_sd[LAYOUT] = layout(mesh)
            return model_sd, optim_sd
        if how == "full":
            return joined_state_dict(model_sd, optim_sd, strategy.holder, mesh)
        return model_sd, optim_sd  # DCP writes each key from the stage that holds it

    def set(self, strategy, model, optimizer, model_sd: dict, optim_sd: dict, how: str, below) -> None:
        mesh = strategy.mesh
        if strategy.form_kind == "flat":
            if how == "full":  # rank 0's pp 1 flats cut into this stage's (its slices, under tp), each rank its shard
                run = strategy.layout_of(strategy.model_to_save(model))
                return below(*sharded_flats(model, model_sd, optim_sd, mesh, run, self.cut), "own")
            if how == "sharded":
                check_layout(optim_sd.pop(LAYOUT), mesh)
            return below(model_sd, optim_sd, how)
        module = strategy.unwrap(model)
        if how == "full":  # each stage takes its keys (its slices of them, under tp) of any pp size's
            return load_stage(module, optimizer, model_sd, optim_sd, cut=self.cut, tp_group=mesh.tp_group)
        if how == "sharded":  # DCP kept one stage's parameter names in the param_groups all share
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            live = get_optimizer_state_dict(module, optimizer)["param_groups"]
            optim_sd["param_groups"] = own_param_groups(optim_sd["param_groups"], live)
        return below(model_sd, optim_sd, how)
