"""ZeRO-1 and ZeRO-2 by hand: stop replicating what each rank does not need.

DDP keeps everything on every rank. With AdamW and mixed precision that is 16 bytes per
parameter: 2 for the bf16 weight, 2 for its gradient, 12 for the fp32 master weight and the two
Adam moments. But after the gradients are averaged, all N ranks run the *same* optimizer step on
the *same* numbers. ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", SC20) splits that work: rank r updates only shard r of the
parameters, so it needs the optimizer states of shard r only.

**Flat shards.** The trainable parameters are packed, in the order backward produces their
gradients, into buckets of about `bucket_cap_mb`. Each bucket is a `FlatParameter`: one flat
buffer, padded to a multiple of N and cut into N equal shards; rank r owns shard r of every
bucket (its fp32 master weights and Adam moments, `master`).

**A ZeRO-1 step** (stage 1, optimizer states sharded):
1. forward and backward as in DDP; every rank's gradients land in flat gradient buffers (each
   `param.grad` is a view of one), so every rank holds the whole local gradient;
2. when backward is over, each bucket is *reduce-scattered*: rank r receives the sum over ranks
   of shard r. An all-reduce is a reduce-scatter followed by an all-gather (`comm.py`); rank r
   only needs its own shard of the sum, so it stops halfway;
3. rank r steps AdamW on its shard: fp32 master += update;
4. the updated shards are *all-gathered* into every rank's parameters: the second half of the
   all-reduce, done on weights instead of gradients.
Bytes per rank per step: P(N-1)/N for the reduce-scatter + P(N-1)/N for the all-gather =
2P(N-1)/N elements, exactly what DDP's all-reduce sends. Sharding the optimizer is free.

**ZeRO-2** (stage 2, gradients sharded too) does the same with one change: a bucket is
reduce-scattered as soon as backward has filled it (from gradient hooks, while backward goes on,
as the bucketed DDP does), and its full gradient is then dropped. A rank keeps only the gradient
of its shard. Same bytes on the wire, less memory, communication overlapped with backward.

**Memory per rank**, P parameters, N ranks (padding aside), AdamW:

    mixed precision (bf16 weights and gradients, fp32 master, m, v)    fp32 (the weights are the masters)
    DDP     2P + 2P + 12P   = 16P                                       4P + 4P + 8P   = 16P
    ZeRO-1  2P + 2P + 12P/N = 4P + 12P/N                                4P + 4P + 8P/N = 8P + 8P/N
    ZeRO-2  2P + 2P/N + 12P/N = 2P + 14P/N                              4P + 4P/N + 8P/N = 4P + 12P/N

In fp32 the master *is* the shard of the model's own flat buffer (a view, no copy). In bf16 the
gradients are summed in `reduce_dtype` (fp32 by default: the bucket is cast for the collective)
and the sum is kept in the gradient's own dtype, bf16; the optimizer gets an fp32 copy of its
shard's gradient for the step only. With gradient accumulation, `no_sync()` micro-batches add
into the local gradients without communication; ZeRO-2 then holds full gradients until the last
micro-batch, as PyTorch's FSDP does with `set_requires_gradient_sync(False)`.

`FlatParameter` is reused by `fsdp.py`, which shards the parameters themselves (ZeRO-3).
"""

import math
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from minidist import comm
from minidist.precision import MixedPrecision, for_reduction


class FlatParameter:
    """Where each of several parameters sits in one flat buffer, padded and cut into N shards.

    Rank r owns elements [r*S, (r+1)*S) of the padded buffer, S = shard_numel. The padding
    (fewer than N zeros at the end) lets every shard have the same size, which the collectives
    need."""

    def __init__(self, params: list[torch.Tensor], world_size: int, rank: int):
        self.shapes = [p.shape for p in params]
        self.offsets, offset = [], 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        self.numel = offset
        self.shard_numel = math.ceil(offset / world_size)
        self.padded_numel = self.shard_numel * world_size
        self.shard_slice = slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)

    def flatten(self, tensors, dtype=None) -> torch.Tensor:
        """One padded flat tensor holding `tensors` (in this object's order)."""
        flat = torch.cat([t.detach().reshape(-1).to(dtype or t.dtype) for t in tensors])
        return nn.functional.pad(flat, (0, self.padded_numel - self.numel))

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's slice of `flat`, in its own shape: writing to one writes to `flat`."""
        return [flat[o:o + shape.numel()].view(shape) for o, shape in zip(self.offsets, self.shapes)]


