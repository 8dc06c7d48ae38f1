"""The loop's budget of host synchronisations per optimizer step (`runtime/host_syncs.HOST_SYNCS_PER_STEP`).

On a GPU every `.item()`, `float(tensor)`, `if tensor:` or `.tolist()` makes the CPU wait until
the GPU has finished all it was given; on a CPU it costs nothing, so nobody notices. Here
`runtime/host_syncs.HostSyncs` counts them, op by op, in each step of the real loop on CPU (one
process, and two ranks), for the hand-written DDP, ZeRO-2 and FSDP, with and without gradient
accumulation. The count in our code must stay within the budget and must not grow with the number
of micro-batches: a sync per micro-batch (a planted `.item()`) breaks it, and the failure names the
line. The libraries' syncs (AdamW's step counter, transformers' check of the attention mask) are
counted and shown, not held to the budget.
"""

import pytest
import torch
from train_workers import count_host_syncs

from minidist import step
from minidist.chess import jsonl
from minidist.chess.games import bundled_games
from minidist.runtime.host_syncs import HOST_SYNCS_PER_STEP
from minidist.runtime.distributed import cleanup
from minidist.runtime.host_syncs import HostSyncs
from minidist.runtime.launch import launch

# The full suite only: host syncs counted over whole runs, in several launches.
pytestmark = pytest.mark.slow

BUDGET = sum(HOST_SYNCS_PER_STEP.values())
STRATEGIES = ("ddp", "zero2", "fsdp")
ACCUMULATION = (1, 3)  # micro-batches per optimizer step: 3 would show a sync per micro-batch three times


@pytest.fixture(scope="module")
def few_games(tmp_path_factory):
    """48 games: enough for two global batches, and quick to tokenize at each run's start."""
    path = tmp_path_factory.mktemp("games") / "few.jsonl"
    jsonl.write_games(jsonl.load_games(bundled_games("train"))[:48], path)
    return str(path)


def argv(model, games, out, strategy: str, accumulation: int) -> list[str]:
    return ["--model", model, "--data", games, "--strategy", strategy, "--impl", "minidist", "--max_steps", "2",
            "--batch_size_per_device", "2", "--gradient_accumulation_steps", str(accumulation),
            "--max_seq_length", "24", "--eval_prefixes", "0", "--no_save",
            "--output_dir", str(out / f"{strategy}-{accumulation}")]


def ours(syncs, number: int) -> list:
    """Step `number`'s syncs in our code. The first step of an epoch also reads the epoch's order of
    games (`batches.GlobalBatchSampler._permutation`): drawn by the CPU's generator, a host tensor
    on a GPU run too, so no wait there; on a CPU run the counter cannot tell, so it is left out."""
    return [s for s in syncs.ours(number) if not s.origin.endswith("(_permutation)")]


def within_budget(syncs, what: str) -> list[int]:
    """Every step's count of syncs in our code, each asserted within the budget."""
    counts = []
    for number in range(1, len(syncs.per_step) + 1):
        counts.append(len(ours(syncs, number)))
        assert counts[-1] <= BUDGET, (f"{what}: step {number} made {counts[-1]} host syncs in our code, over the "
                                      f"budget of {BUDGET} ({HOST_SYNCS_PER_STEP}):\n{syncs.report()}")
    return counts


def count_here(arguments):
    """One run in this process (one rank): what `HostSyncs` counted."""
    try:
        return count_host_syncs([arguments])[0]
    finally:
        cleanup()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_process_stays_within_budget(strategy, tiny_model, few_games, tmp_path):
    counts = {}
    for k in ACCUMULATION:
        syncs = count_here(argv(tiny_model, few_games, tmp_path, strategy, k))
        counts[k] = within_budget(syncs, f"{strategy}, {k} micro-batches")
    assert counts[1] == counts[3], counts  # the same with more micro-batches: nothing per micro-batch


def test_two_ranks_stay_within_budget(tiny_model, few_games, tmp_path):
    """With the collectives of two ranks, and accumulation (the one-process test compares it with
    none: the count is the same), every rank within the budget."""
    runs = [argv(tiny_model, few_games, tmp_path, strategy, 3) for strategy in STRATEGIES]
    per_rank = launch(count_host_syncs, 2, runs, timeout_s=300)
    for rank, counted in enumerate(per_rank):
        for strategy, syncs in zip(STRATEGIES, counted):
            within_budget(syncs, f"rank {rank}, {strategy}, 3 micro-batches")


def test_an_item_per_micro_batch_breaks_the_budget(tiny_model, few_games, tmp_path, monkeypatch):
    """A learner reads each micro-batch's loss on the host (`loss.item()`, as many loops do): three
    micro-batches, three more waits per step, and the failure names the line that asked."""
    loss_sum = step.token_loss_sum

    def with_item(model, batch, strategy):
        loss = loss_sum(model, batch, strategy)
        print(f"micro-batch loss {loss.item():.4f}")  # planted: a wait per micro-batch
        return loss

    monkeypatch.setattr(step, "token_loss_sum", with_item)
    syncs = count_here(argv(tiny_model, few_games, tmp_path, "zero2", 3))
    with pytest.raises(AssertionError) as failed:
        within_budget(syncs, "zero2 with an item per micro-batch")
    assert "3 x aten._local_scalar_dense.default at test_host_syncs.py" in str(failed.value), str(failed.value)
    assert "(with_item), called from minidist/step.py" in str(failed.value), str(failed.value)



def test_what_waits_and_what_does_not():
    """The counter's rules on small tensors: a read of a value, a yes or no, a shape that depends on
    the values, a host read of the memory; not arithmetic, not a view. A copy from a device to the
    host waits unless non_blocking; the meta device stands in for a GPU here (its copy then fails,
    after the counter has seen it)."""
    t = torch.tensor([1.0, -2.0, 3.0])
    syncs = HostSyncs("cpu")
    with syncs.step():
        u = (t * 2).relu()[1:]  # arithmetic and a view: the CPU only queues them
    with syncs.step():
        t.sum().item(), float(t[0]), bool(t[1] > 0), t.tolist(), t.nonzero(), t[t > 0], torch.equal(t, u)
    with syncs.step():
        on_device = torch.empty(3, device="meta")
        for non_blocking in (False, True):
            with pytest.raises(NotImplementedError):
                on_device.to("cpu", non_blocking=non_blocking)
    assert [len(step) for step in syncs.per_step] == [0, 7, 1], syncs.report()
    assert all(not sync.library and sync.origin.startswith("test_host_syncs.py:") for sync in syncs.per_step[1])
    on_a_gpu = HostSyncs("meta")  # a run on another device: reading a tensor that lives on the host is free
    with on_a_gpu.step():
        t.sum().item(), t.tolist()
    assert on_a_gpu.per_step == [[]], on_a_gpu.report()
