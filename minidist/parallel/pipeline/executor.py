"""One executor for every schedule: it runs a rank's list of actions (`schedules.py`) on its stage.

- **Forward of micro-batch i**: receive the input from the stage before (the first stage embeds
  its tokens instead), run the stage, keep the input and the output (backward needs them: the
  output's graph holds the saved activations), and send the output, detached, to the stage after.
  The last stage's output is the summed loss, scaled as the loop scales it (`step.train_step`: by
  the data-parallel world size over the global batch's target count), so that every stage's
  gradients come out as one process's.
- **Backward of micro-batch i**: receive the gradient of the output from the stage after (the last
  stage starts from its scaled loss), run backward from the output, and send the input's gradient
  to the stage before. The micro-batch's graph is then freed.

Gradients add up over the micro-batches, as under the loop's gradient accumulation: after the last
backward the stage's parameters hold the step's gradient, for the optimizer to step.

**Deadlock, refused before the first message.** A receive waits until its message comes, so a
table in which rank 0 waits for rank 1 while rank 1 waits for rank 0 hangs for ever (gloo's
timeout, minutes later, names neither the action nor the schedule). `check` plays the whole table
first, without computing: sends are put on a queue per direction and cut (they never block, as
`isend` does not), a receive takes the head of its queue or waits. Every rank's list must end;
if they all wait, the table is refused in one line that says who waits for whom. A receive that
would find another micro-batch at the head of its queue is refused too: point-to-point messages
between two ranks arrive in the order they were sent (NCCL matches them so; gloo without tags
too), so it would compute on the wrong micro-batch's activations without a word.

**Checked on CPU ranks (gloo) only.** On GPUs, NCCL runs the sends and receives between two ranks
in one stream, in order, and a send may not finish until its receive is posted: in 1F1B's steady
state a stage sends its output and then receives a gradient from the same neighbour, which sends
a gradient and then receives that output. Megatron-LM posts such a pair together
(`batch_isend_irecv`); this executor does not yet, and has not run on NCCL.

**The timeline: when each action computed.** After a step, `timeline` lists this rank's actions
as `(kind, i, start, end)`, in seconds from the step's start, and `step_time` is when the step
ended (its last send done). The interval is the computation only: it starts after the receive
returns (waiting for a neighbour is the bubble, the idle time being measured, not work) and ends
before the send is posted. `bubble.py` turns it into each stage's idle fraction. Two clock reads
per action: nothing else changes, so the parity is the same with or without anyone reading it.
The clock is the host's (`time.perf_counter`). On CPU that is when the work ran; on CUDA the host
only queues kernels and runs ahead, so on a CUDA device every reading first waits for the device
(`torch.cuda.synchronize`), which costs the overlap of a send with the next computation. So the
training loop turns it off (`synchronize = False`, `pipeline/loop.py`): its timeline on a GPU then
says when the host queued each action, not when it ran.

**`no_sync`: gradients reduced once per step.** Under data parallelism a wrapper reduces the
gradients during backward. Every micro-batch's backward but the step's last need not: their
gradients only add up locally. `Executor(..., no_sync=...)` takes a zero-argument callable that
returns a context manager (`lambda: strategy.no_sync(model)`) and runs every backward of this
rank's list inside it except the last one in the list, as `step.train_step` does for the loop's
micro-batches; after that backward the reduced gradients are the step's.
"""

import time
from collections import deque
from contextlib import nullcontext

import torch

from minidist.parallel.pipeline import p2p


def check(actions_by_rank: list[list[tuple[str, int]]], m: int) -> None:
    """Refuse, in one line, a table that is not one forward and one backward of each of the `m`
    micro-batches per rank, forward first, or whose ranks would wait for each other (module doc)."""
    for rank, actions in enumerate(actions_by_rank):
        expected = sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        if sorted(actions) != expected:
            raise ValueError(f"rank {rank}'s schedule must run F and B of each of the {m} micro-batches once")
        if any(actions.index(("B", i)) < actions.index(("F", i)) for i in range(m)):
            raise ValueError(f"rank {rank}'s schedule runs a micro-batch's backward before its forward")
    _play(actions_by_rank)


def _play(actions_by_rank: list[list[tuple[str, int]]]) -> None:
    """Run the table's messages, not its computation; refuse if it cannot finish (module doc)."""
    pp = len(actions_by_rank)
    forward = [deque() for _ in range(pp)]  # forward[r]: activations on their way from r to r + 1
    backward = [deque() for _ in range(pp)]  # backward[r]: gradients on their way from r + 1 to r
    done = [0] * pp
    while any(done[r] < len(actions_by_rank[r]) for r in range(pp)):
        moved = False
        for rank in range(pp):
            while done[rank] < len(actions_by_rank[rank]):
                kind, i = actions_by_rank[rank][done[rank]]
                inbox, peer = (forward[rank - 1], rank - 1) if kind == "F" else (backward[rank], rank + 1)
                if 0 <= peer < pp:  # the first stage's forward and the last's backward receive nothing
                    if not inbox:
                        break  # waits: another rank must move first
                    if inbox[0] != i:
                        raise ValueError(f"schedule out of order: rank {rank}'s {kind}{i} would receive micro-batch "
                                         f"{inbox[0]}'s {'activations' if kind == 'F' else 'gradient'} from rank {peer}")
                    inbox.popleft()
                if kind == "F" and rank + 1 < pp:
                    forward[rank].append(i)
                if kind == "B" and rank > 0:
                    backward[rank - 1].append(i)
                done[rank], moved = done[rank] + 1, True
        if not moved:
            waiting = []
            for rank in range(pp):
                if done[rank] < len(actions_by_rank[rank]):
                    kind, i = actions_by_rank[rank][done[rank]]
                    waiting.append(f"rank {rank} at {kind}{i} waits for rank {rank - 1 if kind == 'F' else rank + 1}")
            raise ValueError("this schedule would deadlock: " + ", ".join(waiting))


