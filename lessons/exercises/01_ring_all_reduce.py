"""Exercise 01: the ring all-reduce, by hand (lesson 01, `lessons/01_collectives.md`).

Fill in `ring_all_reduce` below, then check it from the repository root:

    MINIDIST_EXERCISE=lessons/exercises/01_ring_all_reduce.py python -m pytest -q tests/course/test_exercises.py

The check starts 3 gloo ranks (CPU processes), runs your function on tensors of several sizes,
shapes and dtypes (7 elements, that 3 does not divide; 1 element, so that two ranks get an empty
chunk; a 3 x 4 matrix; integers), and compares each rank's result with the library's
`dist.all_reduce`. It passes, or names the rank, the tensor, what was expected and what came,
with a hint at the usual mistake. minidist's own answer is `ring_all_reduce` in
`minidist/parallel/comm.py`: read it after.
"""

import torch
import torch.distributed as dist

EXERCISE = "01_ring_all_reduce"  # tells the check which exercise this file answers


def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum `tensor` over the ranks, in place, with nothing but sends and receives between neighbours.

    The ring: the N ranks stand in a circle; rank r sends only to its right neighbour (r + 1) % N
    and receives only from its left neighbour (r - 1) % N. The tensor is cut into N chunks.

    1. **Reduce-scatter**, N - 1 rounds. In round s (s = 0 .. N-2) rank r sends chunk (r - s) % N
       and receives chunk (r - s - 1) % N, which it *adds* into its own copy of that chunk. A
       partial sum travels right, growing by one rank's share per round; after the last round
       chunk (r + 1) % N holds the sum over all ranks, on rank r.
    2. **All-gather**, N - 1 more rounds. In round s rank r sends chunk (r + 1 - s) % N (first the
       one it finished) and receives chunk (r - s) % N, which it *copies* over its own.

    Each rank sends 2(N-1) chunks: 2(N-1)/N of the tensor, whatever N (lesson 01's formula).

    What the check insists on:
    - no library collective (`dist.all_reduce`, `dist.all_gather`, `dist.broadcast`, ... and
      `minidist.parallel.comm`'s wrappers of them): point-to-point only (`dist.isend`,
      `dist.irecv`, or `dist.send`, `dist.recv`);
    - the sum ends in `tensor` itself (in place: the caller keeps using its tensor), and
      `tensor` is returned;
    - each rank sends about 2(N-1)/N of the tensor's bytes (one chunk per round).

    Hints:
    - `n, rank = dist.get_world_size(group), dist.get_rank(group)`; with one rank there is
      nothing to do.
    - `chunks = list(torch.tensor_split(tensor.view(-1), n))` gives N *views*: writing into a
      chunk writes into `tensor`. Their sizes may differ by one (7 elements on 3 ranks: 3, 2, 2),
      and a chunk may be empty (1 element on 3 ranks): sending an empty tensor is fine.
    - Receive into a fresh buffer (`torch.empty_like(chunks[k])`), then add or copy it in.
    - Post the send and the receive of a round together (`dist.isend(...)`, `dist.irecv(...)`,
      then `.wait()` on both). If every rank first sent and waited for its send to finish, a
      backend without buffering would deadlock the whole ring.
    - (`group`: the check passes None. With a group, `dist.isend`/`irecv` take *global* ranks:
      `dist.get_global_rank(group, r)`.)
    - The usual mistakes: stopping after the reduce-scatter (each rank then has one right chunk);
      adding in the all-gather phase; sending the whole tensor to every rank (right sums, but
      (N-1) x the bytes of the tensor instead of 2(N-1)/N).
    """
    raise NotImplementedError("ring_all_reduce is yours to write (its docstring says how)")
