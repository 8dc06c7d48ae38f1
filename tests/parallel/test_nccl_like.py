"""The NCCL-like harness (`tests/nccl_like.py`) catches what gloo lets pass (issue 29, point 5).

Three planted bugs, each a line that NCCL punishes on a GPU: an output read before `wait()`, an
input written while its collective is in flight, a buffer freed before the collective completed.
Each runs on 2 ranks twice, plain and under the harness. Plain, gloo has finished the collective
by the time the buggy line runs (the scenario lets it: it polls `is_completed()`, never `wait()`,
so the plain run is not a race), and the bug goes unnoticed: the result is right. Under the
harness the collective runs only at `wait()`, and each bug fails: the early read sees NaN, the
write and the free raise at `wait()`.

Then what the harness itself must get right: minidist sees "nccl" and takes its NCCL branches
(`comm.reduce_scatter`'s `reduce_scatter_tensor`, `flat.collective_device`), gloo's branch
(`comm._ShardAfter`) still works under the deferral, a handle never waited for is reported, and a
host tensor given to a collective without `collective_device` is refused, as NCCL would.
The parity tests of every strategy run under the harness too (test_ddp.py, test_zero_fsdp.py,
test_hsdp.py, test_offload.py, test_lora.py).
"""

import math
import time

import pytest
import torch
import torch.distributed as dist
from nccl_like import CollectiveMisuse, NcclLike, under

from minidist.parallel import comm
from minidist.runtime.distributed import get_env
from minidist.runtime.launch import launch

# The full suite only: planted bugs under the NCCL-like harness, in several launches.
pytestmark = pytest.mark.slow

SHARD = 4


def everything(model_dir) -> dict:
    """Every scenario of this module, one after the other in the same 2 ranks: one start-up for all
    (starting ranks costs more than all of them, about 5 CPU s a rank). Each harness puts back what
    it replaced when its block ends (`as_nccl` checks it), and `planted_in_strategies` puts back
    comm's functions in a `finally`, so that no scenario sees another's patches; it runs last all
    the same, the one that plants bugs in real strategies. The bugs planted raise on every rank
    alike, at the same line, so the ranks stay in step; a barrier after each scenario makes each
    start from the same point on both."""
    out = {}
    for name, scenario in (("as_nccl", as_nccl), ("as_gloo", as_gloo), ("planted_bugs", planted_bugs),
                           ("planted_in_strategies", lambda: planted_in_strategies(model_dir))):
        out[name] = scenario()
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def scenarios(tiny_model) -> list:
    """Each rank's results of every scenario (`everything`), in one launch of 2 ranks."""
    return launch(everything, 2, tiny_model, timeout_s=300)


def _settle(work) -> None:
    """Let gloo finish the collective on its own, without `wait()`: what a fast CPU usually does
    before the next line, made certain so that the plain runs below are not races."""
    while not work.is_completed():
        time.sleep(0.001)


def _read_early(harness: bool) -> float:
    """The planted bug: the gathered tensor is summed before `wait()` (FSDP computing with a
    unit whose all-gather has not finished)."""
    n, rank = get_env().world_size, get_env().rank
    gathered = torch.empty(n * SHARD)
    work = comm.all_gather(gathered, torch.full((SHARD,), rank + 1.0), async_op=True)
    if not harness:
        _settle(work)
    total = gathered.sum().item()  # the bug: read before wait()
    work.wait()
    return total


def _gather_then(bug: str, harness: bool) -> list:
    """The planted bug: the shard being all-gathered is overwritten (the optimizer stepping the
    master while its all-gather is in flight), or its memory freed, before `wait()`."""
    n, rank = get_env().world_size, get_env().rank
    shard, gathered = torch.full((SHARD,), rank + 1.0), torch.empty(n * SHARD)
    work = comm.all_gather(gathered, shard, async_op=True)
    if not harness:
        _settle(work)
    if bug == "written":
        shard.zero_()
    else:
        shard.untyped_storage().resize_(0)
    work.wait()
    return gathered.tolist()