class Executor:
    """Runs tables of actions on `stage` (a `stages.Stage`), whose rank in `group` is its place in
    the pipeline. `dp_size`: the data-parallel world the loss is scaled by, as in `step.train_step`.
    `no_sync`: None, or a zero-argument callable returning a context manager, entered around every
    backward of this rank's list but the last (module doc).

    After a step: `peak_held`, the most micro-batches whose activations this stage held at once
    (GPipe: m; 1F1B: at most p - rank); `timeline`, this rank's actions as (kind, i, start, end),
    and `step_time`, the step's end, in seconds from the step's start (module doc)."""

    def __init__(self, stage, group=None, dp_size: int = 1, no_sync=None, module=None, dtype=None, device=None):
        self.stage, self.group, self.dp_size, self.no_sync = stage, group, dp_size, no_sync
        self.module = stage if module is None else module  # what runs the stage: it, or a data-parallel wrapper
        parameter = next(stage.parameters(), None)  # what crosses a cut has the compute dtype, on the stage's device
        self.dtype = dtype or parameter.dtype
        self.device = device or parameter.device
        self.peak_held = 0
        self.timeline, self.step_time, self.start = [], 0.0, 0.0
        self.synchronize = True  # on CUDA, wait for the device at each clock reading (module doc)

    def step(self, actions_by_rank: list, micro_batches: list[dict], num_targets: int):
        """Forward and backward of one step's micro-batches in this rank's order; return the step's
        summed loss (not scaled) on the last stage, None on the others."""
        if len(actions_by_rank) != self.stage.pp:
            raise ValueError(f"the schedule has {len(actions_by_rank)} ranks, the pipeline {self.stage.pp} stages")
        check(actions_by_rank, len(micro_batches))
        actions = actions_by_rank[self.stage.rank]
        last_backward = max(n for n, (kind, _) in enumerate(actions) if kind == "B")
        self.held, self.sends, self.peak_held = {}, [], 0
        self.loss_sum = None
        self.timeline, self.start = [], self.now()
        for n, (kind, i) in enumerate(actions):
            # A sent tensor is kept until its send is done, not until the step ends: the activations
            # sent by GPipe's m forwards would otherwise all live to the end, whatever the schedule.
            self.sends = [(work, tensor) for work, tensor in self.sends if not work.is_completed()]
            if kind == "F":
                self.forward(i, micro_batches[i], num_targets)
            else:
                # Only the last backward reduces across data-parallel ranks: the others just add up.
                with nullcontext() if self.no_sync is None or n == last_backward else self.no_sync():
                    self.backward(i, micro_batches[i])
        for work, _ in self.sends:  # every send has arrived before the step ends (and its tensor may go)
            work.wait()
        self.sends = []
        self.step_time = self.now() - self.start
        return self.loss_sum

    def now(self) -> float:
        """The host's clock, in seconds; on CUDA once the device has finished what was queued (module doc)."""
        if self.synchronize and torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def forward(self, i: int, batch: dict, num_targets: int) -> None:
        stage, rank = self.stage, self.stage.rank
        shape = p2p.activation_shape(batch, stage.config.hidden_size)
        # The received activations become a leaf of this stage's graph: backward gives their gradient.
        inputs = None if stage.is_first else p2p.recv(shape, self.dtype, self.device, rank - 1, self.group)
        start = self.now()  # after the receive: waiting for it is idle time, not this stage's work
        if inputs is not None:
            inputs.requires_grad_(True)
        output = self.module(inputs, batch)
        if stage.is_last:
            self.loss_sum = output.detach() if self.loss_sum is None else self.loss_sum + output.detach()
            output = output * self.dp_size / num_targets  # the loop's scale: see step.train_step
        self.held[i] = (inputs, output)
        self.peak_held = max(self.peak_held, len(self.held))
        self.timeline.append(("F", i, start - self.start, self.now() - self.start))  # before the send is posted
        if not stage.is_last:
            sent = output.detach()
            self.sends.append((p2p.send(sent, rank + 1, self.group), sent))

    def backward(self, i: int, batch: dict) -> None:
        stage, rank = self.stage, self.stage.rank
        inputs, output = self.held.pop(i)  # the graph of micro-batch i goes with them after this
        if stage.is_last:
            start = self.now()
            output.backward()
        else:
            shape = p2p.activation_shape(batch, stage.config.hidden_size)
            gradient = p2p.recv(shape, self.dtype, self.device, rank + 1, self.group)
            start = self.now()  # after the receive, as in forward
            output.backward(gradient)
        self.timeline.append(("B", i, start - self.start, self.now() - self.start))  # before the send is posted
        if not stage.is_first:
            self.sends.append((p2p.send(inputs.grad, rank - 1, self.group), inputs.grad))
