"""Measurement, not a collective: which of the bytes `comm.py` counts cross from one node to another.

On more than one node the links differ: NVLink inside a node (hundreds of GB/s per GPU),
InfiniBand between nodes (12 to 25 GB/s per GPU). So the loop also records how many of a rank's
bytes cross to another node (`comm_bytes_within_node`, `comm_bytes_across_nodes` and
`comm_bytes_across_nodes_by_rank` in metrics.jsonl, through `Strategy.take_comm_bytes(split=True)`).

The counter's rule is a model, the simplest ring: one ring in rank order, where a rank sends every
chunk to its right neighbour, the next rank of the group (in group order, which is node order:
ranks of a node are consecutive), so *all* of what a rank sends in a collective crosses nodes if
that neighbour is on another node, and none of it does otherwise. Node = global rank // ranks per
node (`LOCAL_WORLD_SIZE`, which torchrun and the launcher set). Under this model a flat FSDP ring
over R nodes crosses on R of its N ranks, which send all of their bytes across, the others none.
It is a model, not a measurement (gloo's sockets are not watched, nor its own choice of
algorithm), and it is not what NCCL does on GPU nodes.

NCCL builds its rings (channels) from the topology it detects: each ring enters a node through a
NIC, visits the node's GPUs over NVLink and leaves through a NIC, and it runs several rings at
once so that every NIC carries one flow (NVIDIA/nccl#412). With one NIC per GPU, S per node, the
bytes that leave a node are the same as under the rank-order ring, one rank's whole send, but they
are shared by its S NICs: `bytes_per_nic` says how many, by formula, for flat FSDP and HSDP. HSDP
(`fsdp.py`, `mesh.py`) keeps the gathers and the reduce-scatter within a node, and every rank sends
across nodes only the all-reduce of its gradient shard over the R copies: 2(P/S)(R-1)/R elements,
once a step (once a micro-batch with `--accumulate_sharded`).

`comm.counter` tells this module's subscriber of every collective it counts and of every reset,
so the part across nodes always covers the same collectives as the total. Importing this module
subscribes it (`strategy/base.py` does, before any step).
"""

import os
from fractions import Fraction

import torch
import torch.distributed as dist

from minidist.parallel import comm

SPLIT_KEYS = ("comm_bytes", "comm_bytes_within_node", "comm_bytes_across_nodes", "comm_bytes_across_nodes_by_rank",
              "comm_bytes_tensor_parallel")


def ranks_per_node() -> int:
    """The ranks of one node: as the run's strategy names them (`split.ranks_per_node`, from the
    launch: torchrun's LOCAL_WORLD_SIZE, or SLURM's tasks per node), else `LOCAL_WORLD_SIZE`, else
    every rank on one node."""
    return split.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


def crosses_nodes(group=None) -> bool:
    """Whether this rank's right neighbour on the ring of `group` sits on another node."""
    n, per_node = dist.get_world_size(group), ranks_per_node()
    right = (dist.get_rank(group) + 1) % n
    right = dist.get_global_rank(group, right) if group is not None else right
    return right // per_node != dist.get_rank() // per_node


class AcrossNodes:
    """Subscribed to `comm.counter`: its count (`sent`, exact, the same as the counter's own), the
    part of it whose ring link crosses nodes (`across`), and the part sent over the
    tensor-parallel group (`tensor`: activations, lesson 11; the rest is the data-parallel
    strategy's gradients and weights), once the strategy names that group (`tensor_group`)."""

    def __init__(self):
        self.tensor_group = None
        self.ranks_per_node = None  # set by the strategy, from the launch
        self.reset()

    def reset(self) -> None:
        self.sent = self.across = self.tensor = Fraction(0)

    def add(self, sent: Fraction, group) -> None:
        self.sent += sent
        if crosses_nodes(group):
            self.across += sent
        if group is not None and group is self.tensor_group:
            self.tensor += sent


split = AcrossNodes()  # one per process, as `comm.counter`
comm.counter.subscribers.append(split)


