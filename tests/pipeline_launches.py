"""One launch per world size for the pipeline test modules together.

Four modules run pipeline cases on 2 and 4 CPU ranks (tests/parallel/test_pipeline.py,
test_pipeline_reference.py, test_pipeline_generate.py, tests/memory/test_pipeline_memory.py). Each
launch of its own would start its ranks again, and a rank's start (forking it, importing what its
worker needs, joining the group) costs several CPU seconds (about 5 on the loaded 2-core CPU that
measured it, tests/parallel/test_hsdp.py's four launches against one). So each module says, when it is
imported, what it will run (`plan`), and the first module that asks for a world size's results
(`results`) launches every case planned for it, of every module, one after the other in the
same ranks. pytest imports every module it collects before it runs any test, so a session that
collects the four launches twice in all; one module run alone launches only its own cases.

A case that raises ends the launch, and with it every module's cases of that world size: the
error names the case (`launch` reraises the rank's traceback).
"""

from minidist.runtime.launch import launch

_planned: dict[int, list] = {}  # world size -> [(worker function, its arguments)], in the order planned
_results: dict[int, list] = {}  # world size -> each rank's list of results, in the same order


class Later:
    """An argument made in this process when the launch runs, not when the module is imported:
    `plan(..., Later(make))` passes `make()` (a one-process reference costs seconds to train, and a
    session that collects the module without running it should not pay for it)."""

    def __init__(self, make):
        self.make = make


def plan(world_size: int, fn, *args) -> tuple[int, int]:
    """Run `fn(*args)` in every rank of the launch of `world_size` ranks; return the handle that
    `results` takes. `fn` must be importable by name in the ranks (a module's function)."""
    if world_size in _results:
        raise RuntimeError(f"the {world_size}-rank pipeline launch already ran: plan before any results are asked for")
    _planned.setdefault(world_size, []).append((fn, args))
    return world_size, len(_planned[world_size]) - 1


def results(handle: tuple[int, int]) -> list:
    """What the planned call returned, by rank; the launch of its world size runs at the first call."""
    world_size, index = handle
    if world_size not in _results:
        planned = [(fn, [a.make() if isinstance(a, Later) else a for a in args]) for fn, args in _planned[world_size]]
        _results[world_size] = launch(run_planned, world_size, planned, timeout_s=900)
    return [rank[index] for rank in _results[world_size]]


def run_planned(planned: list) -> list:
    """In each rank: every planned call, in order."""
    return [fn(*args) for fn, args in planned]
