"""PyTorch's pipeline (`minidist/parallel/pipeline/reference.py`: `torch.distributed.pipelining`'s
GPipe and 1F1B around the same stages) trains as the whole model does in one process, and as the
hand-written executor does; what it sends; what it refuses.

Every case runs in one launch of 4 ranks (`pipeline_reference_workers.cases`), shared with the other
pipeline modules (`pipeline_launches`): pp 4 on the world, pp 2 on two groups at once (ranks 0-1 and
2-3, two pipelines that must both match); starting ranks costs more than a case, and the one-process
reference is trained once, here."""

import pipeline_launches
import pipeline_reference_workers
import pipeline_workers
import pytest
import torch

from minidist.parallel.pipeline import reference, schedules, stages

# The full suite only: PyTorch's pipelining against the hand-written one, on 2 and 4 ranks.
pytestmark = pytest.mark.slow

TOLERANCE = 1e-10  # float64: the algorithm, not the rounding
PARITY = [(schedule, m) for schedule in ("gpipe", "1f1b") for m in (1, 2, 8)]
# Bytes of the hidden states of one step's global batch: 8 sequences x 16 tokens x 64 wide x float64.
ACTIVATION_BYTES = pipeline_workers.SEQUENCES * pipeline_workers.LENGTH * pipeline_workers.HIDDEN * 8
# The hand-written executor against PyTorch's, per world size: schedule, m, dp_size (the loss's scale).
AGAINST = {2: ("gpipe", 2, 2), 4: ("1f1b", 4, 1)}


SPECS = []
for pp in (2, 4):
    SPECS += [("parity", pp, {"schedule": schedule, "m": m}) for schedule, m in PARITY]
    SPECS.append(("against_executor", pp, dict(zip(("schedule", "m", "dp_size"), AGAINST[pp]))))
SPECS += [("parity", 2, {"schedule": "1f1b", "m": 2, "sabotage": True}), ("torch_1f1b_refusal", 2, {}),
          ("wrong_rank", 2, {})]
# In the 4-rank launch the pipeline modules share (tests/pipeline_launches.py); the reference trained here, once.
PLANNED = pipeline_launches.plan(4, pipeline_reference_workers.cases, SPECS,
                                 pipeline_launches.Later(pipeline_workers.reference))


