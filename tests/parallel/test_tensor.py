"""Tensor and sequence parallelism by hand (`minidist/parallel/tensor/`): a Llama cut over 2 and
4 CPU ranks trains as the whole model does in one process, and each operator's collective is
what makes it so.

Every case of a world size runs in one launch (`tensor_workers.cases`): starting ranks costs more
than a case."""

import pytest
import tensor_workers

from minidist.runtime.launch import launch

# The full suite only: every operator's sabotage and parity on 2 and 4 ranks, one launch each.
pytestmark = pytest.mark.slow

TOLERANCE = 1e-10  # float64: the algorithm, not the rounding (the 1e-5 is for fp32)

PARITY = {2: [(2, False), (2, True)], 4: [(4, False), (4, True)]}  # world size -> (tp, sequence parallel)
# One operator's collective in one direction taken away (tensor_workers.SABOTAGE), on 2 ranks, with or
# without sequence parallelism; under it, f sums the norms' weight gradients.
SABOTAGE = [("f backward", False), ("g forward", False), ("vocabulary loss", False), ("gather forward", True),
            ("gather backward", True), ("reduce-scatter forward", True), ("reduce-scatter backward", True),
            ("split backward", True), ("f backward", True)]
REFUSED = [({"num_heads": 4, "num_kv_heads": 1}, "--tp_size 2 does not divide the model's 1 key/value heads"),
           ({"num_heads": 1, "num_kv_heads": 1}, "--tp_size 2 does not divide the model's 1 attention heads")]


@pytest.fixture(scope="module")
def results():
    """Every case's result, by (world size, what): one launch per world size."""
    # The sabotaged cases first: the parity cases after them show that each operator came back whole.
    two = ([{"tp_args": {"sequence_parallel": sp}, "steps": 2, "sabotage": name} for name, sp in SABOTAGE]
           + [{"tp_args": {"sequence_parallel": sp}} for _, sp in PARITY[2]]
           + [{"tp_args": {"tie": True}, "steps": 2}]
           + [{"tp_args": tp_args} for tp_args, _ in REFUSED] + ["eval mode"])
    keys = ([("sabotage", name, sp) for name, sp in SABOTAGE] + [("parity", sp) for _, sp in PARITY[2]] + [("tied",)]
            + [("refused", i) for i in range(len(REFUSED))] + [("eval mode",)])
    four = [{"tp_args": {"sequence_parallel": sp}} for _, sp in PARITY[4]]
    by_rank_2 = launch(tensor_workers.cases, 2, two, timeout_s=600)
    by_rank_4 = launch(tensor_workers.cases, 4, four, timeout_s=600)
    out = {(2, *key): [rank[i] for rank in by_rank_2] for i, key in enumerate(keys)}
    out.update({(4, "parity", sp): [rank[i] for rank in by_rank_4] for i, (_, sp) in enumerate(PARITY[4])})
    return out


@pytest.mark.parametrize("tp, sequence_parallel", PARITY[2] + PARITY[4])
def test_tensor_parallel_llama_matches_one_process(results, tp, sequence_parallel):
    ranks = results[tp, "parity", sequence_parallel]
    for rank, result in enumerate(ranks):
        for mine, reference in zip(result["losses"]["tp"], result["losses"]["reference"]):
            assert abs(mine - reference) <= TOLERANCE * abs(reference), (rank, result["losses"])
        assert max(result["worst"].values()) <= 1e-8, sorted(result["worst"].items(), key=lambda kv: -kv[1])[:3]
    shapes = ranks[0]["shapes"]
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (128 // tp, 128)  # 8 heads of 16, cut by heads
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (64 // tp, 128)  # 4 key/value heads
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (128, 128 // tp)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (128, 336 // tp)
    assert shapes["lm_head.weight"] == (-(-1975 // tp), 128)  # padded: 1,975 tokens are not even
    padded = -(-1975 // tp) * tp
    assert ranks[0]["said"] == [f"vocabulary padded from 1,975 to {padded:,} tokens, so that {tp} ranks get equal slices"]


def test_tied_embeddings_stay_one_matrix(results):
    result = results[2, "tied"][0]
    assert max(result["worst"].values()) <= 1e-8, result["worst"]
    assert "lm_head.weight" not in result["shapes"]  # the embedding's, under one name


@pytest.mark.parametrize("sabotage, sequence_parallel", SABOTAGE)
def test_each_operator_collective_is_needed(results, sabotage, sequence_parallel):
    # Without its collective the run still goes, but it no longer trains the same model.
    result = results[2, "sabotage", sabotage, sequence_parallel][0]
    losses = result["losses"]
    loss_off = max(abs(a - b) / abs(b) for a, b in zip(losses["tp"], losses["reference"]))
    assert loss_off > 1e-6 or max(result["worst"].values()) > 1e-6, (loss_off, result["worst"])


@pytest.mark.parametrize("case", range(len(REFUSED)))
def test_a_size_that_does_not_divide_the_heads_is_refused_in_one_sentence(results, case):
    error, expected = results[2, "refused", case][0]["refused"], REFUSED[case][1]
    assert error.startswith(expected) and "\n" not in error, error


def test_a_model_cut_in_eval_mode_stays_in_it_and_generates_whole_logits(results):
    # from_pretrained hands over a model in eval mode; the cut's new modules must not start training
    # (under sequence parallelism a row-parallel exit would then reduce-scatter what was never split).
    result = results[2, "eval mode"][0]
    assert result["modes"] == {False}
    assert result["worst"] < 1e-10, result["worst"]