def planted_bugs() -> dict:
    """Each planted bug, plain and under the harness: (what it returned, the harness's error)."""
    results = {}
    for harness in (False, True):
        for bug in ("read", "written", "freed"):
            try:
                with under(harness):
                    value = _read_early(harness) if bug == "read" else _gather_then(bug, harness)
                results[bug, harness] = (value, None)
            except CollectiveMisuse as error:
                results[bug, harness] = (None, str(error))
    return results


def expected_shard(n: int, rank: int) -> list:
    """Rank `rank`'s shard of the sum over ranks of arange(n x SHARD) x (r + 1)."""
    total = sum(r + 1 for r in range(n))
    return [float(i * total) for i in range(rank * SHARD, (rank + 1) * SHARD)]


def test_the_harness_catches_each_planted_bug_that_gloo_lets_pass(scenarios):
    n = 2
    for results in (rank["planted_bugs"] for rank in scenarios):
        # Plain: gloo finished first, every bug gives the right numbers and nothing says otherwise.
        assert results["read", False] == (SHARD * sum(r + 1 for r in range(n)), None)
        for bug in ("written", "freed"):
            assert results[bug, False] == ([1.0] * SHARD + [2.0] * SHARD, None), (bug, results[bug, False])
        # Under the harness: the early read is NaN (and so would be every loss after it) ...
        value, error = results["read", True]
        assert error is None and math.isnan(value)
        # ... and the write and the free are named at wait().
        assert "an input was written before the collective completed" in results["written", True][1]
        assert "a buffer was freed before the collective completed" in results["freed", True][1]


def as_nccl() -> dict:
    """What minidist does under the harness (`backend` "nccl"), on each rank."""
    from minidist.parallel import flat, offload
    from minidist.parallel.flat import FlatLayout

    n, rank = get_env().world_size, get_env().rank
    out = {}
    with NcclLike() as harness:
        out["tests_see"] = dist.get_backend()  # only minidist is told "nccl"
        # comm.reduce_scatter's NCCL branch: reduce_scatter_tensor, deferred, even for a scratch input.
        bucket = torch.arange(n * SHARD, dtype=torch.float32) * (rank + 1)
        shard = torch.empty(SHARD)
        handle = comm.reduce_scatter(shard, bucket, async_op=True, input_is_scratch=True)
        out["handle"] = type(handle).__name__
        out["poisoned"] = shard.isnan().all().item()
        handle.wait()
        out["shard"], out["input_kept"] = shard.tolist(), bucket.untyped_storage().nbytes() > 0
        # A host tensor (offload.py) goes through collective_device, or NCCL would refuse it.
        layout = FlatLayout([torch.empty(5)], n, rank)
        host = offload.to_host(torch.full((layout.shard_numel,), rank + 1.0))
        out["gathered"] = flat.gather_flat(layout, host).tolist()
        out["routed"] = harness.routed_count
        try:
            comm.all_reduce(offload.to_host(host))
            out["host_refused"] = None
        except CollectiveMisuse as error:
            out["host_refused"] = str(error)
    out["restored"] = flat.collective_device is harness.real_collective_device
    return out


def as_gloo() -> dict:
    """`NcclLike(backend="gloo")`: gloo's branch of comm.reduce_scatter (`_ShardAfter`) under the
    deferral; then a handle dropped without `wait()`."""
    n, rank = get_env().world_size, get_env().rank
    out = {}
    with NcclLike(backend="gloo"):
        bucket = torch.arange(n * SHARD, dtype=torch.float32) * (rank + 1)
        shard = torch.zeros(SHARD)
        handle = comm.reduce_scatter(shard, bucket, async_op=True, input_is_scratch=True)
        out["handle"] = type(handle).__name__
        out["input_poisoned"] = bucket.isnan().all().item()  # the all-reduce in place has not run
        handle.wait()
        out["shard"], out["input_freed"] = shard.tolist(), bucket.untyped_storage().nbytes() == 0
    try:
        with NcclLike():
            comm.all_reduce(torch.ones(3), async_op=True)  # the bug: never waited for
        out["dropped"] = None
    except CollectiveMisuse as error:
        out["dropped"] = str(error)
    return out


