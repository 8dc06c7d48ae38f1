"""Does this run fit the GPUs it got? The estimate against the smallest of them, before the model loads.

A partition that mixes A100s of 40 and 80 GB hands a job either kind unless the job asks for one
(a constraint, `SBATCH_CONSTRAINT=gpu80`). The capstone run, estimated at 42.0 GB per GPU, then
dies of CUDA out-of-memory in its first step, after a load of one to three minutes, with a
traceback that names neither the GPU nor the way out. So `slurm/chess_finetune.sh` asks every
node's `nvidia-smi` for its GPUs' memory first, and runs

    python -m minidist.memory MODEL <the run's flags> --gpu_memory <the smallest> --must_fit

which says in one line that the run fits, or refuses it in one line (exit status 2) that names the
estimate, the GPU's memory and each change of flags under which the estimate fits, with its peak.
The GPU's memory is what nvidia-smi reports (an A100-40GB: 40,960 MiB, 42.95 GB), and the run
must fit in it less `RESERVE`. For the capstone's run (41.97 GB) on an A100-40GB the line names
`--gradient_checkpointing` (33.69 GB), `--cpu_offload` (18.29 GB) and `--batch_size_per_device 2`
(36.02 GB); `tests/memory/test_fit.py` holds these. The changes are tried one at a time, then in
pairs where none fits alone (`alternatives`); none is applied for the learner, who chooses what to
give up: compute (recomputing activations), host memory and PCIe time (offload), or the size of a
micro-batch.

The estimate is the estimator's (`estimator.py`), which the tests hold to measured peaks within a
few percent; a run that fits by less than that margin may still not. It covers the data-parallel
strategies, tensor parallelism and LoRA; a pipeline's estimate is per stage (`pipeline.py`), and
is not checked here.
"""

from dataclasses import replace

from minidist.memory.estimator import Setup, Shape, estimate, largest_batch
from minidist.memory.report import _size

SHARDS_GRADIENTS = ("zero2", "fsdp", "hsdp")  # where --accumulate_sharded applies
# Bytes the estimate does not count: the CUDA context, NCCL's buffers, the allocator's fragmentation.
# The same room `python -m minidist.memory --gpu_memory 80GB` leaves an A100 that reports 85.1e9
# bytes (81,920 MiB, as nvidia-smi says); the GPU check's rows are gated by it too (`bench/gate.py`).
RESERVE = 5e9


def with_flag(setup: Setup, **options) -> Setup:
    """The setup with these parallel options changed (`gradient_checkpointing=True`, ...)."""
    return replace(setup, options=replace(setup.options, **options))


def single_changes(setup: Setup) -> dict[str, Setup]:
    """The flags a run could add, each alone, that lower its peak: flag -> the setup with it."""
    o, changes = setup.options, {}
    if o.strategy in SHARDS_GRADIENTS and setup.gradient_accumulation_steps > 1 and not o.accumulate_sharded:
        changes["--accumulate_sharded"] = with_flag(setup, accumulate_sharded=True)
    if not o.gradient_checkpointing:
        changes["--gradient_checkpointing"] = with_flag(setup, gradient_checkpointing=True)
    if o.strategy in ("ddp", "zero1", "zero2"):
        changes["--strategy fsdp"] = with_flag(setup, strategy="fsdp", impl="minidist")
    if o.strategy == "fsdp" and o.impl == "minidist" and not o.cpu_offload and not setup.lora_rank:
        changes["--cpu_offload"] = with_flag(setup, cpu_offload=True)
    return changes


def alternatives(shape: Shape, setup: Setup, gpu_memory: float) -> list[tuple[str, float]]:
    """Changes of flags under which the estimate fits in `gpu_memory`, each with its peak: every
    single change that fits, else the pairs of them that do; and a smaller batch per device where
    one of at least 1 fits (the total batch then kept by more accumulation)."""
    peaks = {}
    for flag, changed in single_changes(setup).items():
        try:
            peaks[flag] = estimate(shape, changed)["peak"]
        except (ValueError, NotImplementedError):  # a combination the estimator does not cover
            continue
    fitting = [(flag, peak) for flag, peak in peaks.items() if peak <= gpu_memory]
    if not fitting:
        flags = list(peaks)
        for i, first in enumerate(flags):
            for second in flags[i + 1:]:
                both = single_changes(single_changes(setup)[first]).get(second)
                if both is None:
                    continue
                try:
                    peak = estimate(shape, both)["peak"]
                except (ValueError, NotImplementedError):
                    continue
                if peak <= gpu_memory:
                    fitting.append((f"{first} {second}", peak))
    batch = largest_batch(shape, setup, gpu_memory)
    if 1 <= batch < setup.batch_size_per_device:
        fitting.append((f"--batch_size_per_device {batch}",
                        estimate(shape, replace(setup, batch_size_per_device=batch))["peak"]))
    return fitting


def verdict(shape: Shape, setup: Setup, gpu_memory: float) -> str:
    """One line where the run fits in a GPU that reports `gpu_memory` bytes, less `RESERVE`; a
    ValueError, in one line, with what would fit, where it does not."""
    peak, room = estimate(shape, setup)["peak"], gpu_memory - RESERVE
    if peak <= room:
        return (f"fits: the estimated peak, {_size(peak)} per GPU, and {_size(RESERVE)} for what it leaves out are "
                f"within the {_size(gpu_memory)} of the smallest GPU here")
    ways = alternatives(shape, setup, room)
    said = "; ".join(f"{flag} ({_size(p)})" for flag, p in ways) or "none of --accumulate_sharded, " \
        "--gradient_checkpointing, --strategy fsdp, --cpu_offload or a smaller batch, alone or in pairs: more GPUs"
    message = (f"the estimated peak, {_size(peak)} per GPU, and {_size(RESERVE)} for what it leaves out (the CUDA "
               f"context, NCCL's buffers, fragmentation) are more than the {_size(gpu_memory)} of the smallest GPU "
               f"here: the run would stop, out of memory, in its first step; what fits (estimated peak): {said}")
    raise ValueError(message)
