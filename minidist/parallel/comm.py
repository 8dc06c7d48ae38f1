"""Collectives: what goes over the wire, and how many bytes each rank sends.

Every data-parallel strategy is built from three collectives over N ranks:

- ``all_reduce(x)``: every rank ends with the sum of everyone's ``x``. DDP uses it on gradients.
- ``reduce_scatter(out, x)``: the sum of everyone's ``x`` is cut into N shards and rank r keeps
  shard r. ZeRO-2 and FSDP use it on gradients: each rank only needs the gradient of its shard.
- ``all_gather(out, shard)``: every rank's shard, concatenated, on every rank. ZeRO and FSDP use
  it to rebuild full parameters from shards.

How much does each cost? NCCL and gloo use (among others) the *ring* algorithm: the ranks form a
ring, the tensor is cut into N chunks, and in each of N-1 rounds every rank sends one chunk to
its right neighbour. A reduce-scatter is N-1 rounds in which the chunk received is added to
one's own; after them rank r holds one chunk summed over all ranks. An all-gather is N-1 rounds
that pass the finished chunks around. An all-reduce is a reduce-scatter followed by an
all-gather. Per rank, for a tensor of S bytes:

    reduce_scatter, all_gather:  (N-1)/N * S
    all_reduce:                 2(N-1)/N * S

which hardly depends on N: the ring is *bandwidth optimal* (Patarasuk and Yuan 2009, "Bandwidth
optimal all-reduce algorithms for clusters of workstations"; NCCL's "bus bandwidth" in
nccl-tests/doc/PERFORMANCE.md uses the same factors). So a DDP step sends 2(N-1)/N x 4P bytes
per rank for P fp32 gradients, whether N is 2 or 1,000.

The wrappers below call ``torch.distributed`` (which picks its own algorithm) and count the bytes
the ring would send, into a per-process ``counter`` that the training loop takes once per step
(``comm_bytes`` in metrics.jsonl): the algorithm's cost, not a measurement of the wire. A library
may send more: on CPU, gloo's reduce-scatter sends 2(N-1)/N x S, as much as its all-reduce
(lesson 01 measures it), so there ZeRO's and FSDP's real traffic exceeds ``comm_bytes``.
``ring_all_reduce`` then does the same all-reduce by hand with point-to-point ``send``/``recv``,
to show there is no magic in the library call.

**Within a node and across nodes.** On more than one node the links differ (NVLink inside a
node, InfiniBand between nodes), and so does what a ring sends over each: `across_nodes.py` says
which of the counted bytes cross to another node. It is measurement, not a collective, so it is
not written here: it subscribes to the counter (``counter.subscribers``), which tells it of every
collective it counts.

On one rank there is nothing to send: the three wrappers copy locally (an all-reduce does
nothing) and skip the library, as PyTorch's FSDP2 does, so that a one-rank benchmark times the
strategy's own work and not a library round trip.
"""

from fractions import Fraction

import torch
import torch.distributed as dist


class ByteCounter:
    """Bytes this rank would send under the ring algorithm, summed since the last ``take``.

    The fractions (N-1)/N are kept exact (``Fraction``), so a step's total equals the formula
    2·P·(N-1)/N x bytes exactly, not up to rounding, even when collectives run over groups of
    different sizes (a shard group and a replicate group: ``mesh.py``).

    ``subscribers``: objects that want to know more of each collective than the total (which of
    its bytes cross nodes: ``across_nodes.py``). Each is told of every count, ``add(sent, group)``,
    and of every ``reset``, so that its own figures always cover the same collectives as the total.
    """

    def __init__(self):
        self.subscribers = []
        self.reset()

    def reset(self) -> None:
        self._sent = Fraction(0)
        for subscriber in self.subscribers:
            subscriber.reset()

    def add(self, rounds: int, nbytes: int, world_size: int, group=None) -> None:
        """``rounds`` ring rounds (N-1 or 2(N-1)) over ``group``, of N ranks, each sending 1/N of
        ``nbytes``; the subscribers are told of it."""
        sent = Fraction(rounds * nbytes, world_size)
        self._sent += sent
        for subscriber in self.subscribers:
            subscriber.add(sent, group)

    @property
    def bytes_sent(self) -> float:
        return float(self._sent)

    def take(self) -> float:
        """The bytes counted since the last ``take``; the count starts again from zero."""
        sent = self.bytes_sent
        self.reset()
        return sent


