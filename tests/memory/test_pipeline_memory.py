"""The memory of a pipeline stage (issue 33, point 4b), measured on CPU ranks and held to the estimate.

The tiny Llama of tests/parallel/test_pipeline.py (hidden 64, 4 layers, vocabulary 1,975) in
float32, cut over 2 and 4 ranks, one global batch of 8 sequences x 16 tokens cut into m = 1, 2, 4
micro-batches, run by GPipe and 1F1B (with one micro-batch both are F0 B0: run once). On every
stage, the second step's peak of held activations (`memory.pipeline.HeldActivations`: what autograd
saved, with the inputs and outputs the executor keeps) is held to `memory.pipeline.stage_estimate`:
GPipe keeps m micro-batches, 1F1B min(m, p - r), each what the stage's trace on fake tensors says.
Every case of a world size runs in one launch, shared with the other pipeline modules
(tests/pipeline_launches.py).
"""

import pipeline_launches
import pipeline_memory_workers as workers
import pytest

from minidist.memory import __main__ as memory_command
from minidist.memory import estimator, pipeline, trace

# The full suite only: measured pipeline peaks, in the pipeline modules' launches.
pytestmark = pytest.mark.slow

CASES = [("gpipe", 1), ("gpipe", 2), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4)]
SEQUENCES, LENGTH = 8, 16  # pipeline_workers.global_batch: the longest sequence is 16 tokens
# The issue asks for 5%. The two agree to 0.002% (a few bytes of the loss): at 5% the check would miss a
# term as large as the received input (2% of a stage's micro-batch here), so it is held to 0.1%.
TOLERANCE = 1e-3


# In the launch of each world size that the pipeline modules share (tests/pipeline_launches.py).
PLANNED = {pp: pipeline_launches.plan(pp, workers.cases, [(schedule, m, m == 4) for schedule, m in CASES]) for pp in (2, 4)}


@pytest.fixture(scope="module")
def measured() -> dict:
    """{(pp, schedule, m): every rank's figures}."""
    out = {}
    for pp in (2, 4):
        ranks = pipeline_launches.results(PLANNED[pp])
        out.update({(pp, *case): [rank[i] for rank in ranks] for i, case in enumerate(CASES)})
    return out


@pytest.fixture(scope="module")
def shape() -> estimator.Shape:
    config = workers.tiny_model().config
    # tiny_llama asks for eager attention, but a model built by its constructor runs SDPA: trace what it runs.
    config.attn_implementation = config._attn_implementation
    return estimator.config_shape(config, "tiny Llama")


