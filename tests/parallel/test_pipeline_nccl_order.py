"""The order of the hand-written executor's sends and receives under NCCL's rule, on the CPU
(`minidist/parallel/pipeline/executor.py`, `play_nccl`; `p2p.plan`, `p2p.post`).

NCCL runs a rank's point-to-point operations in order, and a send does not finish before its
receive is reached; operations posted together (one `batch_isend_irecv`) progress together. The
executor's former order (each send and receive posted alone) hangs under that rule in 1F1B's
steady state; the paired order it runs now does not, for GPipe and 1F1B. The plans played here are
the ones the executor posts: the last tests run the executor itself, without any process group,
and record what it posts. No ranks are started."""

from types import SimpleNamespace

import pytest
import torch

from minidist.parallel.pipeline import executor, p2p, schedules

CASES = [(name, pp, m) for name in ("gpipe", "1f1b") for pp in (2, 4) for m in (1, 2, 8)]


def plans(name, m, pp, paired):
    return [p2p.plan(actions, rank, pp, paired) for rank, actions in enumerate(schedules.table(name, m, pp))]


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("m", [2, 3, 8])
def test_the_former_order_deadlocks_on_nccl_in_1f1bs_steady_state(pp, m):
    table = schedules.table("1f1b", m, pp)
    executor.check(table, m)  # under gloo's rule it runs: a send never waits
    # Each send and receive posted alone, each pair of ranks on its own communicator (plain isend/irecv).
    with pytest.raises(ValueError, match="^on NCCL this schedule would deadlock: ") as refused:
        executor.play_nccl(plans("1f1b", m, pp, paired=False), batched=False)
    # The last stage sends micro-batch 0's gradient back while the stage before sends it the next
    # micro-batch's activations: each send waits for a receive queued behind the other's send.
    assert f"rank {pp - 1} at send B0>{pp - 2}" in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("name, pp, m", [("gpipe", 2, 8), ("gpipe", 4, 8), ("1f1b", 2, 1), ("1f1b", 4, 1)])
def test_the_former_order_finishes_where_no_stage_turns_from_sending_to_receiving_with_one_neighbour(name, pp, m):
    # The model does not refuse every unpaired order: GPipe (the activations all go one way, then the
    # gradients all come back) and a single micro-batch finish under the same rule.
    executor.play_nccl(plans(name, m, pp, paired=False), batched=False)


@pytest.mark.parametrize("name, pp, m", CASES)
def test_the_paired_order_finishes_on_nccl(name, pp, m):
    # Batched, as the executor posts: all of a rank's posts in one queue (its group's communicator).
    executor.play_nccl(plans(name, m, pp, paired=True), batched=True)


def test_pairing_is_not_enough_for_every_table_gloo_runs():
    # Stage 0 runs three forwards ahead while stage 1 already alternates: stage 1's paired post (B0's
    # gradient out, F1's activations in) waits for stage 0 to receive B0, which stage 0 posts behind
    # its send of F2, which waits for stage 1's next post. Gloo runs it; NCCL would hang.
    table = [[("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("B", 1), ("B", 2), ("B", 3)],
             [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("F", 3), ("B", 2), ("B", 3)]]
    executor.check(table, 4)
    with pytest.raises(ValueError, match="^on NCCL this schedule would deadlock: rank 0 at send F2>1, rank 1 at send B0>0$"):
        executor.play_nccl([p2p.plan(actions, rank, 2) for rank, actions in enumerate(table)])


def test_1f1bs_steady_state_posts_each_send_with_the_next_receive_from_the_same_neighbour():
    table = schedules.table("1f1b", 4, 2)
    assert p2p.show(p2p.plan(table[0], 0, 2)) == (
        "F0 | send F0>1 | F1 | send F1>1 + recv B0<1 | B0 | F2 | send F2>1 + recv B1<1 | B1 | F3 | "
        "send F3>1 + recv B2<1 | B2 | recv B3<1 | B3")
    assert p2p.show(p2p.plan(table[1], 1, 2)) == (
        "recv F0<0 | F0 | B0 | send B0>0 + recv F1<0 | F1 | B1 | send B1>0 + recv F2<0 | F2 | B2 | "
        "send B2>0 + recv F3<0 | F3 | B3 | send B3>0")


def test_a_receive_that_would_take_another_micro_batch_is_refused():
    table = [[("F", 0), ("F", 1), ("B", 0), ("B", 1)], [("F", 1), ("F", 0), ("B", 0), ("B", 1)]]
    played = [p2p.plan(actions, rank, 2) for rank, actions in enumerate(table)]
    with pytest.raises(ValueError, match="^schedule out of order: rank 1's recv F1 would receive rank 0's F0$"):
        executor.play_nccl(played)


class NumbersStage(torch.nn.Module):
    """What the executor reads of a stage (`stages.Stage`), on a few numbers: hidden size 4, one weight."""

    def __init__(self, rank, pp):
        super().__init__()
        self.rank, self.pp, self.is_first, self.is_last = rank, pp, rank == 0, rank == pp - 1
        self.config = SimpleNamespace(hidden_size=4)
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, hidden, batch):
        if hidden is None:  # the first stage's "embedding"
            hidden = batch["input_ids"].float().unsqueeze(-1).expand(-1, -1, 4)
        out = hidden * self.weight
        return out.sum() if self.is_last else out


class Done:
    def wait(self):
        return True

    def is_completed(self):
        return True


@pytest.fixture
def posted(monkeypatch):
    """What the executor posts, recorded instead of sent: [(batched, [(direction, peer), ...]), ...]."""
    record = []
    monkeypatch.setattr(p2p, "send", lambda tensor, dst, group=None: SimpleNamespace(op="send", peer=dst, tensor=tensor))
    monkeypatch.setattr(p2p, "recv", lambda buffer, src, group=None: SimpleNamespace(op="recv", peer=src,
                                                                                     tensor=buffer.fill_(1.0)))

    def post(ops, batched=True):
        record.append((batched, [(op.op, op.peer) for op in ops]))
        return [Done()]
    monkeypatch.setattr(p2p, "post", post)
    return record


@pytest.mark.parametrize("name, pp, m, paired", [("1f1b", 4, 8, True), ("gpipe", 4, 2, True), ("gpipe", 2, 2, False)])
def test_the_executor_posts_the_plan_it_played(posted, name, pp, m, paired):
    table = schedules.table(name, m, pp)
    micro_batches = [{"input_ids": torch.ones(1, 2, dtype=torch.long)} for _ in range(m)]
    for rank in range(pp):
        posted.clear()
        run = executor.Executor(NumbersStage(rank, pp))
        run.paired = paired
        run.step(table, micro_batches, num_targets=2)
        expected = [(paired, [(direction, peer) for direction, _, _, peer in step])
                    for step in p2p.plan(table[rank], rank, pp, paired) if isinstance(step, list)]
        assert posted == expected, rank


def test_the_executor_refuses_the_former_order_for_1f1b_before_posting(posted):
    run = executor.Executor(NumbersStage(0, 2))
    run.paired = False
    micro_batches = [{"input_ids": torch.ones(1, 2, dtype=torch.long)} for _ in range(2)]
    with pytest.raises(ValueError, match="^on NCCL this schedule would deadlock: rank 0 at send F1>1, rank 1 at send"):
        run.step(schedules.table("1f1b", 2, 2), micro_batches, num_targets=2)
    assert posted == []
