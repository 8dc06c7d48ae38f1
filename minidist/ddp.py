"""Data parallelism (DDP) by hand: every rank holds the whole model and sees a different batch.

The recipe has three parts:

1. **Start equal.** When the model is wrapped, rank 0's parameters and buffers are broadcast to
   every rank. Ranks may have initialised (or loaded) different weights; after wrapping they
   hold the same ones.
2. **Stay equal.** Each rank runs forward and backward on its own micro-batch, so each has a
   different gradient. Before the optimizer step, every gradient is all-reduced and divided by
   N: all ranks then hold the gradient of the whole global batch, and the same optimizer step
   keeps their weights identical. No weights are ever sent again.
3. **Accumulate without talking.** With gradient accumulation, the micro-batches before the
   last one only add into ``param.grad``; inside ``no_sync()`` nothing is sent, and the last
   micro-batch's backward all-reduces the sum once. Communication per optimizer step is
   2·P·(N-1)/N elements per rank (see ``comm.py``), however many micro-batches there are.

``NaiveDDP`` does step 2 in the plainest way: once the backward is over, one all-reduce per
parameter, one after the other. The network sits idle during the whole backward pass, and a
model of hundreds of small tensors pays the start-up cost of a collective hundreds of times.

``BucketedDDP`` does what PyTorch's ``DistributedDataParallel`` does (Li et al. 2020, "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB): gradients are packed
into buckets of about 25 MB, in the order backward produces them (the last layer's first). A
hook on each parameter copies its gradient into its bucket as soon as autograd has accumulated
it; when a bucket is full its all-reduce is launched *asynchronously*, while backward goes on
computing the earlier layers' gradients. Communication hides behind computation, and a few large
messages replace many small ones. Before the optimizer step every bucket is waited for.

Both find out that backward is over the same way: a counter of parameters whose gradient is
ready. That is why every trainable parameter must get a gradient in every backward (PyTorch's
default, ``find_unused_parameters=False``); a parameter left out is reported by name at the next
forward. Frozen parameters (``requires_grad=False``) are simply not part of any bucket, and a
tied weight (the embedding shared with the output layer) is one parameter with one gradient,
summed by autograd over both uses before the hook sees it, so it is reduced once.
"""

import time
from contextlib import contextmanager

import torch
from torch import nn

from minidist import comm


class NaiveDDP(nn.Module):
    """DDP at its simplest: broadcast once; after backward, all-reduce each gradient in turn."""

    def __init__(self, module: nn.Module, process_group=None, reduce_dtype: torch.dtype | None = None):
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.reduce_dtype = reduce_dtype  # None: the gradients' own dtype (see precision.py)
        self.world_size = torch.distributed.get_world_size(process_group)
        self.require_sync = True
        # Trainable parameters in reverse order of registration: roughly the order in which
        # backward produces their gradients (output layer first, embedding last).
        self.params = [p for p in module.parameters() if p.requires_grad][::-1]
        self._ready: set[int] = set()
        self._broadcast_from_rank_0()
        for index, param in enumerate(self.params):
            # Runs after autograd has added this backward's gradient into param.grad.
            param.register_post_accumulate_grad_hook(lambda p, i=index: self._on_grad_ready(i))

    def _broadcast_from_rank_0(self) -> None:
        src = torch.distributed.get_global_rank(self.process_group, 0) if self.process_group else 0
        with torch.no_grad():
            for tensor in [*self.module.parameters(), *self.module.buffers()]:
                comm.broadcast(tensor.data, src=src, group=self.process_group)

    def forward(self, *args, **kwargs):
        if self._ready:  # the last synced backward stopped short of some parameters
            ready = {id(self.params[i]) for i in self._ready}
            missing = [name for name, p in self.module.named_parameters() if p.requires_grad and id(p) not in ready]
            raise RuntimeError(f"DDP: the last backward gave no gradient to {missing[:3]}; every trainable "
                               "parameter must be used in the loss (freeze the others with requires_grad=False)")
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate into ``param.grad``; nothing is sent."""
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True

    def _on_grad_ready(self, index: int) -> None:
        if not self.require_sync:
            return
        self._ready.add(index)
        if len(self._ready) == len(self.params):  # the backward is over: every gradient is in
            self._ready.clear()
            self._all_reduce_gradients()

    def _all_reduce_gradients(self) -> None:
        for param in self.params:
            grad = param.grad.to(self.reduce_dtype or param.grad.dtype)  # a copy only for another dtype
            comm.all_reduce(grad, group=self.process_group)
            param.grad.copy_(grad.div_(self.world_size))  # the sum over ranks -> the average


class Bucket:
    """One flat buffer holding the gradients of several parameters, reduced in one call."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.offsets = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        self.buffer = torch.zeros(offset, dtype=params[0].dtype, device=params[0].device)
        self.pending = len(params)  # gradients still to arrive in this backward
        self.handle = None  # the asynchronous all-reduce, once launched
        self.sent = None  # what it reduces: the buffer, or its copy in the reduction's dtype

    def views(self):
        """(param, the slice of the buffer that holds its gradient), for each parameter."""
        for p, offset in zip(self.params, self.offsets):
            yield p, self.buffer[offset:offset + p.numel()].view_as(p)