def setup(m: int) -> estimator.Setup:
    """The measured step as the estimator names it: no data parallelism (one rank per stage, nothing
    beyond the stage's modules), fp32, micro-batches of 8 / m sequences."""
    return estimator.setup(strategy="ddp", impl="minidist", ddp_variant="naive", world_size=1, mixed_precision="fp32",
                           batch_size_per_device=SEQUENCES // m, max_seq_length=LENGTH, padded=True, backend="gloo")


def test_each_stage_holds_what_its_schedule_says():
    for pp in (2, 4, 8):
        for m in range(1, 9):
            assert [pipeline.held_micro_batches("gpipe", m, pp, r) for r in range(pp)] == [m] * pp
            assert [pipeline.held_micro_batches("1f1b", m, pp, r) for r in range(pp)] == [min(m, pp - r)
                                                                                          for r in range(pp)]


def test_the_stages_traces_add_up_to_the_whole_models(shape):
    """Each stage traced on its own saves what its layers save in the whole model's trace, apart from
    the received input (a leaf the stage holds, no longer the previous layer's output), with the
    whole model's embedding on the first stage and its head and loss on the last."""
    pp, batch = 2, 4
    whole = vars(trace.trace(shape.config, batch, LENGTH, "fp32", padded=True))
    first, last = (pipeline.trace_stage(shape.config, r, pp, batch, LENGTH) for r in range(pp))
    received = batch * LENGTH * shape.hidden_size * 4
    assert first["layers"] + [last["layers"][0] + received] + last["layers"][1:] == whole["layers"]
    assert first["shared"] == last["shared"] == whole["shared"]  # the rotary cos and sin, the mask: every stage's own
    assert first["outside"] + last["outside"] == whole["outside"]
    assert (first["held"], last["held"]) == (received, received + 4)  # the output sent on; the input and the loss


def test_the_activation_peak_of_every_stage_is_within_0_1_percent_of_the_estimate(measured, shape):
    for (pp, schedule, m), ranks in measured.items():
        for rank, got in enumerate(ranks):
            want = pipeline.stage_estimate(shape, setup(m), rank, pp, schedule, m)
            off = abs(got["activations"] - want["activations"]) / want["activations"]
            assert off <= TOLERANCE, f"pp {pp} {schedule} m {m} stage {rank}: {got['activations']} vs {want['activations']}"
            assert got["held"] == want["held_micro_batches"], (pp, schedule, m, rank)


def test_an_estimate_blind_to_the_schedule_would_miss(measured, shape):
    """The check above can fail: one micro-batch per stage, whatever the schedule, misses every case
    that holds more than one by far more than 5%."""
    for (pp, schedule, m), ranks in measured.items():
        for rank, got in enumerate(ranks):
            one = pipeline.stage_estimate(shape, setup(m), rank, pp, schedule, m)["per_micro_batch"]
            if got["held"] > 1:
                assert abs(got["activations"] - one) > 0.05 * one, (pp, schedule, m, rank)


def test_the_model_states_of_every_stage_are_its_own_modules(measured, shape):
    for (pp, schedule, m), ranks in measured.items():
        for rank, got in enumerate(ranks):
            want = pipeline.stage_estimate(shape, setup(m), rank, pp, schedule, m)
            assert [got[t] for t in ("parameters", "gradients", "optimizer_states")] == \
                [want[t] for t in ("parameters", "gradients", "optimizer_states")], (pp, rank)


def test_the_whole_step_peak_holds_the_activations_and_1f1b_lowers_it_on_the_last_stage(measured):
    """The whole step's peak of live tensors at m = 4 (`measure.step_peak`: gradients, backward's and AdamW's
    temporaries too; the estimate has none for a stage yet, so these figures are measured only). It
    is at least the parameters, AdamW's states and the held activations, all alive at the end of the
    forward that fills the stage, before its first backward makes a gradient. At m = 4, 1F1B's is never
    above GPipe's, and below it on the last stage, which holds one micro-batch's log-probabilities over
    the whole vocabulary instead of four; elsewhere the optimizer step may set the peak for both."""
    for pp in (2, 4):
        for schedule in ("gpipe", "1f1b"):  # the cases whose whole step was measured (pipeline_memory_workers)
            for got in measured[pp, schedule, 4]:
                assert got["peak"] >= got["parameters"] + got["optimizer_states"] + got["activations"], (pp, schedule)
        gpipe, one_f_one_b = ([rank["peak"] for rank in measured[pp, s, 4]] for s in ("gpipe", "1f1b"))
        assert all(a <= b for a, b in zip(one_f_one_b, gpipe)) and one_f_one_b[-1] < gpipe[-1], (pp, gpipe, one_f_one_b)


def test_the_command_prints_every_stage(tmp_path, capsys):
    workers.tiny_model().config.save_pretrained(tmp_path)
    memory_command.main([str(tmp_path), "--pp_size", "2", "--pp_schedule", "1f1b", "--gradient_accumulation_steps", "4",
                         "--max_seq_length", "16", "--strategy", "ddp", "--impl", "minidist"])
    lines = capsys.readouterr().out.splitlines()
    assert "2 pipeline stages, 1f1b, 4 micro-batches of 1 x 16 tokens, autocast compute" in lines[0], lines
    rows = [line.split() for line in lines[2:4]]
    assert [row[0] for row in rows] == ["0", "1"] and [row[5] for row in rows] == ["2", "1"], lines


def test_more_stages_than_layers_is_one_line(tmp_path, capsys):
    workers.tiny_model().config.save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as exit:
        memory_command.main([str(tmp_path), "--pp_size", "8", "--strategy", "ddp", "--impl", "minidist"])
    assert exit.value.code == 2
    assert "--pp_size 8 is larger than the model's 4 decoder layers" in capsys.readouterr().err.strip().splitlines()[-1]
