"""The memory of tensor and sequence parallelism (issue 32, points 2 and 5), measured on CPU ranks
and held to the estimate.

The tiny Llama of tests/parallel/test_tensor.py (fp32, hidden 128, 8 heads, 4 key/value heads,
MLP 336, 4 layers, 1,975 tokens), batch 4 x 128 tokens, cut by `parallelize_llama` over 1 (the
whole model), 2 and 4 ranks, with and without sequence parallelism, and on 2 ranks with its
vocabulary grown to 1,976 tokens (even, so no rank holds padding): one training step per case
(`tensor_parallel_workers.py`, the loop's own loss), its whole-step peak of live tensors, its
model states and what each decoder layer saves for backward; and, in the 2-rank launch, the
training loop itself with `--tp_size 2 --sequence_parallel` under the hand-written FSDP.

Per token, a Llama layer in fp32 saves (`memory/llama_layer.py`; h hidden, I the MLP's width,
q and kv the query and key/value widths, n heads, t the tensor-parallel ranks):
- the two RMSNorms, outside the blocks: 2 (4h + 4h + 4) bytes (input, x * rsqrt, rsqrt), on every
  rank whole, or with sequence parallelism on s / t tokens: / t;
- the blocks' inputs, the norms' outputs, which q, k, v and gate, up read whole on every rank: 2 x 4h
  (under sequence parallelism the all-gathered input, the same bytes);
- everything else is a rank's own heads and MLP columns, / t: q and k after rotary, v, the
  attention's output, its log-sum-exp (4(2q + 2kv) + 4n), gate, silu, up and their product (16 I).
Korthikanti et al.'s GPT layer, sbh(34 + 5as/h) in 16 bits, is sbh(10 + 24/t + 5as/ht) under tensor
parallelism and sbh(34 + 5as/h)/t with sequence parallelism too: Megatron-LM also keeps the blocks'
inputs cut (it gathers them again in backward), which this code does not.
"""

import json

import pytest
import tensor_parallel_workers as workers

from minidist.hf.models import write_tiny_llama
from minidist.memory import estimator, report
from minidist.parallel.tensor.vocab import padded_vocab_size
from minidist.runtime.launch import launch

# The full suite only: measured tensor-parallel peaks, in several launches.
pytestmark = pytest.mark.slow

# tp: (sequence parallelism, the vocabulary grown to a multiple of this) in one launch
CASES = {1: [(False, 1)], 2: [(False, 1), (True, 1), (False, 2)], 4: [(False, 1), (True, 1)]}
TOKENS = workers.BATCH * workers.SEQ


LOOP_BATCH, LOOP_SEQ = 8, 32  # every game is longer than 32 tokens: full micro-batches


@pytest.fixture(scope="module")
def loop_run(long_games, tmp_path_factory) -> dict:
    """The training loop's arguments for its run in the 2-rank launch (`measured`): `--tp_size 2
    --sequence_parallel`, the hand-written FSDP over the one data-parallel rank each slice has."""
    root = tmp_path_factory.mktemp("tensor_parallel_loop")
    model = str(write_tiny_llama(root / "llama", hidden_size=128, num_layers=4, num_heads=8))
    argv = ["--model", model, "--data", long_games, "--max_steps", "3", "--max_seq_length", str(LOOP_SEQ),
            "--batch_size_per_device", str(LOOP_BATCH), "--eval_prefixes", "0", "--no_save", "--trace_memory_every", "1",
            "--impl", "minidist", "--strategy", "fsdp", "--tp_size", "2", "--sequence_parallel",
            "--output_dir", str(root / "run")]
    return {"model": model, "argv": argv, "metrics": root / "run" / "metrics.jsonl"}


@pytest.fixture(scope="module")
def measured(loop_run) -> dict:
    """{(tp, sequence_parallel, vocab_multiple): every rank's figures}: one launch per tp size (the
    whole model here, in this process); the 2-rank launch also runs the loop (`loop_run`)."""
    out = {}
    for tp, cases in CASES.items():
        loop = loop_run["argv"] if tp == 2 else None
        ranks = [workers.step_memories(cases)] if tp == 1 else launch(workers.step_memories, tp, cases, loop,
                                                                        timeout_s=300)
        for case, by_rank in zip(cases, zip(*ranks)):
            out[(tp, *case)] = by_rank
    return out


@pytest.fixture(scope="module")
def shapes() -> dict:
    """{vocab_multiple: the estimator's Shape of the model the workers train}."""
    out = {}
    for multiple in (1, 2):
        config = workers.tiny_model(multiple).config
        # tiny_llama asks for eager attention, but a model built by its constructor runs SDPA: trace what it runs.
        config.attn_implementation = config._attn_implementation
        out[multiple] = estimator.config_shape(config, "tiny Llama")
    return out


def setup(tp: int, sp: bool):
    """The measured step as the estimator names it: every rank is one tensor-parallel group, one
    data-parallel rank, so no wrapper holds anything beyond the model (minidist's naive DDP)."""
    return estimator.setup(strategy="ddp", impl="minidist", ddp_variant="naive", world_size=tp, tp_size=tp,
                           sequence_parallel=sp, mixed_precision="fp32", batch_size_per_device=workers.BATCH,
                           max_seq_length=workers.SEQ, padded=False, backend="gloo")