def test_minidist_takes_its_nccl_branches_under_the_harness(scenarios):
    """comm.reduce_scatter goes to reduce_scatter_tensor (deferred: NaN until wait, then the right
    shard; the input is not freed, NCCL needs no scratch); an offloaded host shard is gathered
    through `flat.collective_device`, and a host tensor handed straight to a collective is refused."""
    for rank, out in enumerate(ranks["as_nccl"] for ranks in scenarios):
        assert out["tests_see"] == "gloo"
        assert out["handle"] == "Deferred" and out["poisoned"] and out["input_kept"], out
        assert out["shard"] == expected_shard(2, rank)
        assert out["gathered"] == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0] and out["routed"] == 1, out
        assert "a host tensor (placed by offload.py) that did not go through flat.collective_device" \
            in out["host_refused"]
        assert out["restored"]


def test_gloos_branch_and_a_handle_never_waited_for(scenarios):
    """Answering "gloo", the harness defers the all-reduce that `_ShardAfter` waits for: the input
    stays poisoned until `wait()`, which gives the right shard and frees the scratch input. And
    a collective dropped without `wait()` is reported when the harness goes."""
    for rank, out in enumerate(ranks["as_gloo"] for ranks in scenarios):
        assert out["handle"] == "_ShardAfter" and out["input_poisoned"], out
        assert out["shard"] == expected_shard(2, rank) and out["input_freed"], out
        assert "1 collectives never waited for (all_reduce)" in out["dropped"]


def planted_in_strategies(model_dir) -> dict:
    """Two bugs planted in real strategies, one training step each under the harness: ZeRO-2
    zeroes each gradient bucket right after launching its reduce-scatter (reusing it too early),
    and FSDP computes with a unit whose all-gather it never waited for."""
    from minidist.hf import models
    from minidist.strategy.options import ParallelOptions
    from minidist.strategy import get_strategy

    env = get_env()
    ids = torch.randint(4, 100, (2, 16), generator=torch.Generator().manual_seed(env.rank))
    real_reduce_scatter, real_all_gather = comm.reduce_scatter, comm.all_gather

    def reduce_scatter_then_zero(output, input, **kwargs):
        handle = real_reduce_scatter(output, input, **kwargs)
        if kwargs.get("async_op"):
            input.zero_()  # the bug: the bucket reused while its reduce-scatter is in flight
        return handle

    class Forgotten:
        def wait(self):  # the bug: the strategy goes on without waiting for the all-gather
            return True

    def all_gather_not_waited(*args, **kwargs):
        real_all_gather(*args, **kwargs)
        return Forgotten() if kwargs.get("async_op") else None

    out = {}
    for name, bug, patch in (("zero2", "written", ("reduce_scatter", reduce_scatter_then_zero)),
                             ("fsdp", "read", ("all_gather", all_gather_not_waited))):
        options = ParallelOptions(name, "minidist", **({"bucket_cap_mb": 0.05} if name == "zero2" else {}))
        model = get_strategy(options, env).wrap(models.load_model(model_dir))
        loss, error = None, None
        setattr(comm, *patch)
        try:
            with NcclLike():
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
        except CollectiveMisuse as misuse:
            error = str(misuse)
        finally:
            comm.reduce_scatter, comm.all_gather = real_reduce_scatter, real_all_gather
        out[bug] = (None if loss is None else loss.item(), error)
    return out


def test_the_harness_catches_bugs_planted_in_zero2_and_fsdp(scenarios):
    """ZeRO-2's bucket written while in flight: named at `wait()`. FSDP's weights used before
    their all-gather completed: the loss is NaN, and the forgotten collectives are reported."""
    for rank in (ranks["planted_in_strategies"] for ranks in scenarios):
        loss, error = rank["written"]
        assert "reduce_scatter_tensor: an input was written before the collective completed" in error, rank
        loss, error = rank["read"]
        assert math.isnan(loss), rank
        assert "collectives never waited for (all_gather_into_tensor" in error, rank