@pytest.fixture(scope="module")
def results():
    """Every case's result by (pp, what): a list of pipelines (two at pp 2, one at pp 4), each a list by rank."""
    by_rank = pipeline_launches.results(PLANNED)
    out = {}
    for i, (name, pp, kwargs) in enumerate(SPECS):
        key = (kwargs["schedule"], kwargs["m"]) if name == "parity" and "sabotage" not in kwargs else (name,)
        ranks = [rank[i] for rank in by_rank]
        out[(pp, *key)] = [ranks[:2], ranks[2:]] if pp == 2 else [ranks]
    return out


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule, m", PARITY)
def test_pytorch_pipeline_matches_one_process(results, pp, schedule, m):
    reference_run = pipeline_workers.reference()
    for ranks in results[pp, schedule, m]:
        for mine, expected in zip(ranks[-1]["losses"], reference_run["losses"], strict=True):
            assert abs(mine - expected) <= TOLERANCE * abs(expected), ranks[-1]["losses"]
        assert all(loss is None for rank in ranks[:-1] for loss in rank["losses"])  # the loss lives on the last stage
        for rank, result in enumerate(ranks):
            worst = sorted(result["worst"].items(), key=lambda kv: -kv[1])[:3]
            assert worst[0][1] <= TOLERANCE, (rank, worst)
        assert sorted(n for rank in ranks for n in rank["worst"]) == sorted(reference_run["weights"])  # each on one stage


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule, m", PARITY)
def test_pytorch_sends_the_same_bytes_plus_a_vote_and_comm_counts_none(results, pp, schedule, m):
    for ranks in results[pp, schedule, m]:
        for rank, result in enumerate(ranks):
            directions = (rank < pp - 1) + (rank > 0)  # activations to the next stage, gradients to the one before
            # Each step: m messages of a micro-batch's activations (or gradients) per direction, as by hand.
            # Before the first step only: the stages' vote, one int32 per direction.
            assert result["sent"] == [[4] * directions + [ACTIVATION_BYTES // m] * directions * m,
                                      [ACTIVATION_BYTES // m] * directions * m], (rank, result["sent"])
            assert result["counted"] == [0] * pipeline_workers.STEPS  # not through p2p.py: comm.counter sees none


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule, m", PARITY)
def test_1f1b_with_fewer_micro_batches_than_stages_runs_gpipe(results, pp, schedule, m):
    expected = "Schedule1F1B" if schedule == "1f1b" and m >= pp else "ScheduleGPipe"
    assert {rank["schedule"] for ranks in results[pp, schedule, m] for rank in ranks} == {expected}


def test_pytorch_refuses_1f1b_with_fewer_micro_batches_than_stages(results):
    # Why the fallback above: PyTorch's own words, on every rank.
    assert {rank for ranks in results[2, "torch_1f1b_refusal"] for rank in ranks} == {
        "Number of microbatches (1) must be greater than or equal to the number of stages (2)."}


@pytest.mark.parametrize("pp", [2, 4])
def test_the_hand_written_and_pytorch_executors_give_the_same_gradients_and_weights(results, pp):
    for ranks in results[pp, "against_executor"]:
        for rank, result in enumerate(ranks):
            assert result["grads"] <= TOLERANCE and result["weights"] <= TOLERANCE, (rank, result["grads"],
                                                                                     result["weights"])
            if rank < pp - 1:
                assert result["hand"] == result["torch"] == [None] * pipeline_workers.STEPS
            # A new PyTorch stage each step (the shape changed), which votes again: one int32 per direction.
            assert result["votes"] == [(rank < pp - 1) + (rank > 0)] * pipeline_workers.STEPS, (rank, result["votes"])
        for hand, torch_loss in zip(ranks[-1]["hand"], ranks[-1]["torch"], strict=True):
            assert abs(hand - torch_loss) <= TOLERANCE * abs(hand)
        # The loop's micro-batches: widths differ within a step (PyTorch's were padded) and between steps.
        widths = ranks[-1]["widths"]
        assert all(len(set(step)) > 1 for step in widths) and max(widths[0]) != max(widths[1]), widths


def test_pytorch_default_grad_scale_breaks_parity(results):
    # scale_grads=True (PyTorch's default) divides the gradients by m again: the second step's loss and
    # the weights move, far beyond the parity tests' tolerance.
    for ranks in results[2, "parity"]:
        expected = pipeline_workers.reference()["losses"]
        loss_off = max(abs(a - b) / abs(b) for a, b in zip(ranks[-1]["losses"], expected))
        weights_off = max(max(rank["worst"].values()) for rank in ranks)
        assert loss_off > 1e-8 and weights_off > 1e-3, (loss_off, weights_off)


def test_a_stage_on_the_wrong_rank_is_refused_in_one_line(results):
    assert results[2, "wrong_rank"] == [[
        "stage 1 of 2 must run on rank 1 of a group of 2, not rank 0 of 2",
        "stage 0 of 2 must run on rank 0 of a group of 2, not rank 1 of 2"]] * 2


def test_an_unknown_schedule_is_refused_in_the_hand_written_words():
    # No process group exists here: the refusal comes before anything is built.
    stage = stages.Stage(pipeline_workers.tiny_llama(num_layers=2), 0, 2)
    for name, m in [("zb", 2), ("1f1b", 0)]:
        with pytest.raises(ValueError) as hand_written:
            schedules.table(name, m, 2)
        with pytest.raises(ValueError) as refused:
            reference.TorchExecutor(stage, name, m)
        assert str(refused.value) == str(hand_written.value) and "\n" not in str(refused.value)
    assert not torch.distributed.is_initialized()


def test_padding_keeps_every_micro_batch_and_adds_no_target():
    short, long = pipeline_workers.split(pipeline_workers.global_batch(100, 0), 2)
    short = {key: value[:, :9] for key, value in short.items()}
    batch = reference.padded([short, long])
    assert batch["input_ids"].shape == (8, 16)
    assert torch.equal(batch["input_ids"][:4, :9], short["input_ids"]) and torch.equal(batch["labels"][4:], long["labels"])
    assert (batch["labels"][:4, 9:] == -100).all() and (batch["attention_mask"][:4, 9:] == 0).all()
    assert pipeline_workers.targets(batch) == pipeline_workers.targets(short) + pipeline_workers.targets(long)
    with pytest.raises(ValueError, match=r"^PyTorch's pipeline needs micro-batches of equal rows, not \[3, 4\]$"):
        reference.padded([{key: value[:3] for key, value in short.items()}, long])