def test_the_norms_stay_whole_without_sequence_parallelism_and_fall_as_one_over_t_with_it(measured, shapes):
    shape = shapes[1]
    h, n = shape.hidden_size, shape.num_heads
    q, kv, i = n * shape.head_dim, shape.num_kv_heads * shape.head_dim, shape.intermediate_size
    for (tp, sp, multiple), ranks in measured.items():
        norms, layers = ranks[0]["layer_norms"], ranks[0]["layers"]
        assert norms == [TOKENS * 2 * (8 * h + 4) // (tp if sp else 1)] * len(layers), (tp, sp, norms)
        inside = [saved - norm for saved, norm in zip(layers, norms)]  # the blocks: whole inputs, split rest
        assert inside == [TOKENS * (8 * h + (4 * (2 * q + 2 * kv) + 4 * n + 16 * i) // tp)] * len(layers), (tp, sp)
        assert ranks[0]["outside_norms"] == TOKENS * (8 * h + 4) // (tp if sp else 1)  # the final norm
        for rank in ranks:  # every rank saves the same
            assert (rank["layers"], rank["layer_norms"]) == (layers, norms)
        # The estimate's activations per layer are the trace of one rank's slice: the same bytes.
        assert estimator.activations(shapes[multiple], setup(tp, sp))["kept_by_layer"] == layers, (tp, sp)


def test_the_estimate_is_within_5_percent_of_the_measured_peak_on_every_rank(measured, shapes):
    for (tp, sp, multiple), ranks in measured.items():
        shape = shapes[multiple]
        estimate = estimator.estimate(shape, setup(tp, sp))
        for term in ("parameters", "gradients", "optimizer_states"):  # the slices' sizes, exactly
            assert [rank[term] for rank in ranks] == [estimate[term]] * tp, (tp, sp, term)
        vocab_slice = padded_vocab_size(shape.vocab_size, tp) // tp
        padded = padded_vocab_size(shape.vocab_size, tp) != shape.vocab_size
        for r, rank in enumerate(ranks):
            # The estimate is the worst rank's: the one whose vocabulary slice holds the padding, whose
            # loss copies its logits to mask it (`memory/tensor_parallel.logits`); the others skip the copy.
            copy = 4 * TOKENS * vocab_slice if padded and r < tp - 1 else 0
            want = estimate["peak"] - copy
            assert abs(rank["peak"] - want) <= 0.05 * want, f"tp {tp}, SP {sp}, rank {r}: {rank['peak']} vs {want}"


def test_the_loop_measures_what_the_estimate_says_under_tensor_and_sequence_parallelism(measured, loop_run):
    """The training loop itself, as tests/memory/test_memory.py holds every strategy: its metrics.jsonl
    against the estimate, within 5% on both ranks (the first without the padding's copy)."""
    records = [json.loads(line) for line in loop_run["metrics"].read_text().splitlines()]
    shape = estimator.model_shape(loop_run["model"])
    estimate = estimator.estimate(shape, estimator.setup(strategy="fsdp", impl="minidist", world_size=2, tp_size=2,
                                                         sequence_parallel=True, mixed_precision="fp32",
                                                         batch_size_per_device=LOOP_BATCH, max_seq_length=LOOP_SEQ,
                                                         padded=False, backend="gloo"))
    copy = 4 * LOOP_BATCH * LOOP_SEQ * padded_vocab_size(shape.vocab_size, 2) // 2  # the last rank's (1,975: padded)
    steady = [min(step) for step in zip(*(r["memory_bytes"]["peak"] for r in records[1:]))]  # per rank
    for got, want in zip(steady, (estimate["peak"] - copy, estimate["peak"])):
        assert abs(got - want) <= 0.05 * want, (steady, estimate["peak"], copy)
    for term in ("parameters", "gradients", "optimizer_states"):  # within 2%, as test_memory.py: AdamW's step
        for got in records[-1]["memory_bytes"][term]:  # counters are one per flat unit here, per tensor there
            assert abs(got - estimate[term]) <= 0.02 * estimate[term], (term, got, estimate[term])


def test_a_tensor_parallel_size_the_model_or_the_ranks_cannot_take_is_refused_in_one_sentence(shapes):
    for tp, world_size, expected in ((3, 3, "--tp_size 3 does not divide the model's 8 attention heads"),
                                     (2, 3, "--tp_size 2 must divide the 3 ranks into equal groups")):
        with pytest.raises(ValueError) as error:
            estimator.estimate(shapes[1], estimator.setup(strategy="ddp", impl="minidist", world_size=world_size,
                                                      tp_size=tp, mixed_precision="fp32"))
        assert str(error.value).startswith(expected) and "\n" not in str(error.value), error.value


def test_the_command_names_the_tensor_parallel_layout(shapes):
    r = report.report(shapes[1], estimator.setup(strategy="ddp", impl="minidist", world_size=4, tp_size=2,
                                                 sequence_parallel=True, mixed_precision="fp32"))
    assert "minidist/ddp on 4 rank(s), tensor parallel over 2 of them, sequence parallel, fp32" in report.format_report(r)


def test_memtracker_is_not_asked_for_a_tensor_parallel_step(shapes):
    # MemTracker traces the whole model in one process: beside a rank's slice its figure would mislead.
    setup = estimator.setup(strategy="ddp", impl="minidist", world_size=2, tp_size=2, mixed_precision="fp32")
    others = report.report(shapes[1], setup, trace=True)["others"]
    assert others["memtracker"] is None and "tensor parallel" in others["memtracker_split"]["error"], others


def test_a_slice_is_not_cut_again(shapes):
    half = estimator.rank_shape(shapes[1], 2)
    assert estimator.rank_shape(half, 2) is half
    with pytest.raises(ValueError, match="already the slice one of 2 ranks holds"):
        estimator.rank_shape(half, 4)
