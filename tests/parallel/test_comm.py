"""The collectives of minidist.parallel.comm: the ring all-reduce by hand, and the bytes counted."""

import pytest
import torch
from ddp_workers import collectives_and_their_counts, ring_against_library, run_cases, scratch_reduce_scatter

from minidist.runtime.launch import launch

# Sizes that N does not divide, and sizes smaller than N (some ranks get an empty chunk).
SIZES = [1, 2, 5, 7, 1001, 4099]
RING, COUNTS, SCRATCH = [2, 3, 4], [2, 4], [2, 3]  # the world sizes of each test below
COUNTS_SHARD, SCRATCH_SHARD = 3, 1000


@pytest.fixture(scope="module")
def launches():
    """Every case of this module, in one launch per world size (`ddp_workers.run_cases`, which
    starts the byte counter again before each): {world: each rank's {case: result}}."""
    out = {}
    for world in sorted(set(RING + COUNTS + SCRATCH)):
        cases = [(name, fn, args) for name, fn, args, worlds in (
            ("ring", ring_against_library, (SIZES,), RING),
            ("counts", collectives_and_their_counts, (COUNTS_SHARD,), COUNTS),
            ("scratch", scratch_reduce_scatter, (SCRATCH_SHARD,), SCRATCH)) if world in worlds]
        out[world] = launch(run_cases, world, cases, timeout_s=300)
    return out


@pytest.mark.slow  # one launch per world size, 2 to 4 ranks
@pytest.mark.parametrize("world", RING)
def test_the_ring_all_reduce_equals_the_library_call(launches, world):
    all_results = [rank["ring"] for rank in launches[world]]
    for rank, results in enumerate(all_results):
        for r in results:
            # Integers add exactly in any order: the ring must give the very same numbers.
            assert torch.equal(r["ring_int"], r["expected_int"]), (world, rank, r["size"])
            # Floats only up to the order of the additions.
            torch.testing.assert_close(r["ring"], r["expected"], rtol=1e-12, atol=1e-12)
    # Every chunk goes N-1 times round the ring in each phase: 2(N-1) x the tensor, over all ranks.
    for i, size in enumerate(SIZES):
        total = sum(results[i]["ring_bytes"] for results in all_results)
        assert total == 2 * (world - 1) * size * 8


@pytest.mark.slow  # in the launches of 2 and 4 ranks
@pytest.mark.parametrize("world", COUNTS)
def test_reduce_scatter_and_all_gather_and_their_byte_counts(launches, world):
    shard_size = COUNTS_SHARD
    results = [rank["counts"] for rank in launches[world]]
    full = torch.arange(world * shard_size, dtype=torch.float32)
    total = full * sum(range(1, world + 1))  # rank r contributed (r + 1) x full
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["shard"], total[rank * shard_size:(rank + 1) * shard_size], rtol=0, atol=0)
        torch.testing.assert_close(r["gathered"], total, rtol=0, atol=0)
        torch.testing.assert_close(r["all_reduced"], total, rtol=0, atol=0)
        nbytes = world * shard_size * 4  # the full tensor
        assert r["rs_bytes"] == r["ag_bytes"] == (world - 1) * nbytes / world
        assert r["ar_bytes"] == 2 * (world - 1) * nbytes / world


@pytest.mark.slow  # in the launches of 2 and 3 ranks
@pytest.mark.parametrize("world", SCRATCH)
def test_a_scratch_reduce_scatter_gives_the_same_shard_without_gloos_copy(launches, world):
    """PyTorch's gloo reduce-scatter all-reduces a copy of its input; ZeRO-2's and FSDP's inputs
    are scratch, which `input_is_scratch` all-reduces in place instead: the same shard, and
    nothing alive during the call but the input and the output, as under NCCL."""
    shard_size = SCRATCH_SHARD
    results = [rank["scratch"] for rank in launches[world]]
    total = torch.arange(world * shard_size, dtype=torch.float32) * sum(range(1, world + 1))
    for rank, r in enumerate(results):
        for scratch in (False, True):
            torch.testing.assert_close(r[scratch]["shard"], total[rank * shard_size:(rank + 1) * shard_size],
                                       rtol=0, atol=0)
        assert r[True]["peak"] == r[True]["held"], r[True]
        assert r[False]["peak"] == r[False]["held"] + world * shard_size * 4, r[False]  # gloo's copy, seen


def test_the_counter_adds_collectives_over_groups_of_different_sizes_exactly():
    """With hybrid sharding a step runs collectives over a shard group and a replicate group of
    other sizes (`parallel/mesh.py`); the count must add them exactly, and `take` starts it over."""
    from minidist.parallel.comm import ByteCounter

    counter = ByteCounter()
    counter.add(1, 3, 2)  # a reduce-scatter of 3 bytes over 2 ranks: 1/2 of it goes out, 1.5 bytes
    counter.add(6, 7, 4)  # an all-reduce of 7 bytes over 4 ranks: 2(4-1)/4 of it, 10.5 bytes
    counter.add(2, 1, 3)  # an all-gather of 1 byte over 3 ranks: 2/3 byte
    assert counter.take() == 1.5 + 10.5 + 2 / 3
    assert counter.take() == 0