class Bucket:
    """The parameters of one flat buffer and what ZeRO keeps for them on this rank."""

    def __init__(self, params, world_size, rank, mp: MixedPrecision):
        self.params = params
        self.flat = FlatParameter(params, world_size, rank)
        data = self.flat.flatten(params, torch.float32)  # the full fp32 weights, for a moment
        if mp.param_dtype == torch.float32:
            self.weights = data  # the model's parameters become views of it; the master is its shard
            self.master = nn.Parameter(data[self.flat.shard_slice])
        else:
            self.weights = data.to(mp.param_dtype)
            self.master = nn.Parameter(data[self.flat.shard_slice].clone())
        for p, view in zip(params, self.flat.views(self.weights)):
            p.data = view  # the same Parameter object (hooks, names), its storage now the flat buffer
        self.grad = None  # ZeRO-1: the full flat gradient; ZeRO-2: the flat gradient of a backward, briefly
        self.grad_shard = None  # ZeRO-2: the summed gradient of this rank's shard, kept
        self.pending = len(params)  # gradients still to come in this backward
        self.handle = None  # ZeRO-2: the asynchronous reduce-scatter, once launched
        self.reduced = None  # its output

    def own_gradient(self) -> torch.Tensor:
        """The summed gradient of this rank's shard, in the gradient's dtype."""
        return self.grad_shard if self.grad_shard is not None else self.grad[self.flat.shard_slice]


