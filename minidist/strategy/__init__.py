"""How a run combines the mechanisms of `parallel/`: one data-parallel strategy plus the axes.

    options.py   every parallel option of a run, in one dataclass (`ParallelOptions`)
    base.py      `Strategy`: the interface the loop calls, and the axes applied in order
    data.py      the data-parallel strategies, hand-written and PyTorch's: DDP, ZeRO-1/2, FSDP, HSDP
    axis.py      `Axis`: what an axis answers where its cut shows
    tensor.py    the tensor axis (lesson 11): cut, loss from the vocabulary's slices, weights joined
    pipeline.py  the pipeline axis (lesson 12): cut a stage, the schedule, its norm group, stages joined
    clip.py      gradient clipping: one function over every strategy's pieces and every axis's groups
    state/       checkpoint forms: the data-parallel form, then each axis joins or cuts it

`get_strategy(options, env)` picks the class by implementation and name from `STRATEGY_CLASSES`.
"""

from minidist.strategy.base import Strategy, wrap_policy_classes
from minidist.strategy.data import MinidistDDP, MinidistFSDP, MinidistZeRO, TorchDDP, TorchFSDP, load_on_rank0
from minidist.strategy.options import ParallelOptions

# Which class runs which strategy: (implementation, name) -> class. PyTorch has no ZeRO-1/2 of its own.
STRATEGY_CLASSES = {
    ("torch", "ddp"): TorchDDP, ("torch", "fsdp"): TorchFSDP,
    ("minidist", "ddp"): MinidistDDP, ("minidist", "zero1"): MinidistZeRO, ("minidist", "zero2"): MinidistZeRO,
    ("minidist", "fsdp"): MinidistFSDP,
    # HSDP is FSDP on a 2-D mesh: the same classes, over the groups `parallel/mesh.py` builds for it.
    ("torch", "hsdp"): TorchFSDP, ("minidist", "hsdp"): MinidistFSDP,
}


def get_strategy(options: ParallelOptions, env, mesh=None) -> Strategy:
    """The strategy `options` name, on the process groups of `mesh` (default: built from the options).
    Raises ValueError or NotImplementedError, in one line naming the flag, for options that cannot run."""
    options.check()
    return STRATEGY_CLASSES[(options.impl, options.strategy)](options, env, mesh)
