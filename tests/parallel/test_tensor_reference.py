"""PyTorch's own tensor parallelism (`minidist/parallel/tensor/reference.py`) on the same Hugging
Face Llama: over 2 and 4 CPU ranks, with and without sequence parallelism, it trains as the whole
model does in one process and as the hand-written `parallelize_llama` does, and its DTensors send
the collectives the hand-written operators send.

One launch per group size runs every case (`run_all`): a launch costs seconds of start-up."""

import functools

import pytest
import tensor_reference_workers

from minidist.runtime.launch import launch

# The full suite only: PyTorch's tensor parallelism against the hand-written one, in several launches.
pytestmark = pytest.mark.slow

TOLERANCE = 1e-10  # float64, as tests/parallel/test_tensor.py: the algorithm, not the rounding
LAYERS = 2  # tensor_workers.tiny_llama's


@functools.cache
def results(tp: int) -> list[dict]:
    return launch(tensor_reference_workers.run_all, tp, everything=tp == 2)  # the counts do not depend on tp


def _assert_close(mine: list[float], expected: list[float]) -> None:
    for a, b in zip(mine, expected, strict=True):
        assert abs(a - b) <= TOLERANCE * abs(b), (mine, expected)


@pytest.mark.parametrize("tp, sequence_parallel", [(2, False), (4, False), (2, True), (4, True)])
def test_torch_tensor_parallel_llama_matches_one_process_and_the_hand_written(tp, sequence_parallel):
    for rank, result in enumerate(results(tp)):
        parity = result["parity"][sequence_parallel]
        losses = parity["losses"]
        _assert_close(losses["torch"], losses["whole"])
        _assert_close(losses["torch"], losses["hand"])  # the same batch, the same losses, by hand and PyTorch's
        worst = sorted(parity["worst"].items(), key=lambda kv: -kv[1])
        assert worst[0][1] <= 1e-8, (rank, worst[:3])
        assert len(worst) == 21  # every parameter compared: 2 layers x 9, the embedding, the norm, the head


@pytest.mark.parametrize("tp", [2, 4])
def test_the_vocabulary_is_cut_unevenly_without_padding(tp):
    rows = [-(-1975 // tp)] * (tp - 1) + [1975 - (tp - 1) * -(-1975 // tp)]  # 988, 987; 494 x 3, 493
    for rank, result in enumerate(results(tp)):
        shapes = result["parity"][False]["local_shapes"]
        assert shapes["lm_head.weight"] == shapes["model.embed_tokens.weight"] == (rows[rank], 128)
        assert shapes["model.layers.0.self_attn.k_proj.weight"] == (64 // tp, 128)  # 4 key/value heads of 16
    said = f"vocabulary of 1,975 tokens cut unevenly, {', '.join(map(str, rows))} rows on the {tp} ranks"
    assert results(tp)[0]["parity"][False]["said"][0].startswith(said)


def test_tied_embeddings_stay_one_matrix():
    tied = results(2)[0]["tied"]
    _assert_close(tied["losses"]["torch"], tied["losses"]["whole"])
    assert max(tied["worst"].values()) <= 1e-8, tied["worst"]
    assert "lm_head.weight" not in tied["worst"]  # one parameter, under the embedding's name


def test_the_collectives_are_megatrons():
    # One collective per block and direction, as the hand-written f, g (and SP's gather, reduce-scatter)
    # send; plus the embedding's all-reduce and the loss's three (largest logit, target logit, sum).
    plain, sequence_parallel = (results(2)[0]["collectives"][sp] for sp in (False, True))
    blocks = 2 * LAYERS
    assert plain["forward"] == {"all_reduce": blocks + 1 + 3}
    assert plain["backward"] == {"all_reduce": blocks + 1}  # each block's entry, and the head's
    assert plain["step"] == {}
    assert sequence_parallel["forward"] == {"all_reduce": 1 + 3, "all_gather": blocks + 1, "reduce_scatter": blocks}
    # Backward: the entries' gathers become reduce-scatters, the exits' reduce-scatters and the first
    # layer's split become all-gathers.
    assert sequence_parallel["backward"] == {"reduce_scatter": blocks + 1, "all_gather": blocks + 1}
    # The norms' partial gradients are all-reduced in AdamW's step, once per operation that reads them.
    assert sequence_parallel["step"] == {"all_reduce": 3 * (blocks + 1)}
    assert plain["embedding_grad"] == ("R", (1975, 128))  # whole on every rank: the module docstring's finding
