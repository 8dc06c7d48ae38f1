"""Checkpoint forms: one chain, the data-parallel form first, then each axis in the order it cut.

What a checkpoint holds is the strategy's state in one of two forms (`checkpoint/state.py` writes
them): **full**, whole tensors by name on rank 0, the form a run of any layout can load; or
**sharded**, each rank's own pieces, which DCP writes in parallel and reshards on load where it can.

The form is built as the model was: the data-parallel strategy's form (`data.py`: by parameter
name, or flat shards) gives each rank's state; then each axis, in the order the strategy applied
it, joins what it cut (full: the tensor axis joins the slices, the pipeline the stages) or notes
its layout (sharded: where a piece is only valid at its own layout). Loading runs the chain the
other way: each axis, the last first, cuts a full checkpoint into what its ranks hold (and then
hands the pieces down as each rank's "own") or checks the layout a sharded one noted.

Each link is an object with `get(strategy, model, optimizer, how, below)` and `set(strategy, model,
optimizer, model_sd, optim_sd, how, below)`, where `below` is the rest of the chain. A new axis
brings its own link (`Axis.form`); nothing else here changes.
"""

from minidist.runtime.errors import UsageError
from minidist.strategy.state.data import ByParameter, Flat, on_rank0

FORMS = {"by_parameter": ByParameter(), "flat": Flat()}  # the data-parallel forms, by `Strategy.form_kind`


def get_state_dict(strategy, model, optimizer, full: bool) -> tuple[dict, dict]:
    """The model's and the optimizer's state for a checkpoint, keyed by parameter name (flats: by
    their first parameter's name). full=True: whole tensors on rank 0's CPU, empty dicts elsewhere;
    full=False: each rank's own pieces (DTensors where sharded), for DCP."""
    links = [axis.form for axis in strategy.axes if axis.form is not None]

    def below(i: int):
        if i < 0:
            return lambda how: FORMS[strategy.form_kind].get(strategy, model, optimizer, how)
        return lambda how: links[i].get(strategy, model, optimizer, how, below(i - 1))

    how = "full" if full else "sharded"
    model_sd, optim_sd = below(len(links) - 1)(how)
    return on_rank0(model_sd, optim_sd) if full else (model_sd, optim_sd)


def set_state_dict(strategy, model, optimizer, model_sd: dict, optim_sd: dict, full: bool) -> None:
    """Load what `get_state_dict` gave (sharded: after DCP filled it in); full=True: rank 0 holds it
    and the other ranks pass {}: each link cuts it into what its ranks hold."""
    links = [axis.form for axis in strategy.axes if axis.form is not None]

    def below(i: int):
        if i < 0:
            return lambda msd, osd, how: FORMS[strategy.form_kind].set(strategy, model, optimizer, msd, osd, how)
        return lambda msd, osd, how: links[i].set(strategy, model, optimizer, msd, osd, how, below(i - 1))

    below(len(links) - 1)(model_sd, optim_sd, "full" if full else "sharded")


# The layouts a sharded checkpoint may record (`tensor.LAYOUT`, `pipeline.LAYOUT`), as the flag that sets each.
RECORDED = {"tensor_parallel_layout": "--tp_size", "pipeline_layout": "--pp_size"}


def check_recorded_layouts(folder, saved_keys, optim_sd: dict) -> None:
    """Before DCP reads a sharded checkpoint: the layouts it recorded (`saved_keys`, the keys of its
    metadata) must be the ones this run records (`optim_sd`, from `get_state_dict`), or the run is
    refused in one line. Each link checks the layout's numbers once DCP has read them; this catches
    a layout recorded on one side only (a checkpoint of --tp_size 2 at tp 1, a hand-FSDP one of
    --pp_size 2 at pp 1, one without --tp_size at --tp_size 2), where DCP would stop on a missing
    key, or would load slices or stages as if the layout were the same."""
    theirs = {name for name in RECORDED if f"optimizer.{name}" in saved_keys}
    ours = {name for name in RECORDED if name in optim_sd}
    if theirs != ours:
        said = lambda names: " and ".join(f"{RECORDED[n]} above 1" for n in sorted(names)) or "neither --tp_size nor --pp_size above 1"
        raise UsageError(f"checkpoint {folder} is a sharded checkpoint written with {said(theirs)}, and this run has "
                         f"{said(ours)}; a sharded checkpoint resumes at its own layout only: resume with the flags "
                         f"that wrote it, or save with --checkpoint_format full to change the layout")
