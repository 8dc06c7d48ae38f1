"""The CPU threads a torchrun rank would get, so that the GPU check times offload as a job meets it.

`python -m minidist.bench gpu` is one process started by `python`, and PyTorch gives it every
core. A training job is not: `torchrun --nproc_per_node N` with N > 1 sets OMP_NUM_THREADS=1 in
its workers when the variable is unset (torch/distributed/run.py), so each rank computes on one
CPU thread, unless the loop raises it. With `--cpu_offload` it does: `use_cores_for_offload` gives
the optimizer step the rank's share of the cores SLURM gave its task (`offload_threads`). Timed on
every core, ZeRO-Offload's AdamW would look faster than any job of N ranks could make it.

So the check decides, from this environment and the job's ranks per node, what a rank's thread
count would be, and times the offload rows under it (`using`). The decision is pure (`job_threads`),
so the tests hold it to torchrun's and the loop's rules without a GPU.
"""

import contextlib
from collections.abc import Mapping

import torch

from minidist.runtime.distributed import offload_threads


def torchrun_environ(environ: Mapping[str, str], ranks_per_node: int) -> dict[str, str]:
    """The environment a torchrun worker would see, started with `--nproc_per_node ranks_per_node`
    from `environ`: OMP_NUM_THREADS=1 when unset and more than one rank (torchrun's rule), and its
    LOCAL_WORLD_SIZE."""
    worker = dict(environ, LOCAL_WORLD_SIZE=str(ranks_per_node))
    if "OMP_NUM_THREADS" not in environ and ranks_per_node > 1:
        worker["OMP_NUM_THREADS"] = "1"
    return worker


def job_threads(environ: Mapping[str, str], usable_cores: int, default_threads: int, ranks_per_node: int,
                cpu_offload: bool) -> tuple[int, str]:
    """(threads, where the figure comes from) for one rank of a torchrun job of `ranks_per_node`
    ranks on this node. With `cpu_offload`, the loop's own decision (`offload_threads`, what
    `use_cores_for_offload` sets). Without, the rank keeps what it started with: torchrun's
    OMP_NUM_THREADS, or where none is set the count it would start with (`default_threads`: this
    process's, PyTorch's default on a GPU node)."""
    worker = torchrun_environ(environ, ranks_per_node)
    if cpu_offload:
        return offload_threads(worker, usable_cores)
    chosen = worker.get("OMP_NUM_THREADS", "")
    if chosen.isdigit() and int(chosen) >= 1:
        set_by = "torchrun" if "OMP_NUM_THREADS" not in environ else "the environment"
        return int(chosen), f"OMP_NUM_THREADS={chosen}, set by {set_by}"
    return default_threads, "this process's: OMP_NUM_THREADS unset and one rank per node, torchrun sets nothing"


@contextlib.contextmanager
def using(threads: int):
    """Run the block on `threads` intra-op CPU threads, then give back the count there was."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
