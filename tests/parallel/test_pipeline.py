"""Pipeline parallelism by hand (`minidist/parallel/pipeline/`): a Llama cut by depth over 2 and 4
CPU ranks, its micro-batches run by GPipe and 1F1B tables, trains as the whole model does in one
process; the bytes between stages are what the cuts need; a table that would deadlock is refused.

Every case of a world size runs in one launch (`pipeline_workers.cases`), shared with the other
pipeline modules (`pipeline_launches`): starting ranks costs more than a case."""

import pipeline_launches
import pipeline_workers
import pytest
import torch

from minidist.parallel.pipeline import executor, schedules, stages

# The full suite only: the pipeline's cases on 2 and 4 ranks (test_fast_parity.py runs one 2-stage
# pipeline through the loop).
pytestmark = pytest.mark.slow

TOLERANCE = 1e-10  # float64: the algorithm, not the rounding (the 1e-5 is for fp32)
PARITY = [(schedule, m) for schedule in ("gpipe", "1f1b") for m in (1, 2, 8)]
SABOTAGE = ["activations", "gradients", "scale"]  # on 2 ranks, 1F1B, 2 micro-batches
# Bytes of the hidden states of one step's global batch: 8 sequences x 16 tokens x 64 wide x float64.
ACTIVATION_BYTES = pipeline_workers.SEQUENCES * pipeline_workers.LENGTH * pipeline_workers.HIDDEN * 8


TWO = [{"schedule": "1f1b", "m": 2, "sabotage": name} for name in SABOTAGE]
TWO += [{"schedule": schedule, "m": m} for schedule, m in PARITY]
FOUR = [{"schedule": schedule, "m": m} for schedule, m in PARITY]
# In the launch of each world size that the pipeline modules share (tests/pipeline_launches.py).
PLANNED = {2: pipeline_launches.plan(2, pipeline_workers.cases, TWO),
           4: pipeline_launches.plan(4, pipeline_workers.cases, FOUR)}


