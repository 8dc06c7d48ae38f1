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

**NCCL's rule: a send posted with the next receive.** `check` plays gloo's rule, under which a
send never waits. NCCL's is stricter. It runs a rank's sends and receives on one communicator in
one stream, in the order they were posted, and a send does not finish until the peer reaches the
receive for it (NCCL's docs: `ncclSend` "is blocking for the GPU"; sends and receives that must
progress at once go in one group, `ncclGroupStart` / `ncclGroupEnd`). In 1F1B's steady state a
stage sends its output to the next stage and then receives a gradient from it, while that stage
sends the gradient and then receives the output: each send waits for a receive queued behind the
other's send, for ever. So the executor posts a send together with the next action's receive when
both are with the same neighbour (`p2p.plan`, by `batch_isend_irecv`, PyTorch's group call), as
Megatron-LM does (`megatron/core/pipeline_parallel/p2p_communication.py`: `_batched_p2p_ops`,
`send_forward_recv_backward`, `send_backward_recv_forward`).

`play_nccl` plays every rank's plan under that rule, before the first message, and refuses in one
line a plan that would hang. Each rank's posts wait in a queue, in order: one queue per rank
(`batch_isend_irecv` puts all of them on the group's communicator; plain `isend` / `irecv` would
give each pair of ranks its own). Only the posts at the heads of two queues meet: a send completes
when the receive for it is in the peer's head post, and a post is done, and leaves its queue, when
all its operations are. A host posts in its plan's order and waits for each post that has a
receive (the next computation needs the data). A real host may post further ahead (NCCL's wait
blocks the device, not the host); that can only bring a post to its queue's head sooner, so a
plan that finishes here finishes there too. Every send and receive posted alone deadlocks under
this rule in 1F1B for m >= 2; the paired order finishes for GPipe and 1F1B
(`tests/parallel/test_pipeline_nccl_order.py`, which also records that the executor posts exactly
the plan played). Pairing is not enough for every table gloo runs: if stage 0 runs forwards ahead
while stage 1 already alternates, stage 1's paired post waits for stage 0's receive of a gradient,
queued behind a send that waits for stage 1's next post. `Executor.step` plays its plans first, and
refuses such a table in one line; with `paired = False` it posts each operation alone again, and
refuses 1F1B.
On gloo, `batch_isend_irecv` posts each operation in turn, and the pairing changes no result. On
NCCL, PyTorch's note on `batch_isend_irecv` asks that a group's first batched call involve all its
ranks: every stage's first post is batched, so each takes part. (Which devices this has run on:
README's "What has run on GPUs".)

**The timeline: when each action computed.** After a step, `timeline` lists this rank's actions
as `(kind, i, start, end)`, in seconds from the step's start, and `step_time` is when the step
ended (its last send done). The interval is the computation only: it starts after the post with
its receive is done (waiting for a neighbour is the bubble, the idle time being measured, not work)
and ends before the send is posted. A paired post is waited for as one (on NCCL it is one work), so
the wait before a 1F1B steady-state action also covers the previous action's send, to a neighbour
that posts the receive for it at the same time: idle time, as the receive's wait is. `bubble.py`
turns it into each stage's idle fraction. Two clock reads per action: nothing else changes, so
the parity is the same with or without anyone reading it.
The clock is the host's (`time.perf_counter`). On CPU that is when the work ran; on CUDA the host
only queues kernels and runs ahead, so on a CUDA device every reading first waits for the device
(`torch.cuda.synchronize`), which costs the overlap of a send with the next computation. So the
training loop turns it off (`synchronize = False`, `strategy/pipeline.py`): its timeline on a GPU then
says when the host queued each action, not when it ran.

**`no_sync`: gradients reduced once per step.** Under data parallelism a wrapper reduces the
gradients during backward. Every micro-batch's backward but the step's last need not: their
gradients only add up locally. `Executor(..., no_sync=...)` takes a zero-argument callable that
returns a context manager (`lambda: strategy.no_sync(model)`) and runs every backward of this
rank's list inside it except the last one in the list, as `step.train_step` does for the loop's
micro-batches; after that backward the reduced gradients are the step's.
"""

import time
from collections import defaultdict, deque
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


def play_nccl(plans: list[list], batched: bool = True) -> None:
    """Post every rank's plan (`p2p.plan`) as NCCL runs it, without computing; refuse in one line if
    it cannot finish (module doc). `batched`: the posts go through `batch_isend_irecv`, so all of a
    rank's share one queue (its group's communicator); else one queue per peer (a pair's own)."""
    queues = defaultdict(deque)  # a communicator's queue on one rank: its posts not done, oldest first

    def queue(rank: int, peer: int) -> deque:
        return queues[(rank,) if batched else (rank, peer)]

    cursor, waits = [0] * len(plans), [None] * len(plans)  # waits[r]: the post whose receive r's host needs
    moved = True
    while moved:
        moved = False
        for rank, plan in enumerate(plans):  # each host posts, in order, until it needs a receive's data
            while waits[rank] is None and cursor[rank] < len(plan):
                step, cursor[rank], moved = plan[cursor[rank]], cursor[rank] + 1, True
                if isinstance(step, list):  # a post (a computation only takes time here)
                    post = dict.fromkeys(step, False)  # each operation -> done
                    queue(rank, step[0][3]).append(post)
                    waits[rank] = post if any(op[0] == "recv" for op in step) else None
        for (rank, *_), posts in list(queues.items()):  # a send meets its receive, each in its queue's head
            for send in [op for op, done in (posts[0].items() if posts else ()) if op[0] == "send" and not done]:
                moved |= _meet(send, rank, posts[0], queue(send[3], rank))
        for posts in queues.values():  # a post leaves its queue when all its operations are done
            while posts and all(posts[0].values()):
                posts.popleft()
        for rank, post in enumerate(waits):
            if post is not None and all(post.values()):
                waits[rank], moved = None, True
    stuck = [f"rank {rank} at {p2p.show([[op for op, done in posts[0].items() if not done]])}"
             for (rank, *_), posts in sorted(queues.items()) if posts]
    if stuck:
        raise ValueError("on NCCL this schedule would deadlock: " + ", ".join(stuck))


def _meet(send: tuple, rank: int, post: dict, peer_posts: deque) -> bool:
    """Complete `send` (rank's, in its head post `post`) if the peer's head post holds a receive from
    `rank` not done yet; the first such receive must be for the same micro-batch (module doc)."""
    _, kind, i, peer = send
    head = peer_posts[0] if peer_posts else {}
    receives = [op for op, done in head.items() if op[0] == "recv" and op[3] == rank and not done]
    if not receives:
        return False
    if receives[0][1:3] != (kind, i):
        raise ValueError(f"schedule out of order: rank {peer}'s recv {receives[0][1]}{receives[0][2]} "
                         f"would receive rank {rank}'s {kind}{i}")
    post[send] = head[receives[0]] = True
    return True


class Executor:
    """Runs tables of actions on `stage` (a `stages.Stage`), whose rank in `group` is its place in
    the pipeline. `dp_size`: the data-parallel world the loss is scaled by, as in `step.train_step`.
    `no_sync`: None, or a zero-argument callable returning a context manager, entered around every
    backward of this rank's list but the last (module doc).

    It runs `p2p.plan(actions, rank, pp, paired)`: the actions, and between them the posts of their
    sends and receives. `paired` (True) posts a send and the next action's receive from the same
    neighbour together, as NCCL needs in 1F1B; False posts each alone, as gloo allows (module doc).

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
        self.paired = True  # a send posted with the next receive from the same neighbour (module doc)

    def step(self, actions_by_rank: list, micro_batches: list[dict], num_targets: int):
        """Forward and backward of one step's micro-batches in this rank's order; return the step's
        summed loss (not scaled) on the last stage, None on the others."""
        if len(actions_by_rank) != self.stage.pp:
            raise ValueError(f"the schedule has {len(actions_by_rank)} ranks, the pipeline {self.stage.pp} stages")
        check(actions_by_rank, len(micro_batches))
        plans = [p2p.plan(actions, rank, self.stage.pp, self.paired) for rank, actions in enumerate(actions_by_rank)]
        play_nccl(plans, batched=self.paired)  # what this rank runs below is plans[rank], the plan checked here
        actions = actions_by_rank[self.stage.rank]
        last_backward = [action for action in actions if action[0] == "B"][-1]
        self.held, self.peak_held = {}, 0
        self.received, self.outgoing, self.sends = {}, {}, []  # by (kind, i): buffers in, tensors out; works
        self.loss_sum = None
        self.timeline, self.start = [], self.now()
        for item in plans[self.stage.rank]:
            # A sent tensor is kept until its send is done, not until the step ends: the activations
            # sent by GPipe's m forwards would otherwise all live to the end, whatever the schedule.
            self.sends = [(works, tensors) for works, tensors in self.sends if not all(w.is_completed() for w in works)]
            if isinstance(item, list):
                self.post(item, micro_batches)
            elif item[0] == "F":
                self.forward(item[1], micro_batches[item[1]], num_targets)
            else:
                # Only the last backward reduces across data-parallel ranks: the others just add up.
                with nullcontext() if self.no_sync is None or item == last_backward else self.no_sync():
                    self.backward(item[1], micro_batches[item[1]])
        for works, _ in self.sends:  # every send has arrived before the step ends (and its tensor may go)
            for work in works:
                work.wait()
        self.sends = []
        self.step_time = self.now() - self.start
        return self.loss_sum

    def now(self) -> float:
        """The host's clock, in seconds; on CUDA once the device has finished what was queued (module doc)."""
        if self.synchronize and torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def post(self, ops: list, micro_batches: list[dict]) -> None:
        """Post one step of the plan: its sends (of what the last action left in `outgoing`) and its
        receives (into new buffers in `received`), together. Wait for them if one is a receive: the
        next action computes on it. Sends alone are kept in `sends`, with their tensors, until done."""
        requests = []
        for direction, kind, i, peer in ops:
            if direction == "send":
                requests.append(p2p.send(self.outgoing.pop((kind, i)), peer, self.group))
            else:
                shape = p2p.activation_shape(micro_batches[i], self.stage.config.hidden_size)
                buffer = self.received[kind, i] = torch.empty(shape, dtype=self.dtype, device=self.device)
                requests.append(p2p.recv(buffer, peer, self.group))
        works = p2p.post(requests, batched=self.paired)
        if any(direction == "recv" for direction, *_ in ops):
            for work in works:
                work.wait()
        else:
            self.sends.append((works, [request.tensor for request in requests]))

    def forward(self, i: int, batch: dict, num_targets: int) -> None:
        stage = self.stage
        # The received activations become a leaf of this stage's graph: backward gives their gradient.
        inputs = None if stage.is_first else self.received.pop(("F", i))
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
            self.outgoing["F", i] = output.detach()  # the next post sends it

    def backward(self, i: int, batch: dict) -> None:
        stage = self.stage
        inputs, output = self.held.pop(i)  # the graph of micro-batch i goes with them after this
        start = self.now()  # after the receive, as in forward
        if stage.is_last:
            output.backward()
        else:
            output.backward(self.received.pop(("B", i)))
        self.timeline.append(("B", i, start - self.start, self.now() - self.start))  # before the send is posted
        if not stage.is_first:
            self.outgoing["B", i] = inputs.grad  # the next post sends it
