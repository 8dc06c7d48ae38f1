"""The bubble of a pipeline, measured (`minidist/bench/bubble.py`): a real run on CPU
ranks, GPipe and 1F1B, m = 1, 2, 4 and 8 micro-batches of one sequence each, on 2 stages and on 4;
each stage's measured work per action replayed on a core per stage, its idle share of the step
against (p - 1) / (m + p - 1). A table that runs one micro-batch at a time through the stages idles
(p - 1) / p whatever m, and shows the measurement can tell. And the executor's `no_sync` hook,
entered around every backward of a rank's list but the last.

Every case of one world size runs in one launch. The band is measured, not guessed: see BAND."""

import statistics
from contextlib import contextmanager

import pipeline_workers
import pytest

from minidist.bench import bubble
from minidist.parallel.pipeline import executor, schedules, stages
from minidist.runtime.launch import launch

# The full suite only: the bubble measured on a core per stage, a benchmark.
pytestmark = pytest.mark.slow

# Micro-batches of one sequence, the same work per action whatever m (the formula's setting), on a
# model whose stages are nearly equal (a 64-token vocabulary: the head is 1% of a 2-layer stage).
SIZES = {"hidden": 256, "layers": 4, "vocab": 64, "length": 64, "micro_batch": 1, "steps": 5}
CASES = {2: [(name, m) for name in ("gpipe", "1f1b") for m in (1, 2, 4, 8)],
         4: [("gpipe", 4), ("1f1b", 4), ("1f1b", 8)]}
SERIAL_M = 4
# The band, measured: over eleven runs (seven at p = 2, four at p = 4, load averages 15 to 54 on the shared
# 2-core machine) a stage's median idle share on a core per stage strayed from the formula by -0.06 to
# +0.09 (the stages' small imbalance, and CPU times on a loaded machine). What it must catch is larger: a
# formula off by one, (p - 1) / (m + p), is 0.17 off at p = 2, m = 1; one micro-batch at a time idles 0.3
# more than GPipe at p = 2, m = 4. Later runs on a quiet machine saw one stage 0.12 and 0.15 off (GPipe,
# m = 8 and m = 4), the other stage then off the other way (the stages' work moves against each other from
# run to run): their mean stayed within 0.06. So the stages' mean is held to BAND, each stage to STAGE_BAND.
BAND = 0.10
STAGE_BAND = 0.25


def one_at_a_time(m: int, pp: int) -> list:
    """No pipelining: each micro-batch goes forward and back through every stage before the next
    starts (a model split by depth, with plain gradient accumulation). A valid table, but p - 1 of
    the p stages idle at any moment: the bubble is (p - 1) / p, whatever m."""
    return [[action for i in range(m) for action in (("F", i), ("B", i))] for _ in range(pp)]


def tables(pp: int) -> dict:
    return {**{case: schedules.table(*case, pp) for case in CASES[pp]}, ("serial", SERIAL_M): one_at_a_time(SERIAL_M, pp)}


@pytest.fixture(scope="module", params=sorted(CASES))
def measured(request):
    """For p = 2 and p = 4: every case's table and each rank's (timeline, step_time, work) per step,
    from one launch of p ranks; a table that is the same as another's (GPipe and 1F1B at m = 1 on 2
    stages) runs once."""
    pp = request.param
    by_case = tables(pp)
    distinct = []
    for table in by_case.values():
        if table not in distinct:
            distinct.append(table)
    by_rank = launch(bubble.measure, pp, distinct, timeout_s=300, **SIZES)
    return pp, {case: (table, [rank[distinct.index(table)] for rank in by_rank]) for case, table in by_case.items()}


def replayed(table, steps_by_rank) -> list[float]:
    """Each stage's median idle share over the steps, its measured work on a core per stage."""
    return [statistics.median(idle) for idle in bubble.replayed_idle(table, steps_by_rank)]


def near(idle: list[float], expected: float) -> bool:
    """The stages' mean idle within BAND of `expected`, and each stage's within STAGE_BAND (see BAND)."""
    return abs(statistics.mean(idle) - expected) <= BAND and all(abs(x - expected) <= STAGE_BAND for x in idle)


def test_each_stage_idles_as_the_formula_says_on_a_core_per_stage(measured):
    pp, by_case = measured
    for case in CASES[pp]:
        idle = replayed(*by_case[case])
        assert near(idle, bubble.expected(pp, case[1])), (pp, case, idle)


def test_one_micro_batch_at_a_time_does_not_pipeline(measured):
    # (p - 1) / p at m = 4, where GPipe and 1F1B idle (p - 1) / (m + p - 1): 1/2 against 1/5 at p = 2.
    pp, by_case = measured
    idle = replayed(*by_case["serial", SERIAL_M])
    assert near(idle, (pp - 1) / pp), (pp, idle)


def test_the_timeline_is_the_rank_s_list_in_order_and_its_work_fits_in_it(measured):
    _, by_case = measured
    for table, steps_by_rank in by_case.values():
        for rank, steps in enumerate(steps_by_rank):
            for timeline, step_time, work in steps:
                assert [(kind, i) for kind, i, _, _ in timeline] == table[rank]
                ends = [0.0] + [t for _, _, start, end in timeline for t in (start, end)] + [step_time]
                assert ends == sorted(ends), (rank, timeline, step_time)  # one action after another, inside the step
                # A thread computes no more CPU seconds than the host's clock saw pass (to a millisecond:
                # the two clocks are read one after the other, and the CPU clock is accounted in ticks).
                assert all(0 < cpu <= end - start + 1e-3 for cpu, (_, _, start, end) in zip(work, timeline))