class ZeroDP(nn.Module):
    """ZeRO stage 1 or 2 around a model: wrap, then `build_optimizer`, then train as usual."""

    def __init__(self, module: nn.Module, stage: int, mixed_precision: MixedPrecision = MixedPrecision(),
                 bucket_cap_mb: float = 25.0, process_group=None):
        super().__init__()
        if stage not in (1, 2):
            raise ValueError(f"ZeRO stage must be 1 or 2 (stage 3 is FSDP, fsdp.py), got {stage}")
        self.module, self.stage, self.mp, self.group = module, stage, mixed_precision, process_group
        self.world_size, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.require_sync = True
        with torch.no_grad():  # start equal: rank 0's weights everywhere, as in DDP
            src = dist.get_global_rank(process_group, 0) if process_group else 0
            for tensor in [*module.parameters(), *module.buffers()]:
                comm.broadcast(tensor.data, src=src, group=process_group)
        # Reverse registration order: roughly the order backward produces gradients.
        self.params = [p for p in module.parameters() if p.requires_grad][::-1]
        self.buckets = self._make_buckets(self.params, int(bucket_cap_mb * 2**20))
        self._slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        for p in (p for p in module.parameters() if not p.requires_grad):
            p.data = p.data.to(mixed_precision.param_dtype)  # frozen weights: computed with, never updated
        if stage == 1:  # every rank keeps the whole local gradient in flat buffers; param.grad are views
            for bucket in self.buckets:
                bucket.grad = torch.zeros_like(bucket.weights)
                for p, view in zip(bucket.params, bucket.flat.views(bucket.grad)):
                    p.grad = view  # autograd adds into an existing .grad in place
        self._ready = 0
        self._in_flight: list[Bucket] = []  # ZeRO-2: the bucket whose reduce-scatter is on the wire
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _make_buckets(self, params, cap_bytes) -> list[Bucket]:
        buckets, current, size = [], [], 0
        for p in params:
            if current and size + p.numel() * p.element_size() > cap_bytes:
                buckets.append(Bucket(current, self.world_size, self.rank, self.mp))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            buckets.append(Bucket(current, self.world_size, self.rank, self.mp))
        return buckets

    def forward(self, *args, **kwargs):
        if self._ready:
            raise RuntimeError(f"ZeRO: the last backward gave gradients to only {self._ready} of {len(self.params)} "
                               "trainable parameters; every one must be used (freeze the others)")
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate local gradients; nothing is sent."""
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True

    # ------------------------------------------------------------------ backward: reduce-scatter
    def _on_grad_ready(self, param) -> None:
        if not self.require_sync:
            return  # accumulation: the gradient stays local, in param.grad
        bucket, i = self._slot[id(param)]
        if self.stage == 2:  # copy into the bucket's flat buffer, in the dtype of the reduction
            if bucket.grad is None:
                bucket.grad = torch.zeros(bucket.flat.padded_numel, dtype=self.mp.reduce_dtype, device=param.device)
            offset = bucket.flat.offsets[i]
            bucket.grad[offset:offset + param.numel()].copy_(param.grad.view(-1))
            param.grad = None  # the full gradient of this parameter is gone
        bucket.pending -= 1
        if self.stage == 2 and bucket.pending == 0:  # full: send it now, while backward goes on
            for earlier in self._in_flight:  # at most two flat gradients alive: the one filling, the one sent
                self._keep_shard(earlier)
            bucket.reduced = torch.empty(bucket.flat.shard_numel, dtype=self.mp.reduce_dtype, device=param.device)
            bucket.handle = comm.reduce_scatter(bucket.reduced, bucket.grad, group=self.group, async_op=True)
            self._in_flight = [bucket]
        self._ready += 1
        if self._ready == len(self.params):  # backward is over
            self._ready = 0
            self._finish_reduction()

    def _finish_reduction(self) -> None:
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            if self.stage == 1:  # once backward is over, one bucket after the other
                reduced = torch.empty(bucket.flat.shard_numel, dtype=self.mp.reduce_dtype, device=bucket.grad.device)
                comm.reduce_scatter(reduced, for_reduction(bucket.grad, self.mp), group=self.group)
                bucket.grad[bucket.flat.shard_slice].copy_(reduced.div_(self.world_size))  # sum -> average
        for bucket in self._in_flight:
            self._keep_shard(bucket)
        self._in_flight = []

    def _keep_shard(self, bucket: Bucket) -> None:
        """ZeRO-2: wait for a bucket's reduce-scatter, keep its shard (averaged), drop the rest."""
        bucket.handle.wait()
        if bucket.grad_shard is None:
            bucket.grad_shard = torch.empty(bucket.flat.shard_numel, dtype=self.mp.param_dtype,
                                            device=bucket.reduced.device)
        bucket.grad_shard.copy_(bucket.reduced.div_(self.world_size))
        bucket.grad = bucket.reduced = bucket.handle = None  # only the shard's gradient stays

    # ------------------------------------------------------------------ the optimizer step on shards
    def build_optimizer(self, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
        """AdamW over this rank's fp32 master shards, with hooks that feed it and spread its result."""
        optimizer = torch.optim.AdamW([b.master for b in self.buckets], lr=lr, betas=(0.9, 0.95),
                                      weight_decay=weight_decay)
        optimizer.register_step_pre_hook(lambda *_: self._before_step())
        optimizer.register_step_post_hook(lambda *_: self._after_step())
        return optimizer

    def _before_step(self) -> None:
        for bucket in self.buckets:  # fp32 for the update (a view when the gradient already is)
            bucket.master.grad = bucket.own_gradient().to(torch.float32)

    @torch.no_grad()
    def _after_step(self) -> None:
        for bucket in self.buckets:
            bucket.master.grad = None
            if self.stage == 1:
                bucket.grad.zero_()  # ready for the next step's accumulation
            else:
                bucket.grad_shard.zero_()
        self.refresh_weights()

    @torch.no_grad()
    def refresh_weights(self) -> None:
        """Every rank's weights from the masters: after a step, or after loading a checkpoint."""
        for bucket in self.buckets:
            mine = bucket.weights[bucket.flat.shard_slice]
            if mine.data_ptr() != bucket.master.data_ptr():
                mine.copy_(bucket.master)  # bf16: the updated master, rounded, into the model's weights
            comm.all_gather(bucket.weights, mine.clone(), group=self.group)  # everyone's updated shards

    def clip_grad_norm_(self, max_norm: float) -> float:
        return clip_sharded_grad_norm_([b.own_gradient() for b in self.buckets], max_norm, self.group)

    def gradient_shards(self) -> list[torch.Tensor]:
        """Gradients kept outside `param.grad` (ZeRO-2's shards), for `memory_measure`."""
        return [b.grad_shard for b in self.buckets if b.grad_shard is not None]

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The fp32 weights by name, gathered from the masters (every rank calls it; all get them)."""
        full = {}
        for bucket in self.buckets:
            full.update(zip(map(id, bucket.params), gathered_parameters(bucket.flat, bucket.master, self.group)))
        return {name: full.get(id(p), p.detach().float()) for name, p in
                self.module.named_parameters(remove_duplicate=False)}


def clip_sharded_grad_norm_(shards: list[torch.Tensor], max_norm: float, group=None) -> float:
    """Clip by the norm of the whole gradient when each rank holds a shard of it: each rank sums
    the squares of its own elements (padding is zero), one all-reduce of one number adds them up."""
    total = torch.stack([g.float().pow(2).sum() for g in shards]).sum()
    dist.all_reduce(total, group=group)  # a single number: not counted in comm_bytes
    norm = total.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # the same formula as torch's clip_grad_norm_
    for g in shards:
        g.mul_(scale.to(g.dtype))
    return float(norm)


@torch.no_grad()
def gathered_parameters(flat: FlatParameter, shard: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's fp32 `shard` of `flat` all-gathered: the full parameters, one view each.

    For saving and checking, not for training steps, so it is not counted in comm_bytes."""
    gathered = torch.empty(flat.padded_numel, dtype=torch.float32, device=shard.device)
    dist.all_gather_into_tensor(gathered, shard.detach().float().contiguous(), group=group)
    return flat.views(gathered)