counter = ByteCounter()  # one per process: each rank counts what it sends


def _world(group) -> int:
    return dist.get_world_size(group)


def _count(rounds: int, tensor: torch.Tensor, group) -> None:
    """Count ``rounds`` ring rounds over ``group``, each sending 1/N of ``tensor``."""
    counter.add(rounds, tensor.numel() * tensor.element_size(), _world(group), group)


def _sharded(what: str, full: torch.Tensor, shard: torch.Tensor, group) -> int:
    """The group's size N, once ``full`` is checked to hold N x ``shard``'s elements. Over more
    than one rank the ring's bytes are counted too: N-1 rounds of 1/N of ``full`` (a
    reduce-scatter's input, an all-gather's output)."""
    n = _world(group)
    if full.numel() != n * shard.numel():
        raise ValueError(f"{what} has {full.numel()} elements, expected {n} x {shard.numel()}")
    if n > 1:
        _count(n - 1, full, group)
    return n


class _Done:
    """The handle of a collective that finished at once (one rank: a local copy)."""

    def wait(self) -> bool:
        return True


def _local(async_op: bool):
    return _Done() if async_op else None


def all_reduce(tensor: torch.Tensor, group=None, async_op: bool = False, op=dist.ReduceOp.SUM):
    """Sum ``tensor`` over the ranks, in place (or its largest, with ``op=dist.ReduceOp.MAX``: the
    vocabulary-parallel loss, `tensor/vocab.py`). With ``async_op`` return a handle to ``wait()`` on."""
    n = _world(group)
    if n == 1:
        return _local(async_op)
    _count(2 * (n - 1), tensor, group)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


class _ShardAfter:
    """The handle of an all-reduce standing in for a reduce-scatter: `wait()` waits for the sum,
    copies this rank's shard of it into the output, and frees the input's memory.

    Freed, not just let go: gloo's worker thread keeps its own reference to the input until it
    next runs, a moment after `wait()` returns (longer on a busy machine). Dropping ours alone
    would leave the memory a rank holds up to when that thread is scheduled."""

    def __init__(self, work, output: torch.Tensor, input: torch.Tensor, shard: torch.Tensor):
        self.work, self.output, self.input, self.shard = work, output, input, shard

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.output.copy_(self.shard)
            self.input.untyped_storage().resize_(0)  # scratch: the caller never reads it again
            self.work = self.output = self.input = self.shard = None
        return True


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False,
                   input_is_scratch: bool = False):
    """Sum ``input`` (N equal shards, concatenated) over the ranks; rank r gets shard r in ``output``.

    PyTorch's gloo backend runs a reduce-scatter as an all-reduce: it all-reduces a copy of the
    input, then copies shard r out, so for as long as the collective runs a rank holds a second
    buffer the size of the input (and sends as much as an all-reduce: lesson 01). NCCL, on GPUs,
    needs no such copy. A caller that is about to drop ``input`` anyway (ZeRO-2's and FSDP's
    gradient buckets) says ``input_is_scratch=True``: on gloo the input itself is then all-reduced
    in place (it ends up holding the sum), shard r is copied out at ``wait()`` and the input's
    memory freed there. Same bytes on the wire as gloo's own reduce-scatter, without the copy, so
    that CPU memory shows what a GPU's would."""
    n = _sharded("reduce_scatter: input", input, output, group)
    if n == 1:
        output.copy_(input)
        return _local(async_op)
    if input_is_scratch and dist.get_backend(group) == "gloo":
        work = dist.all_reduce(input, op=dist.ReduceOp.SUM, group=group, async_op=True)
        handle = _ShardAfter(work, output, input, input.view(n, -1)[dist.get_rank(group)])
        if async_op:
            return handle
        handle.wait()
        return None
    return dist.reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather(output: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False):
    """Concatenate every rank's ``shard`` into ``output`` (N x the shard), on every rank."""
    n = _sharded("all_gather: output", output, shard, group)
    if n == 1:
        output.copy_(shard)
        return _local(async_op)
    return dist.all_gather_into_tensor(output, shard, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, group=None):
    """Copy rank ``src``'s ``tensor`` to every rank. Used when a strategy wraps a model (rank 0's
    weights and buffers to every rank; under HSDP, node 0's shards to the other copies) and when
    HSDP loads a full checkpoint (``flat_state.py``, through ``broadcast_from_first_copy`` below):
    never inside a training step, so it is not part of a step's count."""
    return dist.broadcast(tensor, src=src, group=group)


