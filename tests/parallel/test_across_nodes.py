"""The bytes per NIC across nodes, by formula (`across_nodes.bytes_leaving_a_node`, `bytes_per_nic`),
for flat FSDP and HSDP: exact values for CodeLlama-7b, written out here term by term, so that a wrong
constant (a dtype's bytes, a gather's count, an (N-1)/N) fails."""

from fractions import Fraction

from minidist.parallel.across_nodes import bytes_leaving_a_node, bytes_per_nic

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
