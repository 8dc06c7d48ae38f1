"""The hand-written FSDP's overlap and accumulation (`parallel/streams.py`, `unit.py`, `fsdp.py`):

- two side streams, as PyTorch's FSDP2: all-gathers on one, reduce-scatters on another, each use
  of a result after the compute stream waited for its event, checked on a CPU with a stand-in for
  `torch.cuda` that records every stream call (`fsdp_streams_workers.FakeStreams`);
- the root unit gathered once per micro-batch, kept from forward to backward while grad is on
  (freed after a forward without grad), its gather in flight with the first layer's, and the bytes
  a step sends by the new formula; with a root that has nothing to train (LoRA), freed when the last
  layer's backward begins;
- gradients accumulated under `no_sync` in fp32 (the reduce dtype), not in the weights' bf16.

All on a toy model of plain torch modules, 2 ranks, every case in one launch (starting the ranks
costs more than all the cases).
"""

import fsdp_streams_workers as workers
import pytest
import torch
from ddp_workers import run_cases

from minidist.runtime.launch import launch

# The full suite only: FSDP's streams and prefetch, in several launches.
pytestmark = pytest.mark.slow

ACCUMULATION = 2


@pytest.fixture(scope="module")
def cases() -> list:
    """Each rank's {case: result}, every case one after the other in one launch of 2 ranks
    (`ddp_workers.run_cases`: a barrier and the byte counter reset between cases). Each worker
    seeds its toy model and puts back, in a `finally`, every function it replaced."""
    return launch(run_cases, 2, [("streams", workers.on_fake_streams, (ACCUMULATION,)),
                                 (("root", False), workers.root_once_per_micro_batch, (False, ACCUMULATION)),
                                 (("root", True), workers.root_once_per_micro_batch, (True, ACCUMULATION)),
                                 ("fp32", workers.accumulates_in_fp32, (3,))], timeout_s=300)


def event_after(log, i, stream):
    """The event recorded on `stream` right after the collective at log[i] (its launch's end)."""
    assert log[i - 1] == ("wait_stream", stream, "compute"), (log[i - 1], log[i])  # inputs written first
    kind, on, event = log[i + 1]
    assert (kind, on) == ("record_event", stream), log[i + 1]
    return event


def waited_before(log, event, until):
    """The index at which the compute stream waits for `event`, before log[until]; None if it does not."""
    return next((j for j in range(until) if log[j] == ("wait_event", "compute", event)), None)


def test_gathers_and_reduce_scatters_run_on_two_streams_and_every_use_waits_for_its_event(cases):
    """On a GPU each collective goes to its kind's side stream after that stream waited for the compute
    stream; the compute stream waits for the collective's event before it reads the result (a unit's
    weights, a reduced shard). In backward, unit i's reduce-scatter and unit i-1's gather are in flight
    at once, and the gather launched while a reduce-scatter is still in flight is on the other stream:
    CUDA does not queue it behind it, as it would on the process group's one NCCL stream (NCCL itself
    still runs the two in launch order, one communicator: streams.py)."""
    for rank in (ranks["streams"] for ranks in cases):
        log, layers = rank["log"], rank["layers"]
        streams = {kind: {on for k, on, _ in log if k == kind} for kind in ("all_gather", "reduce_scatter")}
        assert len(streams["all_gather"]) == len(streams["reduce_scatter"]) == 1, streams
        gather_stream, scatter_stream = streams["all_gather"].pop(), streams["reduce_scatter"].pop()
        assert gather_stream != scatter_stream and "compute" not in (gather_stream, scatter_stream)
        last = {}  # (kind, unit) -> (launch index, event) of its latest collective
        in_flight_together = launched_behind = 0
        for i, (kind, on, what) in enumerate(log):
            if kind in ("all_gather", "reduce_scatter"):
                last[kind, what] = (i, event_after(log, i, on))
                if kind == "all_gather":  # reduce-scatters still in flight when this gather is launched
                    launched_behind += sum(1 for (k, _), (_, e) in last.items()
                                           if k == "reduce_scatter" and waited_before(log, e, i) is None)
            elif kind in ("use", "accumulate"):
                assert on == "compute", log[i]
                start, event = last["all_gather" if kind == "use" else "reduce_scatter", what]
                waited = waited_before(log, event, i)
                assert waited is not None and waited > start, f"{kind} of {what} at {i} before its event was waited for"
            if kind == "reduce_scatter" and what in layers[1:]:  # the gather of the layer before: still in flight
                before = layers[layers.index(what) - 1]
                _, gather_event = last["all_gather", before]
                in_flight_together += waited_before(log, gather_event, i) is None
        assert in_flight_together == len(layers) - 1, in_flight_together
        # In CUDA's order these gathers do not wait for the reduce-scatters (on one stream they would);
        # NCCL still runs one communicator's collectives in launch order (streams.py): not seen here.
        assert launched_behind > 0


