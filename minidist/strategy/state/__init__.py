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
