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

Both find out that backward is over the same way: a count of parameters whose gradient is
ready (``wrapper.GradientCount``). That is why every trainable parameter must get a gradient in
every backward (PyTorch's default, ``find_unused_parameters=False``); a parameter left out is
reported by name at the next forward. Frozen parameters (``requires_grad=False``) are simply
not part of any bucket, and a tied weight (the embedding shared with the output layer) is one
parameter with one gradient, summed by autograd over both uses before the hook sees it, so it
is reduced once. The broadcast, ``no_sync``, the bucket packing and the count are
``wrapper.py``'s, shared with ZeRO and FSDP.
"""

import torch
from torch import nn

from minidist.parallel import comm
from minidist.parallel.wrapper import DataParallelWrapper, GradientCount, pack_buckets, weak_hook


class NaiveDDP(DataParallelWrapper):
    """DDP at its simplest: broadcast once; after backward, all-reduce each gradient in turn."""

    def __init__(self, module: nn.Module, process_group=None, reduce_dtype: torch.dtype | None = None):
        super().__init__(module, process_group)
        self.reduce_dtype = reduce_dtype  # None: the gradients' own dtype (see precision.py)
        # Trainable parameters in reverse order of registration: roughly the order in which
        # backward produces their gradients (output layer first, embedding last).
        self.params = [p for p in module.parameters() if p.requires_grad][::-1]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.count = GradientCount(module, self.params, "DDP")
        self.broadcast_from_first_rank([*module.parameters(), *module.buffers()])
        for param in self.params:
            # Runs after autograd has added this backward's gradient into param.grad.
            param.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready))

    def forward(self, *args, **kwargs):
        self.count.check_complete()
        return self.module(*args, **kwargs)

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if self.require_sync and self.count.add(param):  # the last gradient of the backward
            self._all_reduce_gradients()

    def _all_reduce_gradients(self) -> None:
        for param in self.params:
            grad = param.grad.to(self.reduce_dtype or param.grad.dtype)  # a copy only for another dtype
            comm.all_reduce(grad, group=self.group)
            param.grad.copy_(grad.div_(self.world_size))  # the sum over ranks -> the average


class GradientBucket:
    """One flat buffer holding the gradients of several parameters, all-reduced in one call."""

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
        self._rebuilt = False

    def _make_buckets(self, params: list[nn.Parameter]) -> list[GradientBucket]:
        buckets = [GradientBucket(run) for run in pack_buckets(params, self.bucket_cap_bytes)]
        self._bucket_of = {id(p): (b, i) for b, bucket in enumerate(buckets) for i, p in enumerate(bucket.params)}
        return buckets

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.require_sync:
            return
        if len(self.order_seen) < len(self.params):
            self.order_seen.append(self.index[id(param)])
        b, i = self._bucket_of[id(param)]
        bucket = self.buckets[b]
        bucket.buffer[bucket.offsets[i]:bucket.offsets[i] + param.numel()].copy_(param.grad.view(-1))
        bucket.pending -= 1
        if bucket.pending == 0:  # full: send it now, while backward computes earlier layers
            bucket.buffer.div_(self.world_size)  # average before summing, as PyTorch does
            bucket.sent = bucket.buffer.to(self.reduce_dtype or bucket.buffer.dtype)  # the buffer itself, or a cast
            bucket.handle = comm.all_reduce(bucket.sent, group=self.group, async_op=True)
        if self.count.add(param):
            self._finish()

    def _finish(self) -> None:
        """Wait for every bucket; each ``param.grad`` becomes a view of its averaged slice."""
        for bucket in self.buckets:
            bucket.handle.wait()
            if bucket.sent is not bucket.buffer:
                bucket.buffer.copy_(bucket.sent)  # back from the reduction's dtype
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
