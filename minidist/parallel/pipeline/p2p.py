"""What crosses a cut between two stages: one micro-batch's hidden states forward, their gradient
backward, each by point-to-point `isend` / `irecv` between neighbouring ranks.

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

Sends are asynchronous: `send` returns the work, which the caller keeps (with the tensor) until
the step ends, so that a stage goes on computing while its output is on the wire. A receive is
waited for at once: the stage cannot compute without it.

The bytes are counted in `comm.counter`, as every collective's are: a send to one peer is one
round of the whole tensor (a ring of one), what the rank puts on the wire. Receives are not
counted: the sender counts them.
"""

import torch
import torch.distributed as dist

from minidist.parallel import comm


def send(tensor: torch.Tensor, dst: int, group=None):
    """Start sending `tensor` (contiguous) to rank `dst` (of `group`); return the work, to wait on
    later. The caller keeps `tensor` alive until then: the send reads it in the background."""
    comm.counter.add(1, tensor.numel() * tensor.element_size(), 1)
    return dist.isend(tensor, dist.get_global_rank(group, dst) if group is not None else dst, group=group)


def recv(shape: tuple, dtype: torch.dtype, device, src: int, group=None) -> torch.Tensor:
    """Receive a tensor of `shape` from rank `src` (of `group`); return it when it has arrived."""
    buffer = torch.empty(shape, dtype=dtype, device=device)
    dist.irecv(buffer, dist.get_global_rank(group, src) if group is not None else src, group=group).wait()
    return buffer


def activation_shape(batch: dict, hidden_size: int) -> tuple:
    """The shape of what crosses a cut for this micro-batch, known to both sides from the batch."""
    return (*batch["input_ids"].shape, hidden_size)