def test_the_run_on_this_machine_is_no_faster_than_on_a_core_per_stage(measured):
    _, by_case = measured
    for table, steps_by_rank in by_case.values():
        for n in range(SIZES["steps"]):
            replayed_step = max(timeline[-1][3] for timeline in bubble.replay(table, [s[n][2] for s in steps_by_rank]))
            assert max(steps[n][1] for steps in steps_by_rank) >= replayed_step


def test_idle_fraction_and_bars_on_a_drawn_timeline():
    # Two equal stages, one micro-batch: forward 1 s, backward 2 s on each. The step is 6 s, each
    # stage computes 3 s of it: half idle, as (p - 1) / (m + p - 1) says at p = 2, m = 1.
    timelines = [[("F", 0, 0.0, 1.0), ("B", 0, 4.0, 6.0)], [("F", 0, 1.0, 2.0), ("B", 0, 2.0, 4.0)]]
    assert [bubble.idle_fraction(t, 6.0) for t in timelines] == [0.5, 0.5] == [bubble.expected(2, 1)] * 2
    assert bubble.stage_idle([[(timelines[0], 6.0)], [(timelines[1], 4.0)]]) == [[0.5], [0.5]]  # the pipeline's step
    assert bubble.bars(timelines) == [(0, "F", 0, 0.0, 1.0), (0, "B", 0, 4.0, 6.0),
                                      (1, "F", 0, 1.0, 2.0), (1, "B", 0, 2.0, 4.0)]
    assert bubble.gantt(timelines, 6.0, width=6) == "rank 0: F...BB\nrank 1: .FBB.."
    assert bubble.expected(4, 8) == 3 / 11


def test_replay_of_drawn_work():
    # The same two stages, replayed: that step again, and GPipe at m = 2 lasts (m + p - 1)(t_f + t_b) = 9 s.
    assert bubble.replay(schedules.table("gpipe", 1, 2), [[1.0, 2.0], [1.0, 2.0]]) == [
        [("F", 0, 0.0, 1.0), ("B", 0, 4.0, 6.0)], [("F", 0, 1.0, 2.0), ("B", 0, 2.0, 4.0)]]
    gpipe = bubble.replay(schedules.table("gpipe", 2, 2), [[1.0, 1.0, 2.0, 2.0]] * 2)
    assert [action[2:] for action in gpipe[0]] == [(0.0, 1.0), (1.0, 2.0), (5.0, 7.0), (7.0, 9.0)]
    assert [bubble.idle_fraction(t, 9.0) for t in gpipe] == pytest.approx([bubble.expected(2, 2)] * 2, abs=1e-12)
    # A heavier last stage sets the pace: stage 0 idles more than the formula, the last less.
    slow = bubble.replay(schedules.table("1f1b", 4, 2), [[1.0, 2.0] * 4, [1.5, 3.0] * 4])
    step = max(t[-1][3] for t in slow)
    assert bubble.idle_fraction(slow[0], step) > bubble.expected(2, 4) > bubble.idle_fraction(slow[1], step)
    with pytest.raises(ValueError, match="deadlock"):
        bubble.replay([[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 0), ("F", 1), ("B", 0), ("B", 1)]], [[1.0] * 4] * 2)


def test_the_command_refuses_a_pipeline_deeper_than_the_model_in_one_line(capsys):
    with pytest.raises(SystemExit) as stopped:
        bubble.main(["--pp", "5", "--layers", "4"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--pp_size 5 is larger than the model's 4 decoder layers" in err and "\n" not in err


class Counting:
    """A stand-in for `strategy.no_sync(model)`: counts its entries and knows when it is inside."""

    def __init__(self):
        self.entered, self.inside = 0, False

    @contextmanager
    def __call__(self):
        self.entered, self.inside = self.entered + 1, True
        try:
            yield
        finally:
            self.inside = False


NO_SYNC = {  # a one-stage table -> for each backward in its order, whether no_sync is around it
    "gpipe m=4": (schedules.table("gpipe", 4, 1), [True, True, True, False]),
    "m=1": (schedules.table("1f1b", 1, 1), [False]),
    "the last in the list is not the last micro-batch": ([[("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 0), ("B", 1)]],
                                                         [True, True, False]),
}


@pytest.mark.parametrize("name", NO_SYNC)
def test_no_sync_is_around_every_backward_but_the_last_of_the_rank_s_list(name):
    table, inside = NO_SYNC[name]
    model = pipeline_workers.tiny_llama(num_layers=2)
    stage = stages.Stage(model, 0, 1)  # one stage: no messages, no process group
    no_sync = Counting()
    seen = []  # for each backward, in order: was no_sync entered when it computed this weight's gradient?
    next(stage.parameters()).register_hook(lambda grad: seen.append(no_sync.inside))
    run = executor.Executor(stage, no_sync=no_sync)
    batch = pipeline_workers.global_batch(model.config.vocab_size, 0)
    m = len(inside)
    for _ in range(2):
        run.step(table, pipeline_workers.split(batch, m), pipeline_workers.targets(batch))
    assert no_sync.entered == 2 * (m - 1)
    assert seen == inside * 2
