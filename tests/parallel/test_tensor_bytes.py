"""Bytes per step, counted and by formula: what `comm.counter` counts for one step of the
tensor-parallel Llama equals `parallel/tensor/traffic.py`'s formula exactly, on 2 and 4 ranks,
with and without sequence parallelism, for micro-batches of different lengths and with biases."""

import pytest
import tensor_bytes_workers

from minidist.parallel.tensor import traffic
from minidist.runtime.launch import launch

# The full suite only: the tensor-parallel bytes on 2 and 4 ranks, one launch each.
pytestmark = pytest.mark.slow

CASES = {
    "tp": {"sequence_parallel": False, "lengths": [(16, 11, 7)]},
    "sequence parallel": {"sequence_parallel": True, "lengths": [(16, 11, 7)]},
    "2 micro-batches": {"sequence_parallel": False, "lengths": [(16, 11, 7), (8, 5)]},
    "2 micro-batches, sequence parallel": {"sequence_parallel": True, "lengths": [(16, 11, 7), (8, 5)]},
    "biases, sequence parallel": {"sequence_parallel": True, "bias": True, "lengths": [(8, 5)]},
}


def formula(result: dict, tp: int, sequence_parallel: bool) -> list:
    """The formula's breakdown for each micro-batch the rank ran (float64: 8 bytes an element)."""
    return [traffic.tensor_parallel_bytes(result["config"], b, s, tp, sequence_parallel=sequence_parallel,
                                          element_bytes=8) for b, s in result["shapes"]]


@pytest.mark.parametrize("tp", [2, 4])
def test_bytes_counted_equal_the_formula(tp):
    results = launch(tensor_bytes_workers.counted, tp, CASES)
    for rank, by_case in enumerate(results):
        for name, case in CASES.items():
            result = by_case[name]
            parts = formula(result, tp, case["sequence_parallel"])
            assert result["bytes"] == sum(part.total for part in parts), (rank, name, result["bytes"], parts)
    # The 2 micro-batches differ in length, so their bytes do: one call per micro-batch, summed.
    assert [s for _, s in results[0]["2 micro-batches"]["shapes"]] == [16, 8]
