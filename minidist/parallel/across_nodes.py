"""Measurement, not a collective: which of the bytes `comm.py` counts cross from one node to another.

On more than one node the links differ: NVLink inside a node (hundreds of GB/s per GPU),
InfiniBand between nodes (12 to 25 GB/s per GPU). So the loop also records how many of a rank's
bytes cross to another node (`comm_bytes_within_node`, `comm_bytes_across_nodes` and
`comm_bytes_across_nodes_by_rank` in metrics.jsonl, through `Strategy.take_comm_bytes(split=True)`).

The rule is the ring's: a rank sends every chunk to its right neighbour, the next rank of the
group (in group order, which is node order: ranks of a node are consecutive), so *all* of what a
rank sends in a collective crosses nodes if that neighbour is on another node, and none of it does
otherwise. Node = global rank // ranks per node (`LOCAL_WORLD_SIZE`, which torchrun and the
launcher set). Over a group of N = R x S ranks on R nodes (flat FSDP) the ring crosses R times:
R of the N ranks send all of their 3P(N-1)/N across, the others nothing, and the collective runs
at the pace of those R inter-node links (NCCL builds its rings the same way, crossing each node
boundary once per ring). HSDP (`fsdp.py`, `mesh.py`) keeps the gathers and the reduce-scatter
within a node, and every rank sends across nodes only the all-reduce of its gradient shard over
the R copies: 2(P/S)(R-1)/R elements.

`comm.counter` tells this module's subscriber of every collective it counts and of every reset,
so the part across nodes always covers the same collectives as the total. Importing this module
subscribes it (`strategy.py` does, before any step).
"""

from fractions import Fraction

import torch
import torch.distributed as dist

from minidist.parallel import comm

SPLIT_KEYS = ("comm_bytes", "comm_bytes_within_node", "comm_bytes_across_nodes", "comm_bytes_across_nodes_by_rank")


def crosses_nodes(group=None) -> bool:
    """Whether this rank's right neighbour on the ring of `group` sits on another node."""
    from minidist.runtime.distributed import get_env

    n, per_node = dist.get_world_size(group), get_env().local_world_size
    right = (dist.get_rank(group) + 1) % n
    right = dist.get_global_rank(group, right) if group is not None else right
    return right // per_node != dist.get_rank() // per_node


class AcrossNodes:
    """Subscribed to `comm.counter`: its count (`sent`, exact, the same as the counter's own) and
    the part of it whose ring link crosses nodes (`across`)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.sent = self.across = Fraction(0)

    def add(self, sent: Fraction, group) -> None:
        self.sent += sent
        if crosses_nodes(group):
            self.across += sent


split = AcrossNodes()  # one per process, as `comm.counter`
comm.counter.subscribers.append(split)


def take_split(group, device) -> dict:
    """`comm.counter.take()`, with the bytes within this rank's node and across nodes (they add up
    to the total), and what every rank of `group` sent across nodes, by rank
    (`comm_bytes_across_nodes_by_rank`): a ring crosses nodes on a few of its ranks only, and its
    slowest link paces it. Every rank must call it (an all-gather of one number, not counted)."""
    sent, crossing = split.sent, split.across
    comm.counter.take()  # the count starts again from zero, and so does `split`
    mine = torch.tensor([float(crossing)], dtype=torch.float64, device=device)
    by_rank = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(by_rank, mine, group=group)
    return {"comm_bytes": float(sent), "comm_bytes_within_node": float(sent - crossing),
            "comm_bytes_across_nodes": float(crossing),
            "comm_bytes_across_nodes_by_rank": torch.cat(by_rank).tolist()}  # read once, not rank by rank
