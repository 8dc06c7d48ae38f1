"""The data-parallel checkpoint forms: where the chain of `state/__init__.py` starts.

A strategy's state is one of two kinds, and so is its checkpoint form:

- **by parameter** (`ByParameter`): both DDPs and PyTorch's FSDP2. Every parameter is a tensor of
  its own (FSDP2's a DTensor, its shard), so PyTorch's state-dict helpers
  (`torch.distributed.checkpoint.state_dict`) give and take the weights and the optimizer's state,
  keyed by parameter name.
- **flat** (`Flat`): ZeRO and FSDP by hand, whose weights and moments live in flat shards
  (`flat.py`). `parallel/flat_state.py` hands them out keyed by flat, and takes them back.

Each form has three ways of being asked (`how`):

- "full": whole tensors. For the weights and moments of the whole model, on the first rank of the
  ranks that hold this part of the model (`Strategy.holder`): rank 0, unless an axis cut the model
  into parts that different ranks hold (a pipeline's stages), whose holders an axis then joins.
- "sharded": each rank's own pieces as DCP writes them (DTensors where sharded), to be resharded on load.
- "own" (loading only): each rank already holds its own pieces, cut by an axis from a full
  checkpoint: taken as they are, as from a sharded checkpoint, with nothing checked.
"""

import torch
import torch.distributed as dist

from minidist.parallel import flat_state, fsdp
from minidist.parallel.wrapper import pack_buckets


class ByParameter:
    """Weights and optimizer state by parameter name, through PyTorch's state-dict helpers."""

    def get(self, strategy, model, optimizer, how: str) -> tuple[dict, dict]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        module = strategy.unwrap(model)
        if how != "full":
            return get_state_dict(module, optimizer)  # this rank's own tensors (FSDP2: its shards, as DTensors)
        if strategy.one_holder:  # rank 0 holds it all: one tensor at a time gathered to its CPU
            return get_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # Each part's holder (a stage's first rank): the helpers' full form would gather to rank 0 alone.
        model_sd, optim_sd = get_state_dict(module, optimizer)
        holder = strategy.holder
        weights = whole_on(model_sd, holder)
        # one flat dict: (name, "step" | "exp_avg" | "exp_avg_sq") -> tensor
        moments = whole_on({(name, key): t for name, state in optim_sd.get("state", {}).items()
                            for key, t in state.items()}, holder)
        if not holder:
            return {}, {}
        state = {}
        for (name, key), t in moments.items():
            state.setdefault(name, {})[key] = t
        return weights, {"state": state, "param_groups": optim_sd["param_groups"]}

    def set(self, strategy, model, optimizer, model_sd: dict, optim_sd: dict, how: str) -> None:
        from torch.distributed.checkpoint import state_dict as dsd

        module, full = strategy.unwrap(model), how == "full"
        options = dsd.StateDictOptions(full_state_dict=full, broadcast_from_rank0=full)
        # Two calls, not set_state_dict: it would take the empty model dict of ranks > 0 to mean
        # "optimizer only", and those ranks would skip the broadcasts rank 0 sends.
        dsd.set_optimizer_state_dict(module, optimizer, optim_sd, options=options)
        dsd.set_model_state_dict(module, model_sd, options=options)


class Flat:
    """The flat shards of ZeRO and FSDP by hand (`parallel/flat_state.py`): full, each flat whole
    on the data-parallel rank 0 of each part (its weights by name, its moments as whole flats)."""

    def get(self, strategy, model, optimizer, how: str) -> tuple[dict, dict]:
        return flat_state.get_state_dict(model, optimizer, how == "full", strategy.env, strategy.mesh)

    def set(self, strategy, model, optimizer, model_sd: dict, optim_sd: dict, how: str) -> None:
        flat_state.set_state_dict(model, optimizer, model_sd, optim_sd, how == "full", strategy.env, strategy.mesh)


# ---------------------------------------------------------------- the flats a strategy makes of a whole model
def run_buckets(whole_model, bucket_cap_mb: float) -> list[list[tuple[str, torch.Size]]]:
    """The (name, shape) of each parameter of each bucket that ZeRO (`zero.ZeroDP`) makes of
    `whole_model` (built on the meta device) without a pipeline: its trainable parameters in reverse
    order, packed into runs of `bucket_cap_mb` of fp32 (the loop loads in fp32; `wrapper.pack_buckets`)."""
    named = [(name, p) for name, p in whole_model.named_parameters() if p.requires_grad][::-1]
    fp32 = [torch.empty(p.shape, device="meta") for _, p in named]
    name_of = {id(t): name for t, (name, _) in zip(fp32, named)}
    return [[(name_of[id(t)], t.shape) for t in run] for run in pack_buckets(fp32, int(bucket_cap_mb * 2**20))]


def run_units(whole_model, unit_classes) -> list[list[tuple[str, torch.Size]]]:
    """The (name, shape) of each parameter of each unit that the hand-written FSDP (`fsdp.py`)
    makes of `whole_model` (built on the meta device) without a pipeline: a unit per layer, then
    the root, each in its flat's order (`unit.Unit`: the trainable parameters, a tied one once,
    under its first name); a unit with none has no flat. Under a pipeline a stage's layer units are
    these, but its root holds only the stage's part of the rest (the embedding, or the norm and
    head), so its flats cannot be written as they are: they are cut and laid out again in these."""
    runs = []
    for slots in fsdp.wrap_units(whole_model, unit_classes)[1]:
        first = {}
        for _, _, name, p in slots:
            if p.requires_grad:
                first.setdefault(id(p), (name, p.shape))
        if first:
            runs.append(list(first.values()))
    return runs


def whole_on(tensors: dict, holder: bool) -> dict | None:
    """Each tensor of `tensors`, whole, copied to the holder's CPU (None on the other ranks), one at a
    time. A DTensor (FSDP2's shard) is gathered first, by every rank that holds a shard of it, in the
    same order; a plain tensor (DDP's, or slices already joined) is whole already."""
    from torch.distributed.tensor import DTensor

    kept = {} if holder else None
    for key, t in tensors.items():
        if isinstance(t, DTensor):
            t = t.full_tensor()
        if holder:
            kept[key] = t.detach().to("cpu", copy=True)
        del t
    return kept


def on_rank0(model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
    """A full checkpoint's end of the chain: what rank 0 holds; the other ranks hand out nothing."""
    return (model_sd, optim_sd) if dist.get_rank() == 0 else ({}, {})
