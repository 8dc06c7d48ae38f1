"""Exercise 02: a bucket's gradient hook, the heart of bucketed DDP (lesson 02, `lessons/02_ddp.md`).

Fill in `_on_grad_ready` below, then check it from the repository root:

    MINIDIST_EXERCISE=lessons/exercises/02_bucket_hook.py python -m pytest -q tests/course/test_exercises.py

Everything else is minidist's own `BucketedDDP` (`minidist/parallel/ddp.py`): the broadcast at
wrap time, the buckets (`GradientBucket`: a flat `buffer`, each parameter's `offsets`, a
`pending` count), the hook registration, and `_finish`, which waits for every bucket and makes
each `param.grad` a view of its averaged slice. The check wraps a small 5-layer network on 2 gloo
ranks in your class (5 buckets), runs two backward passes on different data per rank, and
compares every gradient with a plain copy's, averaged over the ranks by the library, and checks
*when* each bucket's all-reduce was launched (as soon as the bucket is full, not before, not at
the end) and what it held. minidist's own answer is
`BucketedDDP._on_grad_ready`: read it after.
"""

from minidist.parallel import comm, ddp

EXERCISE = "02_bucket_hook"  # tells the check which exercise this file answers


class BucketedDDP(ddp.BucketedDDP):
    """minidist's bucketed DDP, with the gradient hook yours to write."""

    def _on_grad_ready(self, param) -> None:
        """Called by autograd once per parameter per backward, when `param.grad` holds its gradient.

        Backward produces gradients from the last layer to the first. The parameters are packed
        into buckets in that order, so a bucket fills while backward goes on; the moment it is
        full, its all-reduce can start, and overlap the gradients of the earlier layers still
        being computed. That overlap is the whole point of buckets.

        What to do, in order:
        1. Inside `no_sync()` (lesson 03) `self.require_sync` is False: do nothing at all.
        2. Find the parameter's bucket: `b, i = self._bucket_of[id(param)]` gives the bucket's
           index in `self.buckets` and the parameter's index in `bucket.params`.
        3. Copy the gradient (flattened) into its slice of the bucket's flat buffer: the slice
           starts at `bucket.offsets[i]` and holds `param.numel()` elements.
        4. One gradient less to wait for: `bucket.pending` counts them down.
        5. When the bucket is full: divide its buffer by `self.world_size` (so that the sum over
           ranks is the average), say what is sent (`bucket.sent = bucket.buffer`: the check
           uses no `reduce_dtype`), and launch its all-reduce *asynchronously*, keeping the
           handle: `bucket.handle = comm.all_reduce(bucket.sent, group=self.group,
           async_op=True)`. Do not wait for it here: backward goes on while it travels.
        6. When this was the last gradient of the backward (`self.count.add(param)` returns
           True, and counts it), call `self._finish()`: it waits for every handle.

        (Optional: minidist also records the order gradients arrive in, `self.order_seen`, to
        re-pack the buckets once in that order. The check does not need it.)

        The usual mistakes, each of which the check names: launching before the bucket is full
        (an off-by-one on `pending`: a gradient misses the all-reduce), forgetting to divide
        (gradients N times too large), launching every bucket only at the end of backward (right
        numbers, no overlap: that is the naive DDP), copying the gradient after the launch.
        """
        raise NotImplementedError("BucketedDDP._on_grad_ready is yours to write (its docstring says how)")