def gathers_by_unit(log):
    counts = {}
    for kind, *rest in log:
        if kind == "gather":
            counts[rest[0]] = counts.get(rest[0], 0) + 1
    return counts


@pytest.mark.parametrize("frozen_root", [False, True], ids=["full", "frozen-root"])
def test_the_root_is_gathered_once_per_micro_batch(cases, frozen_root):
    """k micro-batches: each layer gathered twice per micro-batch (forward, backward), the root once,
    its gather launched and the first layer's launched before the root is waited for. Bytes per rank
    per step, in elements of 4 bytes: (2k + 1)P(N-1)/N less kR(N-1)/N, R the root's gathered elements
    (a frozen flat is gathered, never reduced). The root is still gathered after each forward and,
    when it trains, through the last layer's backward; a root with nothing to train is freed when the
    last layer's backward begins. A forward without grad leaves it sharded."""
    k, n = ACCUMULATION, 2
    for rank in (ranks["root", frozen_root] for ranks in cases):
        log, sizes = rank["log"], rank["sizes"]
        log, no_grad = log[:log.index(("step over",))], log[log.index(("step over",)):]
        counts = gathers_by_unit(log)
        assert counts == {name: k if name == "root" else 2 * k for name in sizes}, counts
        assert log[:3] == [("gather", "root"), ("gather", "layer 0"), ("wait", "gather", "root")], log[:3]
        assert [e for e in log if e[0] == "forward over"] == [("forward over", "gathered")] * k
        over = [e[1] for e in log if e[0] == "last layer's backward over"]
        assert over == ["sharded" if frozen_root else "gathered"] * k, over
        gathered = sum(g for g, _ in sizes.values())
        reduced = sum(r for _, r in sizes.values())
        expected = (2 * k * gathered - k * sizes["root"][0] + reduced) * (n - 1) / n * 4
        assert rank["bytes"] == expected, (rank["bytes"], expected)
        assert rank["after_step"] == ["sharded"] * len(sizes)
        assert gathers_by_unit(no_grad) == {name: 1 for name in sizes} and rank["after_no_grad"] == "sharded"
        assert rank["max_unsharded"] == 3  # the root, the running layer, the prefetched one


def test_no_sync_accumulates_bf16_gradients_in_fp32(cases):
    """bf16 weights, 3 micro-batches: the gradient each unit reduces is the fp32 sum of the micro-batches'
    bf16 gradients, exactly, not their sum rounded to bf16 after every addition (what autograd's
    accumulation into a bf16 `.grad` gives, and what this test tells apart). Between micro-batches
    each unit keeps an fp32 sum and no bf16 `.grad`."""
    for rank in (ranks["fp32"] for ranks in cases):
        assert rank["dtypes"] == [torch.bfloat16] * len(rank["dtypes"])
        rounded_apart = 0
        for u, got in enumerate(rank["accumulated"]):
            each = [grads[u] for grads in rank["each"]]
            assert all(torch.equal(g.bfloat16().float(), g) for g in each)  # bf16 gradients, as fp32
            fp32_sum = each[0] + each[1] + each[2]
            torch.testing.assert_close(got, fp32_sum, rtol=0, atol=0)
            bf16_sum = each[0].bfloat16()
            for g in each[1:]:
                bf16_sum += g.bfloat16()
            rounded_apart += not torch.equal(bf16_sum.float(), fp32_sum)
        assert rounded_apart == len(rank["accumulated"])  # every unit's bf16 sum differs: the test can tell
        for kept in rank["kept"]:
            assert kept == [(torch.float32, True)] * len(kept), kept
