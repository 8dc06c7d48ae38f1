"""Workers for tests/memory/test_pipeline_memory.py, run in each rank by `launch`: each rank is one
stage of the tiny Llama of tests/parallel/test_pipeline.py, in float32, trained for two steps by
the hand-written executor; the second step (AdamW's states exist by then) is measured."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from minidist.memory import measure
from minidist.memory.pipeline import HeldActivations
from minidist.strategy.options import ADAMW_OPTIONS
from minidist.parallel.pipeline import schedules, stages

sys.path.insert(0, str(Path(__file__).parent.parent / "parallel"))  # the pipeline tests' model and batch
import pipeline_workers  # after the line above: it finds it


def tiny_model():
    """The pipeline tests' Llama (hidden 64, 4 layers), in float32 as a training run holds it."""
    return pipeline_workers.tiny_llama().float()


def stage_memory(schedule: str, m: int, whole_step: bool) -> dict:
    """Two steps of this rank's stage; of the second, the peak of held activations
    (`HeldActivations.peak_bytes`), the model states after the optimizer step and, if `whole_step`,
    the whole step's peak of live tensors (`measure.step_peak`, which slows the step several times)."""
    pp, rank = dist.get_world_size(), dist.get_rank()
    model = tiny_model()
    stage = stages.Stage(model, rank, pp)
    del model  # this rank keeps its stage only
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3, **ADAMW_OPTIONS)
    run = HeldActivations(stage)
    b = pipeline_workers.global_batch(stage.config.vocab_size, 0)
    table, micro_batches = schedules.table(schedule, m, pp), pipeline_workers.split(b, m)

    def step():
        run.step(table, micro_batches, pipeline_workers.targets(b))
        optimizer.step()

    step()
    optimizer.zero_grad(set_to_none=True)
    peak = measure.step_peak(step, stage, optimizer, torch.device("cpu")) if whole_step else step()
    states = measure.model_state_bytes(stage, optimizer)  # after the step, before zero_grad
    optimizer.zero_grad(set_to_none=True)
    return {"activations": run.peak_bytes, "held": run.peak_held, "peak": peak, **states}


def cases(specs: list) -> list:
    """`stage_memory` of every (schedule, m, whole_step) of this launch, in order."""
    return [stage_memory(*spec) for spec in specs]