def take_split(group, device) -> dict:
    """`comm.counter.take()`, with the bytes within this rank's node and across nodes (they add up
    to the total), and what every rank of `group` sent across nodes, by rank
    (`comm_bytes_across_nodes_by_rank`): under this module's model, one ring in rank order, the
    ring crosses nodes on a few of its ranks only (NCCL's rings share a node's crossing among its
    NICs instead: `bytes_per_nic`). With tensor parallelism, the part of the total sent over its group
    (`comm_bytes_tensor_parallel`; None without). Every rank must call it (an all-gather of one
    number, not counted)."""
    sent, crossing, tensor = split.sent, split.across, split.tensor
    comm.counter.take()  # the count starts again from zero, and so does `split`
    mine = torch.tensor([float(crossing)], dtype=torch.float64, device=device)
    by_rank = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(by_rank, mine, group=group)
    return {"comm_bytes": float(sent), "comm_bytes_within_node": float(sent - crossing),
            "comm_bytes_across_nodes": float(crossing),
            "comm_bytes_across_nodes_by_rank": torch.cat(by_rank).tolist(),  # read once, not rank by rank
            "comm_bytes_tensor_parallel": float(tensor) if split.tensor_group is not None else None}


def bytes_leaving_a_node(strategy: str, params: int, root_params: int, nodes: int, per_node: int,
                         micro_batches: int = 1, compute_bytes: int = 2, reduce_bytes: int = 4,
                         accumulate_sharded: bool = False) -> Fraction:
    """Bytes that leave one node per optimizer step for the hand-written "fsdp" (flat, over all
    N = nodes x per_node GPUs) or "hsdp" (sharded within a node, replicated across), by formula.

    Flat FSDP: every ring of N ranks leaves each node once, and what a ring link carries is what one
    rank sends, so a node sends (N-1)/N of every collective's full size across: the layers gathered
    twice per micro-batch and the root (`root_params`: embeddings, final norm, output layer) once,
    in the compute dtype, and one reduce-scatter per step (accumulation under `no_sync`) in fp32:
    (compute_bytes (2k P - k P_root) + reduce_bytes P)(N-1)/N, (4k + 4)P - 2k P_root times (N-1)/N
    in bf16. HSDP: the S ranks of the node each all-reduce their fp32 gradient shard with their
    R - 1 twins once per step, 2 (P/S)(R-1)/R each: reduce_bytes x 2P(R-1)/R for the node, however
    many micro-batches. (Ring algorithm; NCCL may pick a tree for the all-reduce.)

    With `accumulate_sharded` (`--accumulate_sharded`: `strategy.no_sync` is a null context) every
    micro-batch synchronises, as the last one does under no_sync (`fsdp.py`): flat FSDP
    reduce-scatters k times over all N ranks, (compute_bytes (2k P - k P_root) + reduce_bytes k P)
    (N-1)/N, 8kP - 2k P_root times (N-1)/N in bf16, k times a step of one micro-batch; HSDP
    all-reduces each micro-batch's shard over the copies, k x reduce_bytes x 2P(R-1)/R. The flag
    keeps P/N or P/S gradient elements between micro-batches instead of P, and pays for it in
    reductions: under HSDP they are exactly the bytes that cross nodes."""
    n, k = nodes * per_node, micro_batches
    reductions = k if accumulate_sharded else 1
    if nodes == 1:
        return Fraction(0)
    if strategy == "fsdp":
        gathered = 2 * k * params - k * root_params
        return Fraction(compute_bytes * gathered + reduce_bytes * reductions * params) * Fraction(n - 1, n)
    if strategy == "hsdp":
        return reductions * Fraction(reduce_bytes * 2 * params) * Fraction(nodes - 1, nodes)
    raise ValueError(f"bytes_leaving_a_node: strategy is fsdp or hsdp, not {strategy!r}")


def bytes_per_nic(strategy: str, params: int, root_params: int, nodes: int, per_node: int, **kw) -> Fraction:
    """Bytes one NIC sends to other nodes per step, with one NIC per GPU and NCCL spreading its
    rings' node crossings evenly over them (`bytes_leaving_a_node` / per_node). Under the counter's
    rank-order ring one GPU per node would send all of `bytes_leaving_a_node` through its NIC."""
    return bytes_leaving_a_node(strategy, params, root_params, nodes, per_node, **kw) / per_node
