"""What this torch can do, asked of torch itself, where a feature is used: one line where it cannot.

`requirements.txt` admits torch 2.9 and newer (README, "Which torch": the oldest the fast tier has
passed on, 2.7 and 2.8 untried, and the first whose torchrun passes SLURM's warning on); CI runs
2.13, and `.ci/compat` runs the fast tier on others. A torch in that range may still lack what came later, and a cluster's
own torch (a `module load`) may be older than the range. So each feature that some of them lack is
probed here, from the API itself rather than from a version number (a site's build may carry a
backport, and a nightly has no release number), and asked for where it is needed: a run that needs
one this torch lacks stops before the model loads, in one line that says what is missing, what
uses it, and what to do instead.

- `pipeline_scale_grads`: PyTorch's pipeline schedules take `scale_grads` (torch 2.6's do not).
  Lesson 12's `--impl torch --pp_size` passes `scale_grads=False`: the loss is already divided by the
  global batch's target count, and 2.6's schedules would divide the gradients by m again.
- `pipeline_fewer_microbatches`: PyTorch's GPipe takes fewer micro-batches than stages (2.13's
  does; 2.9's refuses, "Number of microbatches (1) must be greater than or equal to the number of
  stages (2)", as 1F1B does in both). Lesson 12's PyTorch pipeline runs GPipe where m < p
  (`parallel/pipeline/reference.py`), so such a run needs it: refused before the model loads.
- `fsdp2_on_cpu`: FSDP2 records an event on its streams after each collective; on CPU ranks (gloo,
  the laptop and the tests) those are `torch.cpu.Stream`s, which have `record_event` in 2.13 and not
  in 2.6 ("'Stream' object has no attribute 'record_event'" in the first forward). On a GPU, CUDA's
  streams always had it.
- torchrun's signals: torchrun forwards signals to its workers (`--signals-to-handle`, torch 2.9)
  and waits for them to exit (`--shutdown-timeout`). The SLURM script reads torchrun's own flags
  (`slurm/chess_finetune.sh`) and says in one line what a site's torchrun cannot do.
- Collectives on the caller's stream: since PyTorch PR #150398 (2.8) a synchronous NCCL collective
  runs on the current stream, and the hand-written FSDP's side streams (`parallel/streams.py`) are
  then where its collectives run. Before it, ProcessGroupNCCL runs them on its own stream and makes
  the caller's stream wait: the same results, in the same order, with the side streams only
  waiting. Nothing to refuse, so nothing is probed.
"""

import inspect


def pipeline_scale_grads() -> bool:
    """Whether PyTorch's pipeline schedules take `scale_grads` (module doc)."""
    from torch.distributed.pipelining import Schedule1F1B

    return "scale_grads" in inspect.signature(Schedule1F1B).parameters


def pipeline_fewer_microbatches() -> bool:
    """Whether PyTorch's `ScheduleGPipe` takes fewer micro-batches than stages (module doc): asked of
    its constructor, on a stand-in for a stage of 2 that carries only what the check reads."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import ScheduleGPipe

    try:
        ScheduleGPipe(SimpleNamespace(num_stages=2), 1)
    except ValueError as refused:
        return "microbatches" not in str(refused)
    except (AttributeError, TypeError):  # past the check: the stand-in lacks what a real stage has
        return True
    return True


def fsdp2_on_cpu() -> bool:
    """Whether FSDP2 can run on CPU ranks: CPU streams that record events (module doc)."""
    import torch

    return hasattr(torch.cpu.Stream, "record_event")


FEATURES = {  # name -> (probe, what needs it, what to do instead)
    "pipeline_scale_grads": (pipeline_scale_grads, "PyTorch's pipeline schedules (--impl torch --pp_size) need "
                             "their scale_grads argument",
                             "use the hand-written pipeline (--impl minidist) or a newer torch (2.13 has it)"),
    "pipeline_fewer_microbatches": (pipeline_fewer_microbatches, "PyTorch's pipeline with fewer micro-batches "
                                    "(--gradient_accumulation_steps) than stages (--pp_size) needs a GPipe that takes them",
                                    "give at least as many micro-batches as stages, use the hand-written pipeline "
                                    "(--impl minidist), or a newer torch (2.13 has it)"),
    "fsdp2_on_cpu": (fsdp2_on_cpu, "PyTorch's FSDP2 on CPU ranks (--impl torch without a GPU) needs CPU streams that "
                     "record events",
                     "use the hand-written FSDP (--impl minidist), a GPU, or a newer torch (2.13 has it)"),
}


def require(name: str) -> None:
    """Raise a ValueError, in one line, if this torch lacks the feature `name` (`FEATURES`): the
    options' own kind of refusal, which every command says in one line."""
    import torch

    probe, needs, instead = FEATURES[name]
    if not probe():
        raise ValueError(f"{needs}, which torch {torch.__version__} does not have: {instead}")
