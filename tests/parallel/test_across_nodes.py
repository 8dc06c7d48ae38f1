"""The bytes per NIC across nodes, by formula (`across_nodes.bytes_leaving_a_node`, `bytes_per_nic`),
for flat FSDP and HSDP: exact values for CodeLlama-7b, written out here term by term, so that a wrong
constant (a dtype's bytes, a gather's count, an (N-1)/N) fails. And the formula against the byte
counter (`comm.py`, split by `across_nodes.take_split`) on 2 simulated nodes x 2 CPU ranks, with 2
micro-batches in bf16, accumulated under no_sync and with `--accumulate_sharded`: what a node's ranks
count across nodes is what the formula says leaves the node (under the counter's rank-order ring,
one rank per node sends flat FSDP's crossing, where NCCL spreads it over the NICs: the sum is the same)."""

from fractions import Fraction

import pytest
from hsdp_workers import step_bytes_for_each

from minidist.parallel.across_nodes import bytes_leaving_a_node, bytes_per_nic
from minidist.runtime.launch import launch

# The full suite only: bytes across simulated nodes, counted in a 4-rank launch.
pytestmark = pytest.mark.slow

P, P_ROOT = 6_738_546_688, 262_279_168  # CodeLlama-7b: all parameters; embeddings, final norm and output layer


def test_flat_fsdp_sends_one_ranks_whole_step_out_of_each_node():
    # 2 nodes x 4: bf16 gathers of the layers twice and the root once, one fp32 reduce-scatter, x 7/8
    expected = Fraction(2 * (2 * P - P_ROOT) + 4 * P) * 7 / 8
    assert bytes_leaving_a_node("fsdp", P, P_ROOT, 2, 4) == expected == 46_710_838_272
    assert bytes_per_nic("fsdp", P, P_ROOT, 2, 4) == expected / 4
    # k micro-batches under no_sync: (4k + 4)P - 2k P_root, times (N-1)/N; 4 nodes: 15/16
    assert bytes_leaving_a_node("fsdp", P, P_ROOT, 4, 4, micro_batches=3) == Fraction(16 * P - 6 * P_ROOT) * 15 / 16
    assert bytes_leaving_a_node("fsdp", P, P_ROOT, 2, 4, compute_bytes=4) == Fraction(4 * (3 * P - P_ROOT)) * 7 / 8


def test_hsdp_sends_one_fp32_all_reduce_of_the_shards_per_step():
    assert bytes_per_nic("hsdp", P, P_ROOT, 2, 4) == Fraction(4 * 2 * P, 4) / 2 == 6_738_546_688
    assert bytes_leaving_a_node("hsdp", P, P_ROOT, 4, 4) == Fraction(8 * P) * 3 / 4
    for k in (1, 4):  # accumulation does not repeat it
        assert bytes_leaving_a_node("hsdp", P, P_ROOT, 2, 4, micro_batches=k) == 4 * P
    assert bytes_leaving_a_node("hsdp", P, P_ROOT, 1, 4) == bytes_leaving_a_node("fsdp", P, P_ROOT, 1, 4) == 0


def test_hsdps_saving_is_n_minus_1_over_n_against_r_minus_1_over_r():
    """Without the root's one gather fewer, 8P(N-1)/N against 8P(R-1)/R: 1.75x on 2 nodes of 4,
    1.25x on 4; with k micro-batches flat FSDP's (4k + 4)P grows and HSDP's 8P does not."""
    def ratio(nodes, k=1):
        return bytes_leaving_a_node("fsdp", P, 0, nodes, 4, micro_batches=k) / bytes_leaving_a_node("hsdp", P, 0, nodes, 4)

    assert ratio(2) == Fraction(7, 4) and ratio(4) == Fraction(5, 4)
    assert ratio(2, k=4) == Fraction(20, 8) * Fraction(7, 4)


def test_sharded_accumulation_sends_every_micro_batchs_reduction_across():
    """--accumulate_sharded: flat FSDP reduce-scatters each of the k micro-batches over all N ranks,
    (4k + 4k)P - 2k P_root times (N-1)/N in bf16; HSDP all-reduces each micro-batch's shard over the
    copies, k times its 8P(R-1)/R. Both k times a step of one micro-batch, so HSDP's saving stays 1.73x."""
    k = 4
    fsdp = bytes_leaving_a_node("fsdp", P, P_ROOT, 2, 4, micro_batches=k, accumulate_sharded=True)
    hsdp = bytes_leaving_a_node("hsdp", P, P_ROOT, 2, 4, micro_batches=k, accumulate_sharded=True)
    assert fsdp == Fraction(8 * k * P - 2 * k * P_ROOT) * 7 / 8 == k * bytes_leaving_a_node("fsdp", P, P_ROOT, 2, 4)
    assert hsdp == k * 4 * P == 107_816_747_008
    assert bytes_per_nic("hsdp", P, P_ROOT, 2, 4, micro_batches=k, accumulate_sharded=True) == k * 6_738_546_688
    assert bytes_leaving_a_node("hsdp", P, P_ROOT, 2, 4, micro_batches=1, accumulate_sharded=True) == 4 * P


NODES, PER_NODE, K = 2, 2, 2
ACCUMULATIONS = (False, True)  # accumulate_sharded: no_sync (the default), then the flag


@pytest.fixture(scope="module")
def counted(tiny_model):
    """Per flag, per rank the bytes of one bf16 step of K micro-batches, fsdp and hsdp (one launch)."""
    ranks = launch(step_bytes_for_each, NODES * PER_NODE, tiny_model, ["fsdp", "hsdp"],
                   [{"accumulate_sharded": sharded} for sharded in ACCUMULATIONS], micro_batches=K,
                   mixed_precision="bf16", nodes=NODES, timeout_s=300)
    return {sharded: [rank[i] for rank in ranks] for i, sharded in enumerate(ACCUMULATIONS)}


@pytest.mark.parametrize("sharded", ACCUMULATIONS, ids=["no_sync", "accumulate_sharded"])
def test_what_a_nodes_ranks_count_across_is_the_formula(counted, sharded):
    """P = the units' padded elements (the root last), on each of the 2 nodes, both strategies."""
    ranks = counted[sharded]
    for strategy in ("fsdp", "hsdp"):
        units = ranks[0][strategy]["units"]
        expected = bytes_leaving_a_node(strategy, sum(units), units[-1], NODES, PER_NODE, micro_batches=K,
                                        accumulate_sharded=sharded)
        for node in range(NODES):
            node_ranks = ranks[node * PER_NODE:(node + 1) * PER_NODE]
            counted_across = sum(r[strategy]["bytes"]["comm_bytes_across_nodes"] for r in node_ranks)
            assert counted_across == expected, (strategy, sharded, node, counted_across, float(expected))
