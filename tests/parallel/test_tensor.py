"""Tensor and sequence parallelism by hand (`minidist/parallel/tensor/`): a Llama cut over 2 and
4 CPU ranks trains as the whole model does in one process, and each operator's collective is
what makes it so."""

import pytest
import tensor_workers

from minidist.runtime.launch import launch

TOLERANCE = 1e-10  # float64: the algorithm, not the rounding (the 1e-5 is for fp32)


@pytest.mark.parametrize("tp, sequence_parallel", [(2, False), (4, False), (2, True), (4, True)])
def test_tensor_parallel_llama_matches_one_process(tp, sequence_parallel):
    results = launch(tensor_workers.parity, tp, {"sequence_parallel": sequence_parallel})
    for rank, result in enumerate(results):
        for mine, reference in zip(result["losses"]["tp"], result["losses"]["reference"]):
            assert abs(mine - reference) <= TOLERANCE * abs(reference), (rank, result["losses"])
        assert max(result["worst"].values()) <= 1e-8, sorted(result["worst"].items(), key=lambda kv: -kv[1])[:3]
    shapes = results[0]["shapes"]
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (128 // tp, 128)  # 8 heads of 16, cut by heads
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (64 // tp, 128)  # 4 key/value heads
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (128, 128 // tp)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (128, 336 // tp)
    assert shapes["lm_head.weight"] == (-(-1975 // tp), 128)  # padded: 1,975 tokens are not even
    padded = -(-1975 // tp) * tp
    assert results[0]["said"] == [f"vocabulary padded from 1,975 to {padded:,} tokens, so that {tp} ranks get equal slices"]


def test_tied_embeddings_stay_one_matrix():
    result = launch(tensor_workers.parity, 2, {"tie": True}, steps=2)[0]
    assert max(result["worst"].values()) <= 1e-8, result["worst"]
    assert "lm_head.weight" not in result["shapes"]  # the embedding's, under one name


@pytest.mark.parametrize("sabotage, sequence_parallel", [
    ("f backward", False), ("g forward", False), ("vocabulary loss", False),
    ("gather forward", True), ("gather backward", True), ("reduce-scatter forward", True),
    ("reduce-scatter backward", True), ("split backward", True),
    ("f backward", True)])  # under sequence parallelism f sums the norms' weight gradients
def test_each_operator_collective_is_needed(sabotage, sequence_parallel):
    # Without its collective the run still goes, but it no longer trains the same model.
    result = launch(tensor_workers.parity, 2, {"sequence_parallel": sequence_parallel}, steps=2,
                    sabotage=sabotage)[0]
    losses = result["losses"]
    loss_off = max(abs(a - b) / abs(b) for a, b in zip(losses["tp"], losses["reference"]))
    assert loss_off > 1e-6 or max(result["worst"].values()) > 1e-6, (loss_off, result["worst"])


@pytest.mark.parametrize("tp_args, expected", [
    ({"num_heads": 4, "num_kv_heads": 1}, "--tp_size 2 does not divide the model's 1 key/value heads"),
    ({"num_heads": 1, "num_kv_heads": 1}, "--tp_size 2 does not divide the model's 1 attention heads"),
])
def test_a_size_that_does_not_divide_the_heads_is_refused_in_one_sentence(tp_args, expected):
    error = launch(tensor_workers.refused, 2, tp_args)[0]
    assert error.startswith(expected) and "\n" not in error, error
