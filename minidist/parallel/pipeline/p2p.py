"""What crosses a cut between two stages: one micro-batch's hidden states forward, their gradient
backward, each by point-to-point sends and receives between neighbouring ranks, posted as `plan`
says.

**Shapes agreed once, without a message.** A receive needs a buffer of the right shape before the
data arrives. Every stage reads the same micro-batches (`stages.py`), so the receiver knows the
micro-batch's (batch, sequence) from its own copy, and the hidden size and dtype from the model:
the activation is (batch, sequence, hidden) and its gradient the same. Frameworks whose stages do
not see the batch send the shape first, in a small message per micro-batch (torch.distributed's
`pipelining` infers it once by a dry run); here there is nothing to send.

**Nothing the next stage does not need.** Only the hidden states cross: not the attention mask,
the position ids or the rotary embeddings, which each stage computes from its own batch, and not
the autograd graph: the sender sends a detached tensor, the receiver makes it a leaf that
requires a gradient, and backward joins the two graphs by sending that leaf's gradient back
(`executor.py`).

**The plan: which messages, posted when, and which together.** A rank's list of actions
(`schedules.py`) implies its messages: a forward receives from the stage before and sends to the
stage after, a backward the other way (`messages`). `plan` lays them out in the order the executor
posts them, between its computations: each action's receive just before it, its send just after.
And it *pairs* them: when an action's send goes to the neighbour the next action receives from,
the two are posted together, as one batch (`post`, by `torch.distributed.batch_isend_irecv`). That
happens in 1F1B's steady state (and once in GPipe, where the forwards turn into backwards): a
forward's output goes to the stage after, whose gradient the next backward receives; a backward's
gradient goes to the stage before, whose activations the next forward receives. On gloo it changes
no result: a send there never waits for its receive. On NCCL it is what keeps 1F1B from hanging:
there a send does not finish until its receive is reached, in order, and two neighbours that each
send first and receive second wait for each other for ever, unless each posts its send and
receive in one group, whose operations progress together
(`executor.py` plays both orders under NCCL's rule; Megatron-LM's `p2p_communication.py` pairs
the same way, in `send_forward_recv_backward` and `send_backward_recv_forward`).

A batch of sends only is not waited for: the stage goes on computing while its output is on the
wire, and the caller keeps the tensors until the work is done. A batch with a receive is waited
for at once (its send too): the stage cannot compute without the data.

The bytes are counted in `comm.counter`, as every collective's are: a send to one peer is one
round of the whole tensor (a ring of one), what the rank puts on the wire. Receives are not
counted: the sender counts them.
"""

import torch
import torch.distributed as dist

from minidist.parallel import comm

Op = tuple[str, str, int, int]  # ("send" | "recv", "F" | "B", micro-batch i, peer): what an action sends or receives


def messages(action: tuple[str, int], rank: int, pp: int) -> tuple[Op | None, Op | None]:
    """What `action` on stage `rank` of `pp` receives before it computes and sends after (None: nothing).
    A forward's activations come from the stage before and go to the stage after; a backward's
    gradients the other way. The first stage embeds its tokens; the last starts backward from its loss."""
    kind, i = action
    source, target = (rank - 1, rank + 1) if kind == "F" else (rank + 1, rank - 1)
    receive = ("recv", kind, i, source) if 0 <= source < pp else None
    send = ("send", kind, i, target) if 0 <= target < pp else None
    return receive, send


def plan(actions: list[tuple[str, int]], rank: int, pp: int, paired: bool = True) -> list:
    """Rank `rank`'s actions with its posts between them, in the order the executor runs them: an
    action is ("F", i) or ("B", i), a post a list of `Op`s posted together. With `paired`, an
    action's send and the next action's receive go in one post when they are with the same
    neighbour (module doc); without, every send and receive is posted alone."""
    steps = []
    for action in actions:
        receive, send = messages(action, rank, pp)
        if receive is not None:
            last = steps[-1] if steps else None
            if paired and isinstance(last, list) and last[-1][0] == "send" and last[-1][3] == receive[3]:
                last.append(receive)  # posted with the previous action's send: NCCL needs them together
            else:
                steps.append([receive])
        steps.append(action)
        if send is not None:
            steps.append([send])
    return steps


def show(steps: list) -> str:
    """A plan as text: `F0 | send F0>1 | F1 | send F1>1 + recv B0<1 | B0 ...` (a post between bars)."""
    return " | ".join(" + ".join(f"{d} {k}{i}{'>' if d == 'send' else '<'}{peer}" for d, k, i, peer in step)
                      if isinstance(step, list) else f"{step[0]}{step[1]}" for step in steps)


def send(tensor: torch.Tensor, dst: int, group=None) -> dist.P2POp:
    """The operation that sends `tensor` (contiguous) to rank `dst` (of `group`), for `post` to
    start. The caller keeps `tensor` alive until its work is done: the send reads it in the background."""
    comm.counter.add(1, tensor.numel() * tensor.element_size(), 1)
    return dist.P2POp(dist.isend, tensor, _global(group, dst), group=group)


def recv(buffer: torch.Tensor, src: int, group=None) -> dist.P2POp:
    """The operation that receives into `buffer` from rank `src` (of `group`), for `post` to start."""
    return dist.P2POp(dist.irecv, buffer, _global(group, src), group=group)


def post(ops: list[dist.P2POp], batched: bool = True) -> list:
    """Start `ops`; return their works, to wait on. `batched`: together, as one group
    (`batch_isend_irecv`: on NCCL one group call, on gloo each in turn); else each alone."""
    if batched:
        return dist.batch_isend_irecv(ops)
    return [op.op(op.tensor, op.peer, group=op.group) for op in ops]


def _global(group, rank: int) -> int:
    """The global rank of `group`'s rank `rank`: `P2POp` takes a global rank on every PyTorch this
    project runs on (a group's own rank, `group_peer`, only on recent ones)."""
    return dist.get_global_rank(group, rank) if group is not None else rank


def activation_shape(batch: dict, hidden_size: int) -> tuple:
    """The shape of what crosses a cut for this micro-batch, known to both sides from the batch."""
    return (*batch["input_ids"].shape, hidden_size)