@pytest.fixture(scope="module")
def results():
    """Every case's result by (pp, what)."""
    by_rank_2, by_rank_4 = pipeline_launches.results(PLANNED[2]), pipeline_launches.results(PLANNED[4])
    out = {(2, "sabotage", name): [rank[i] for rank in by_rank_2] for i, name in enumerate(SABOTAGE)}
    out.update({(2, *case): [rank[len(SABOTAGE) + i] for rank in by_rank_2] for i, case in enumerate(PARITY)})
    out.update({(4, *case): [rank[i] for rank in by_rank_4] for i, case in enumerate(PARITY)})
    return out


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule, m", PARITY)
def test_pipeline_matches_one_process(results, pp, schedule, m):
    ranks = results[pp, schedule, m]
    last = ranks[-1]
    for mine, reference in zip(last["losses"], last["reference"], strict=True):
        assert abs(mine - reference) <= TOLERANCE * abs(reference), last["losses"]
    assert all(loss is None for rank in ranks[:-1] for loss in rank["losses"])  # the loss lives on the last stage
    for rank, result in enumerate(ranks):
        assert max(result["worst"].values()) <= 1e-10, (rank, sorted(result["worst"].items(), key=lambda kv: -kv[1])[:3])
    # Every weight of the model is on exactly one stage.
    assert sorted(n for rank in ranks for n in rank["worst"]) == ranks[0]["model"]


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule, m", PARITY)
def test_each_cut_sends_the_activations_forward_and_their_gradients_back(results, pp, schedule, m):
    for rank, result in enumerate(results[pp, schedule, m]):
        directions = (rank < pp - 1) + (rank > 0)  # activations to the next stage, gradients to the one before
        # m micro-batches of 1/m of the batch each: m x (a micro-batch's activation bytes) per direction.
        assert result["sent"] == [directions * m * (ACTIVATION_BYTES // m)] * pipeline_workers.STEPS, (rank, result)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule, m", PARITY)
def test_gpipe_holds_every_micro_batch_and_1f1b_at_most_p_minus_rank(results, pp, schedule, m):
    held = [result["peak_held"] for result in results[pp, schedule, m]]
    assert held == [m if schedule == "gpipe" else min(m, pp - rank) for rank in range(pp)]


@pytest.mark.parametrize("sabotage", SABOTAGE)
def test_each_send_and_the_loss_scale_are_needed(results, sabotage):
    ranks = results[2, "sabotage", sabotage]
    last = ranks[-1]
    loss_off = max(abs(a - b) / abs(b) for a, b in zip(last["losses"], last["reference"]))
    weights_off = max(max(rank["worst"].values()) for rank in ranks)
    assert loss_off > 1e-6 or weights_off > 1e-6, (loss_off, weights_off)


def test_balance_gives_the_remainder_to_the_middle_stages_then_the_first():
    assert [len(r) for r in stages.balance(32, 4)] == [8, 8, 8, 8]
    assert [len(r) for r in stages.balance(6, 4)] == [1, 2, 2, 1]
    assert [len(r) for r in stages.balance(7, 4)] == [2, 2, 2, 1]
    assert [len(r) for r in stages.balance(5, 2)] == [3, 2]
    assert [list(r) for r in stages.balance(5, 3)] == [[0, 1], [2, 3], [4]]  # contiguous, in order
    with pytest.raises(ValueError, match="^--pp_size 5 is larger than the model's 4 decoder layers") as refused:
        stages.balance(4, 5)
    assert "\n" not in str(refused.value)


def test_tied_embeddings_are_refused_in_one_line():
    model = pipeline_workers.tiny_llama(num_layers=2)
    model.config.tie_word_embeddings = True  # the flag is what the stage reads
    with pytest.raises(ValueError, match="^pipeline parallelism needs untied embeddings") as refused:
        stages.Stage(model, 1, 2)
    assert "\n" not in str(refused.value)


def test_the_schedules_print_as_in_the_papers():
    assert schedules.show(schedules.table("1f1b", 4, 2)) == ("rank 0: F0 F1 B0 F2 B1 F3 B2 B3\n"
                                                           "rank 1: F0 B0 F1 B1 F2 B2 F3 B3")
    assert schedules.show(schedules.table("gpipe", 2, 2)) == "rank 0: F0 F1 B0 B1\nrank 1: F0 F1 B0 B1"
    with pytest.raises(ValueError, match="^no pipeline schedule named 'zb'"):
        schedules.table("zb", 4, 2)


BROKEN = {  # a hand-broken table -> the start of its one-line refusal
    "deadlock": ([[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 0), ("F", 1), ("B", 0), ("B", 1)]],
                 "this schedule would deadlock: rank 0 at B0 waits for rank 1, rank 1 at F1 waits for rank 0"),
    "order": ([[("F", 1), ("F", 0), ("B", 0), ("B", 1)], [("F", 0), ("F", 1), ("B", 0), ("B", 1)]],
              "schedule out of order: rank 1's F0 would receive micro-batch 1's activations from rank 0"),
    "missing": ([[("F", 0), ("F", 1), ("B", 0)], [("F", 0), ("F", 1), ("B", 0), ("B", 1)]],
                "rank 0's schedule must run F and B of each of the 2 micro-batches once"),
}


@pytest.mark.parametrize("broken", BROKEN)
def test_a_table_that_cannot_run_is_refused_before_any_message(broken):
    # No process group exists here: the refusal comes before the executor sends or receives anything.
    table, expected = BROKEN[broken]
    model = pipeline_workers.tiny_llama(num_layers=2)
    run = executor.Executor(stages.Stage(model, 0, 2))
    batch = pipeline_workers.global_batch(model.config.vocab_size, 0)
    with pytest.raises(ValueError) as refused:
        run.step(table, pipeline_workers.split(batch, 2), 100)
    assert str(refused.value) == expected and "\n" not in expected
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("name, m", [("gpipe", 1), ("gpipe", 8), ("1f1b", 1), ("1f1b", 3), ("1f1b", 8)])
@pytest.mark.parametrize("pp", [2, 4, 8])
def test_the_schedules_pass_the_check(name, m, pp):
    executor.check(schedules.table(name, m, pp), m)