class BucketedDDP(NaiveDDP):
    """DDP with gradient buckets whose all-reduces overlap the rest of the backward pass."""

    def __init__(self, module: nn.Module, process_group=None, bucket_cap_mb: float = 25.0,
                 reduce_dtype: torch.dtype | None = None):
        super().__init__(module, process_group, reduce_dtype)
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self.buckets = self._make_buckets(self.params)
        self.order_seen: list[int] = []  # the order gradients really became ready, first backward
        self.timeline: list[tuple[str, int, float]] = []  # (event, bucket, time): for the lesson's plot
        self._rebuilt = False

    def _make_buckets(self, params: list[nn.Parameter]) -> list[Bucket]:
        buckets, current, size = [], [], 0
        for p in params:
            # Start a new bucket when this gradient would overflow it, or changes dtype or device.
            if current and (size + p.numel() * p.element_size() > self.bucket_cap_bytes
                            or p.dtype != current[0].dtype or p.device != current[0].device):
                buckets.append(Bucket(current))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            buckets.append(Bucket(current))
        self._bucket_of = {id(p): (b, i) for b, bucket in enumerate(buckets) for i, p in enumerate(bucket.params)}
        return buckets

    def _on_grad_ready(self, index: int) -> None:
        if not self.require_sync:
            return
        param = self.params[index]
        if len(self.order_seen) < len(self.params):
            self.order_seen.append(index)
        b, i = self._bucket_of[id(param)]
        bucket = self.buckets[b]
        bucket.buffer[bucket.offsets[i]:bucket.offsets[i] + param.numel()].copy_(param.grad.view(-1))
        bucket.pending -= 1
        if bucket.pending == 0:  # full: send it now, while backward computes earlier layers
            bucket.buffer.div_(self.world_size)  # average before summing, as PyTorch does
            bucket.sent = bucket.buffer.to(self.reduce_dtype or bucket.buffer.dtype)  # the buffer itself, or a cast
            bucket.handle = comm.all_reduce(bucket.sent, group=self.process_group, async_op=True)
            self.timeline.append(("launch", b, time.perf_counter()))
        self._ready.add(index)
        if len(self._ready) == len(self.params):
            self._ready.clear()
            self._finish()

    def _finish(self) -> None:
        """Wait for every bucket, copy the averaged gradients back into ``param.grad``."""
        for b, bucket in enumerate(self.buckets):
            bucket.handle.wait()
            if bucket.sent is not bucket.buffer:
                bucket.buffer.copy_(bucket.sent)  # back from the reduction's dtype
            # When this wait returned: the all-reduce may have finished long before (lesson 02's
            # notebook times the finish itself through the work's future).
            self.timeline.append(("waited", b, time.perf_counter()))
            for param, reduced in bucket.views():
                # The averaged gradient becomes param.grad as a view of the bucket, not a copy
                # (PyTorch's gradient_as_bucket_view): one pass over the memory less.
                param.grad = reduced
            bucket.handle, bucket.sent, bucket.pending = None, None, len(bucket.params)
        # Like PyTorch's DDP, re-pack the buckets once in the order the first backward really
        # produced the gradients, so that every bucket fills as early as it can.
        if len(self.order_seen) == len(self.params) and not self._rebuilt:
            self._rebuilt = True
            if self.order_seen != sorted(self.order_seen):
                self.buckets = self._make_buckets([self.params[i] for i in self.order_seen])