def broadcast_from_first_copy(tensors, replicate_group) -> None:
    """HSDP: the first copy's tensors (replicate rank 0: node 0) onto the other copies, in place.

    Loading cuts the weights once, on rank 0, and scatters them over the first shard group; the
    other nodes receive their shards from it, one shard per rank, instead of loading the model
    again. Once, at wrap or load time: not part of a training step's count."""
    if replicate_group is None or dist.get_world_size(replicate_group) == 1:
        return
    src = dist.get_global_rank(replicate_group, 0)
    for tensor in tensors:
        device = collective_device(tensor, replicate_group)  # a host shard (--cpu_offload): through the GPU on NCCL
        sent = tensor.data.to(device)
        broadcast(sent, src=src, group=replicate_group)
        if sent is not tensor.data:
            tensor.data.copy_(sent)


def collective_device(t: torch.Tensor, group=None) -> torch.device:
    """Where a collective on `t` runs: NCCL only moves GPU memory, so a host tensor (`offload.py`)
    goes through the current GPU; gloo takes `t` where it is."""
    if t.device.type == "cpu" and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return t.device


def scatter(output: torch.Tensor, chunks: list[torch.Tensor] | None, src: int = 0, group=None):
    """Rank ``src`` sends ``chunks[r]`` to rank r, which receives it in ``output``. Used when FSDP
    shards a model that only rank ``src`` has loaded, and to load a full checkpoint into flat
    shards (``flat.scatter_flat``); not part of a step's count."""
    return dist.scatter(output, chunks if dist.get_rank() == src else None, src=src, group=group)


def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) ``tensor`` in place with nothing but send and recv between neighbours.

    The tensor is viewed flat and cut into N chunks (the first ones one element longer when N
    does not divide it). In round s of the reduce-scatter phase, rank r sends chunk (r - s) to
    rank r+1 and adds the chunk (r - s - 1) it receives from rank r-1 into its own. After N-1
    rounds, chunk (r + 1) has passed through every rank and holds the full sum on rank r. The
    all-gather phase passes these finished chunks around the ring for N-1 more rounds, copying
    instead of adding. Each rank sends 2(N-1) chunks in all: 2(N-1)/N of the tensor.

    Returns ``tensor``. Equal to ``dist.all_reduce`` up to the order of floating-point additions.
    """
    n, rank = _world(group), dist.get_rank(group)
    if n == 1:
        return tensor
    flat = tensor.view(-1)  # a view: writing into the chunks writes into the tensor
    chunks = list(torch.tensor_split(flat, n))
    right, left = (rank + 1) % n, (rank - 1) % n
    if group is not None:  # send/recv take global ranks
        right, left = dist.get_global_rank(group, right), dist.get_global_rank(group, left)

    def exchange(send_index: int, recv_index: int, reduce: bool) -> None:
        outgoing = chunks[send_index]
        incoming = torch.empty_like(chunks[recv_index])
        # Post the receive and the send together: if every rank sent first and waited, a
        # backend without buffering would deadlock the whole ring.
        requests = [dist.isend(outgoing, right, group=group), dist.irecv(incoming, left, group=group)]
        for request in requests:
            request.wait()
        _count(n, outgoing, group)  # exactly what went out: the chunk (n rounds of 1/n of it)
        if reduce:
            chunks[recv_index].add_(incoming)
        else:
            chunks[recv_index].copy_(incoming)

    for s in range(n - 1):  # reduce-scatter: partial sums travel right
        exchange((rank - s) % n, (rank - s - 1) % n, reduce=True)
    for s in range(n - 1):  # all-gather: finished sums travel right
        exchange((rank + 1 - s) % n, (rank - s) % n, reduce=False)
    return tensor
