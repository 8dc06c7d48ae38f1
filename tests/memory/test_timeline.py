"""The pictures of lessons 02, 04 and 05 from real runs: profiler traces sorted into lanes, and
the memory timeline of one step.

- Bucketed DDP on 2 gloo ranks: gloo runs all-reduces while backward still computes; the naive
  DDP, whose all-reduces all start after the last gradient, is the control.
- Hand-written FSDP on 2 ranks: the next unit's all-gather is issued inside the current unit's
  forward; with prefetch switched off, the control, it never is.
- The memory timeline's highest sample is the peak `LiveTensors` measures for the same step.
"""

import pytest
import torch

from minidist.bench import timeline
from minidist.runtime.launch import launch
from minidist.memory import measure
from minidist.memory.timeline import step_timeline

import timeline_workers

# The full suite only: a memory timeline recorded over a launched run.
pytestmark = pytest.mark.slow

PHASES = ("forward", "backward", "optimizer step")


def lanes_of(tiny_model, tmp_path, name, strategy, **kwargs):
    trace = tmp_path / f"{name}.json"
    launch(timeline_workers.traced_step, 2, tiny_model, str(trace), strategy, timeout_s=300, **kwargs)
    return timeline.cpu_lanes(trace, PHASES)


def test_bucketed_ddp_trace_shows_all_reduces_running_while_backward_computes(tiny_model, tmp_path):
    bucketed = lanes_of(tiny_model, tmp_path, "bucketed", "ddp", ddp_variant="bucketed", bucket_cap_mb=0.05)
    naive = lanes_of(tiny_model, tmp_path, "naive", "ddp", ddp_variant="naive")
    for lanes in (bucketed, naive):  # events of every kind the figure draws
        assert [n for _, _, n in lanes["phases"]] == list(PHASES)
        assert lanes["compute (main thread)"]
        assert {n for _, _, n in lanes["collectives issued (main thread)"]} == {"c10d::allreduce_"}
        assert {n for _, _, n in lanes["collectives running (gloo threads)"]} == {"gloo:all_reduce"}
    assert len(bucketed["collectives running (gloo threads)"]) > 1
    assert timeline.ran_while_computing(bucketed, "backward"), "no bucket all-reduced while backward computed"
    assert timeline.ran_while_computing(naive, "backward") == []


def test_fsdp_trace_shows_the_next_units_gather_issued_inside_the_current_units_forward(tiny_model, tmp_path):
    with_prefetch = lanes_of(tiny_model, tmp_path, "fsdp", "fsdp")
    without = lanes_of(tiny_model, tmp_path, "fsdp_no_prefetch", "fsdp", prefetch=False)
    assert [n for _, _, n in with_prefetch["units"]] == ["unit 0 forward", "unit 1 forward"]  # 2 layers
    assert {n for _, _, n in with_prefetch["collectives running (gloo threads)"]} >= {"gloo:all_gather"}
    assert timeline.issued_before_compute_ends(with_prefetch) == [(0, 1)]  # layer 0 prefetches layer 1
    assert timeline.issued_before_compute_ends(without) == []


def test_memory_timeline_peak_is_the_measured_peak_of_the_same_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64)
    held = {}
    phases = [("forward", lambda: held.update(loss=model(x).square().mean())),
              ("backward", lambda: held.pop("loss").backward()),
              ("optimizer step", optimizer.step),
              ("zero_grad", lambda: optimizer.zero_grad(set_to_none=True))]

    def step():
        for _, run in phases:
            run()

    step()  # AdamW's states exist from here on: every later step allocates the same
    measured = measure.step_peak(step, model, optimizer, torch.device("cpu"))
    got = step_timeline(torch.device("cpu"), model, optimizer, phases)
    assert got["peak"] == measured
    assert max(b for _, b in got["samples"]) == measured
    states = measure.model_state_bytes(model, optimizer)  # no gradient between steps
    assert got["start"] == states["parameters"] + states["optimizer_states"]
    assert got["samples"][-1][1] == got["start"]  # what the step made, it let go
    assert [name for name, _, _ in got["phases"]] == [name for name, _ in phases]
    assert all(a <= b for (_, _, a), (_, b, _) in zip(got["phases"], got["phases"][1:]))  # in order
