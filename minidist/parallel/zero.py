"""ZeRO-1 and ZeRO-2 by hand: stop replicating what each rank does not need.

DDP keeps everything on every rank. With AdamW and mixed precision that is 16 bytes per
parameter: 2 for the bf16 weight, 2 for its gradient, 12 for the fp32 master weight and the two
Adam moments. But after the gradients are averaged, all N ranks run the *same* optimizer step on
the *same* numbers. ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", SC20) splits that work: rank r updates only shard r of the
parameters, so it needs the optimizer states of shard r only.

**Flat shards.** The trainable parameters are packed, in the order backward produces their
gradients, into buckets of about `bucket_cap_mb` (`FlatBucket`). Each bucket is one flat buffer
laid out by a `flat.FlatLayout`: padded to a multiple of N and cut into N equal shards; rank r
owns shard r of every bucket (its fp32 master weights and Adam moments, `master`).

**ZeRO-1 is an optimizer change.** Steps 3 and 4 below need nothing from the model:
`ShardedOptimizer(params, torch.optim.AdamW, lr=...)` wraps any `torch.optim` class, as PyTorch's
`ZeroRedundancyOptimizer` does, and can follow any way of averaging the gradients (plain DDP, or
one process). `ZeroDP` adds what ZeRO-1 and ZeRO-2 do in backward (steps 1 and 2) and hands
its buckets to the same optimizer.

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
of its shard, until `zero_grad` lets it go as it would a `param.grad`. Same bytes on the wire, less
memory, communication overlapped with backward.

**Memory per rank**, P parameters, N ranks (padding aside), AdamW:

    mixed precision (bf16 weights and gradients, fp32 master, m, v)    fp32 (the weights are the masters)
    DDP     2P + 2P + 12P   = 16P                                       4P + 4P + 8P   = 16P
    ZeRO-1  2P + 2P + 12P/N = 4P + 12P/N                                4P + 4P + 8P/N = 8P + 8P/N
    ZeRO-2  2P + 2P/N + 12P/N = 2P + 14P/N                              4P + 4P/N + 8P/N = 4P + 12P/N

In fp32 the master *is* the shard of the model's own flat buffer (a view, no copy). In bf16 the
gradients are summed in `reduce_dtype` (fp32 by default: the bucket is cast for the collective)
and the sum is kept in the gradient's own dtype, bf16; the optimizer gets an fp32 copy of its
shard's gradient for the step only, a few buckets at a time. With gradient accumulation,
`no_sync()` micro-batches add into the local gradients without communication; ZeRO-2 then holds
full gradients until the last micro-batch, as PyTorch's FSDP does with
`set_requires_gradient_sync(False)`. `--accumulate_sharded` chooses the other way (as DeepSpeed's
ZeRO-2 does): every micro-batch is reduce-scattered, bucket by bucket as above, and its shard added
into `grad_shard`, kept in the reduction's dtype: 4P/N bytes of gradients instead of full ones
(2P in bf16, 4P in fp32), for k reduce-scatters a step instead of one, (k + 1)P(N-1)/N elements
sent with the all-gather (`strategy.Strategy.no_sync`).

`--cpu_offload` keeps the masters, their Adam moments and the step on the host (`offload.py`).

`flat.py`'s layout is shared with `fsdp.py`, which shards the parameters themselves (ZeRO-3).
"""

import copy

import torch
import torch.distributed as dist
from torch import nn

from minidist.parallel import comm, offload
from minidist.parallel.flat import Flat, FlatLayout, clip_sharded_grad_norm_, gather_flat, gather_parameters
from minidist.parallel.precision import MixedPrecision, for_reduction
from minidist.parallel.wrapper import DataParallelWrapper, GradientCount, pack_buckets, weak_hook


class FlatBucket:
    """The parameters of one flat buffer and what ZeRO keeps for them on this rank."""

    def __init__(self, params, world_size: int, rank: int, param_dtype: torch.dtype, host: bool = False):
        self.params, self.host = params, host
        self.layout = FlatLayout(params, world_size, rank)
        data = self.layout.flatten(params, torch.float32)  # the full fp32 weights, for a moment
        if param_dtype == torch.float32 and not host:
            self.weights = data  # the model's parameters become views of it; the master is its shard
            self.master = nn.Parameter(data[self.layout.shard_slice])
        else:  # a copy; host (--cpu_offload): in host memory, stepped there (offload.py)
            self.weights, shard = data.to(param_dtype), data[self.layout.shard_slice]
            self.master = nn.Parameter(offload.to_host(shard) if host else shard.clone())
        for p, view in zip(params, self.layout.views(self.weights)):
            p.data = view  # the same Parameter object (hooks, names), its storage now the flat buffer
        self.grad = None  # ZeRO-1: the full flat gradient; ZeRO-2: the flat gradient of a backward, briefly
        self.grad_shard = None  # ZeRO-2: the summed gradient of this rank's shard, from its reduce-scatter to zero_grad
        self.pending = len(params)  # gradients still to come in this backward
        self.waiting = []  # ZeRO-2: indices of params whose gradient came, not yet copied into `grad`
        self.handle = None  # ZeRO-2: the asynchronous reduce-scatter, once launched
        self.reduced = None  # its output

    def own_gradient(self) -> torch.Tensor:
        """The summed gradient of this rank's shard, in the gradient's dtype."""
        if self.grad_shard is not None:  # ZeRO-2
            return self.grad_shard
        if self.grad is not None:  # ZeRO-1: the reduce-scatter wrote it into the flat gradient
            return self.grad[self.layout.shard_slice]
        # ShardedOptimizer alone: the parameters' own (already averaged) gradients, our slice of them
        out = torch.zeros(self.layout.shard_numel, dtype=self.weights.dtype, device=self.weights.device)
        start, stop = self.layout.shard_slice.start, self.layout.shard_slice.stop
        for p, offset in zip(self.params, self.layout.offsets):
            lo, hi = max(offset, start), min(offset + p.numel(), stop)
            if lo < hi and p.grad is not None:
                out[lo - start:hi - start] = p.grad.reshape(-1)[lo - offset:hi - offset]
        return out

    def master_gradient(self) -> torch.Tensor:
        """The fp32 gradient of this rank's shard, on the master's side. Host masters (--cpu_offload)
        get it over PCIe in the gradient's dtype (bf16: half the bytes), cast on the CPU, unless
        it already is there (ZeRO-2's shard, copied out when it was reduced: `offload.py`)."""
        grad = self.own_gradient()
        if self.host and self.grad_shard is None:
            grad = offload.to_host(grad)
        return grad.to(torch.float32)  # a view where it already is fp32

    def zero_grad(self, set_to_none: bool) -> None:
        if self.grad is not None:  # ZeRO-1: each param.grad is a view of it, kept for the next step
            self.grad.zero_()
        elif set_to_none:
            for p in self.params:
                p.grad = None
        if self.grad_shard is not None:  # ZeRO-2: the next reduce-scatter makes it again
            if set_to_none:
                self.grad_shard = None
            else:
                self.grad_shard.zero_()

    @torch.no_grad()
    def refresh_weights(self, group) -> None:
        """Every rank's weights from the masters: after a step, or after loading a checkpoint.
        Host masters (--cpu_offload) are cast on the host and sent in the weights' dtype without
        blocking (`offload.to_device`: bf16, 2 bytes per parameter over PCIe); the copy is queued
        on the current stream, and the clone and all-gather below, ordered after it there, read
        the shard once it has landed."""
        mine = self.weights[self.layout.shard_slice]
        if self.host:
            offload.to_device(mine, self.master)
        elif mine.data_ptr() != self.master.data_ptr():
            mine.copy_(self.master)  # bf16: the updated master, rounded, into the model's weights
        comm.all_gather(self.weights, mine.clone(), group=group)  # everyone's updated shards


STEP_BYTES = 256 * 2**20  # fp32 masters stepped per call of the inner optimizer (one larger bucket alone)


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1: any `torch.optim` optimizer, each rank stepping only its shard of the parameters.

        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        optimizer = ShardedOptimizer([{"params": matrices, "weight_decay": 0.1},
                                      {"params": norms_and_biases, "weight_decay": 0.0}],
                                     torch.optim.AdamW, lr=1e-3)

    A drop-in for the optimizer it wraps, as PyTorch's `ZeroRedundancyOptimizer` is: parameters or
    groups of them (dicts with options of their own), frozen parameters among them (left alone),
    `add_param_group`, `step(closure, **kwargs)`, `zero_grad`, and a `state_dict()` in the
    wrapped optimizer's own form.

    Each group's parameters are packed into flat buckets of their own (their storage becomes the
    buckets'), the frozen ones too: while frozen they have no gradient and are left alone, and once
    unfrozen they are stepped, as `torch.optim` steps any parameter with a gradient. Rank r keeps an fp32 master of shard r of each bucket, and optimizer
    states for those masters only. `self.optimizer`, an `optimizer_class` over the masters with
    one group per group given, does the arithmetic. `step` gives each master the gradient of its
    shard (the parameters' gradients must already be averaged over the ranks, as after DDP;
    `ZeroDP` reduce-scatters them itself), steps the masters, and all-gathers the updated shards
    into every rank's parameters. `param_groups` and `state` are the inner optimizer's, so
    learning-rate schedulers and the loop's checkpoints (`flat_state.py`) see the masters.

    **A parameter without a gradient is not stepped**, as in `torch.optim`, where momentum, Adam's
    moments and weight decay would otherwise keep moving it. A bucket none of whose parameters has
    a gradient gives its master none, and the inner optimizer skips it. In a bucket where some
    have one, the slices of the others, in the master and in its states, are put back after the
    step. What they cannot keep apart is a count per tensor, such as Adam's `step` (its bias
    correction): a parameter that sits out steps its bucket takes counts them too.
    `bucket_cap_mb=0` gives every parameter a bucket of its own, and exact counts.

    **State dicts** are keyed as the wrapped optimizer's: by each parameter's index, counted over
    the groups in order, each state in its parameter's shape. As no rank holds them all,
    `consolidate_state_dict(to)`, called on every rank, all-gathers them, rank `to` keeps them in
    host memory, and its `state_dict()` returns them (until the next step). `load_state_dict`
    takes that form, from this optimizer or from the wrapped one itself: each rank keeps its shard."""

    def __init__(self, params, optimizer_class=torch.optim.AdamW, process_group=None, bucket_cap_mb: float = 25.0,
                 **defaults):
        if isinstance(params, torch.Tensor):  # list() would take its rows for parameters; torch.optim refuses it too
            raise TypeError(f"params argument given to ShardedOptimizer should be an iterable of Tensors or dicts, "
                            f"but got {torch.typename(params)}")
        params = list(params)
        self.optimizer_class, self.group, self.bucket_cap_mb = optimizer_class, process_group, bucket_cap_mb
        self.world_size, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.buckets, self.optimizer = [], None
        self._user_params = []  # the parameters given, group by group (frozen ones too): what state dicts count
        self._laid_out = None  # ZeroDP's buckets, for the first group
        self._not_stepped = set()  # ids of parameters with no state of their own in torch.optim (their bucket has one)
        self._consolidated = None  # consolidate_state_dict's, on rank `to`: the states by parameter id
        if params and isinstance(params[0], FlatBucket):  # ZeroDP's buckets, already laid out
            self._laid_out, params = params, [p for b in params for p in b.params]
        super().__init__(params, defaults)  # checks `params` and adds each group (add_param_group below)
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state  # one set, shared
        self.defaults = self.optimizer.defaults

    def add_param_group(self, param_group: dict) -> None:
        """Add a group of parameters, with options of its own: its parameters (frozen ones too) are sharded
        into new buckets (one group's options step a bucket), their masters a new group of the
        inner optimizer, which fills in its defaults as it would for the parameters themselves."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        given = {id(p) for group in self._user_params for p in group}
        if any(id(p) in given for p in params) or len({id(p) for p in params}) < len(params):
            raise ValueError("some parameters appear twice in ShardedOptimizer's groups; give each parameter once")
        if self._laid_out is not None:
            buckets, self._laid_out = self._laid_out, None
        else:
            trainable = params  # frozen ones too: torch.optim steps a parameter whenever it has a gradient
            with torch.no_grad():
                buckets = [FlatBucket(run, self.world_size, self.rank, run[0].dtype)
                           for run in pack_buckets(trainable, int(self.bucket_cap_mb * 2**20))]
        masters = {**{k: v for k, v in param_group.items() if k != "params"}, "params": [b.master for b in buckets]}
        if self.optimizer is None:  # the first group: the inner optimizer, with the options given
            self.optimizer = self.optimizer_class([masters], **self.defaults)
        else:
            self.optimizer.add_param_group(masters)
        self.buckets += buckets
        self._user_params.append(params)

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """A few buckets at a time (`STEP_BYTES` of masters): give each master the fp32 gradient of
        its shard, step, put back the slices of parameters without a gradient, all-gather.
        `kwargs` go to the inner optimizer's `step`. The inner optimizer skips masters without a
        gradient, so what a step allocates besides the states (the fp32 copy of a bf16 gradient,
        the multi-tensor AdamW's temporaries) is one group's, not the whole shard's; and the groups
        are few (27 for CodeLlama-7b's 258 buckets on 4 ranks), so the optimizer's per-call work
        stays small."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._consolidated = None  # the states move: a state_dict() needs a new consolidate_state_dict()
        of_master = {id(b.master): b for b in self.buckets}
        for masters in pack_buckets([b.master for b in self.buckets], STEP_BYTES):
            group = [of_master[id(m)] for m in masters]
            kept = [self._give_gradient(bucket) for bucket in group]
            self.optimizer.step(**kwargs)
            for bucket, still in zip(group, kept):
                _put_back(bucket, still, self.optimizer.state.get(bucket.master, {}))
                bucket.master.grad = None
                bucket.refresh_weights(self.group)
        return loss

    def _give_gradient(self, bucket: FlatBucket) -> list:
        """Set the master's gradient: its shard's, or None where no parameter of the bucket has one.
        Returns what the step must leave as it is: for each slice of this rank's shard that belongs
        to a parameter without a gradient, its master and states, as they are now."""
        without = [p for p in bucket.params if not _has_gradient(bucket, p)]
        if len(without) == len(bucket.params):
            bucket.master.grad = None
            return []
        state = self.optimizer.state.get(bucket.master, {})
        for p in bucket.params:  # torch.optim gives a parameter a state at its first step with a gradient
            if all(p is not q for q in without):
                self._not_stepped.discard(id(p))
            elif not state:
                self._not_stepped.add(id(p))
        bucket.master.grad = bucket.master_gradient()
        return [(piece, bucket.master[piece].clone(),
                 {k: v[piece].clone() for k, v in state.items() if _per_element(k, v, bucket.master)})
                for piece in _pieces(bucket, without)]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As `torch.optim`'s: ZeRO-1's flat gradients zeroed (each `param.grad` a view of one),
        ZeRO-2's shards let go of (or zeroed), and alone, the parameters' own gradients."""
        for bucket in self.buckets:
            bucket.zero_grad(set_to_none)
            if bucket.grad is None and not set_to_none:  # the parameters' own gradients, zeroed as torch.optim does
                for p in bucket.params:
                    if p.grad is not None:
                        p.grad.zero_()

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's states onto rank `to` of the group (every rank calls it): each
        master's state all-gathered, one bucket at a time, and cut into its parameters, in their
        shapes, in host memory. `state_dict()` on rank `to` returns them, until the next step."""
        states = {}
        for bucket in self.buckets:
            state = self.optimizer.state.get(bucket.master, {})
            # In sorted order: every rank must all-gather the same state at the same time, and a set's
            # order of strings follows each process's hash seed (ranks started apart have their own).
            cut = sorted(k for k, v in state.items() if _per_element(k, v, bucket.master))
            gathered = {k: gather_flat(bucket.layout, state[k], self.group) for k in cut}  # every rank takes part
            if self.rank != to:
                continue
            whole = {k: gathered[k].to("cpu", v.dtype) if k in cut
                     else v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v for k, v in state.items()}
            for p, offset in zip(bucket.params, bucket.layout.offsets):
                if whole and id(p) not in self._not_stepped:
                    states[id(p)] = {k: v[offset:offset + p.numel()].view(p.shape).clone() if k in cut
                                     else copy.deepcopy(v) for k, v in whole.items()}
        self._consolidated = states if self.rank == to else None

    def state_dict(self) -> dict:
        """The state in the wrapped optimizer's form, as of the last `consolidate_state_dict`."""
        if self._consolidated is None:
            raise RuntimeError(f"ShardedOptimizer.state_dict() on rank {self.rank} has no states: call "
                               f"consolidate_state_dict(to={self.rank}) on every rank first, after the last step")
        index, groups = {}, []
        for group, params in zip(self.param_groups, self._user_params):
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index.setdefault(id(p), len(index)) for p in params]
            groups.append(packed)
        states = sorted((index[i], state) for i, state in self._consolidated.items())
        return {"state": dict(states), "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of the wrapped optimizer's form (this optimizer's, or the wrapped
        optimizer's own, on the same parameters in the same groups): every rank cuts its shard of
        each state from its parameters' states, and the inner optimizer loads those, casting them
        to the masters' dtype and device as it would."""
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(params) for params in self._user_params]:
            raise ValueError(f"this state dict's groups hold {[len(g['params']) for g in saved_groups]} parameters, "
                             f"ShardedOptimizer's {[len(p) for p in self._user_params]}; load one saved from the same "
                             "parameters in the same groups")
        saved = {id(p): state_dict["state"][i] for params, group in zip(self._user_params, saved_groups)
                 for p, i in zip(params, group["params"]) if i in state_dict["state"]}
        index = {id(m): i for i, m in enumerate(m for group in self.param_groups for m in group["params"])}
        inner = {"state": {}, "param_groups": []}
        for group, saved_group in zip(self.param_groups, saved_groups):
            inner["param_groups"].append({**{k: v for k, v in saved_group.items() if k != "params"},
                                          "params": [index[id(m)] for m in group["params"]]})
        for bucket in self.buckets:
            shard = _shard_state(bucket, saved)
            if shard:
                inner["state"][index[id(bucket.master)]] = shard
        self.optimizer.load_state_dict(inner)
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state  # new ones
        self._not_stepped = {id(p) for b in self.buckets if b.master in self.state for p in b.params
                             if id(p) not in saved}
        self._consolidated = None


def _has_gradient(bucket: FlatBucket, param) -> bool:
    if bucket.grad is not None or bucket.grad_shard is not None:
        return True  # ZeroDP's bucket: every parameter's gradient is in its flat gradient
    return param.grad is not None


def _pieces(bucket: FlatBucket, params) -> list[slice]:
    """The slices of this rank's shard of `bucket` (of its master) that belong to `params`."""
    start, stop = bucket.layout.shard_slice.start, bucket.layout.shard_slice.stop
    pieces = []
    for p, offset in zip(bucket.params, bucket.layout.offsets):
        lo, hi = max(offset, start), min(offset + p.numel(), stop)
        if lo < hi and any(p is q for q in params):
            pieces.append(slice(lo - start, hi - start))
    return pieces


def _per_element(key: str, value, like: torch.Tensor) -> bool:
    """Whether a state is one number per element of `like` (Adam's moments, SGD's momentum), and
    so is cut with it, rather than one per tensor (Adam's `step`), shared by the bucket."""
    return torch.is_tensor(value) and value.shape == like.shape and key != "step"


@torch.no_grad()
def _put_back(bucket: FlatBucket, kept: list, state: dict) -> None:
    """Undo the step on the slices of parameters without a gradient. A state the step created
    starts at zero there, as a state of their own will (torch.optim's moments and momentum)."""
    for piece, master, states in kept:
        bucket.master[piece] = master
        for key, value in state.items():
            if _per_element(key, value, bucket.master):
                value[piece] = states[key] if key in states else 0


def _shard_state(bucket: FlatBucket, saved: dict) -> dict:
    """This rank's shard of a bucket's state, cut from its parameters' `saved` states (by id): the
    parameters without one get zeros; a state per tensor is the first parameter's."""
    have = [(p, offset) for p, offset in zip(bucket.params, bucket.layout.offsets) if id(p) in saved]
    if not have:
        return {}
    start, stop = bucket.layout.shard_slice.start, bucket.layout.shard_slice.stop
    shard = {}
    for key, value in saved[id(have[0][0])].items():
        if not _per_element(key, value, have[0][0]):
            shard[key] = value
            continue
        shard[key] = torch.zeros(bucket.layout.shard_numel, dtype=value.dtype, device=value.device)
        for p, offset in have:
            lo, hi = max(offset, start), min(offset + p.numel(), stop)
            if lo < hi:
                shard[key][lo - start:hi - start] = saved[id(p)][key].reshape(-1)[lo - offset:hi - offset]
    return shard


class ZeroDP(DataParallelWrapper):
    """ZeRO stage 1 or 2 around a model: wrap, then `ShardedOptimizer(model.buckets, ...)`, train as usual."""

    def __init__(self, module: nn.Module, stage: int, mixed_precision: MixedPrecision = MixedPrecision(),
                 bucket_cap_mb: float = 25.0, process_group=None, cpu_offload: bool = False,
                 accumulate_sharded: bool = False):
        super().__init__(module, process_group)
        if stage not in (1, 2):
            raise ValueError(f"ZeRO stage must be 1 or 2 (stage 3 is FSDP, fsdp.py), got {stage}")
        self.stage, self.mp, self.cpu_offload = stage, mixed_precision, cpu_offload
        # ZeRO-2 with --accumulate_sharded: every micro-batch reduce-scatters, and its shard is added
        # into `grad_shard`, kept in the reduction's dtype (fp32 by default) so the sum is not rounded
        # to bf16 at every micro-batch.
        self.accumulate_sharded = accumulate_sharded
        self.broadcast_from_first_rank([*module.parameters(), *module.buffers()])  # start equal, as in DDP
        # Reverse registration order: roughly the order backward produces gradients.
        self.params = [p for p in module.parameters() if p.requires_grad][::-1]
        with torch.no_grad():
            self.buckets = [FlatBucket(run, self.world_size, self.rank, mixed_precision.param_dtype, cpu_offload)
                            for run in pack_buckets(self.params, int(bucket_cap_mb * 2**20))]
        self._slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        for p in (p for p in module.parameters() if not p.requires_grad):
            p.data = p.data.to(mixed_precision.param_dtype)  # frozen weights: computed with, never updated
        if stage == 1:  # every rank keeps the whole local gradient in flat buffers; param.grad are views
            for bucket in self.buckets:
                bucket.grad = torch.zeros_like(bucket.weights)
                for p, view in zip(bucket.params, bucket.layout.views(bucket.grad)):
                    p.grad = view  # autograd adds into an existing .grad in place
        self.count = GradientCount(module, self.params, "ZeRO")
        self._in_flight: list[FlatBucket] = []  # ZeRO-2: the bucket whose reduce-scatter is on the wire
        self._open = 0  # ZeRO-2: the bucket gradients are copied into now (the buckets are in backward's order)
        for p in self.params:
            p.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready))

    def forward(self, *args, **kwargs):
        self.count.check_complete()
        return self.module(*args, **kwargs)

    # ------------------------------------------------------------------ backward: reduce-scatter
    def _on_grad_ready(self, param) -> None:
        if not self.require_sync:
            return  # accumulation: the gradient stays local, in param.grad
        bucket, i = self._slot[id(param)]
        bucket.pending -= 1
        if self.stage == 2:
            bucket.waiting.append(i)
            self._fill()
        if self.count.add(param):  # backward is over
            self._finish_reduction()

    def _fill(self) -> None:
        """ZeRO-2: copy the gradients that came into the open bucket, send it once it is full, open
        the next. Backward does not produce gradients exactly in the buckets' order (a Llama
        layer's `input_layernorm` comes after its attention weights, which may sit in the next
        bucket), so one bucket is open at a time: a gradient of a later bucket waits in its
        `param.grad` until that bucket opens. Alive at most: the open bucket, the one on the wire,
        and the few gradients that came early, not a third bucket-sized buffer."""
        while self._open < len(self.buckets) and self.buckets[self._open].waiting:
            bucket = self.buckets[self._open]
            if bucket.grad is None:  # the flat gradient, in the dtype of the reduction; padding stays 0
                bucket.grad = torch.zeros(bucket.layout.padded_numel, dtype=self.mp.reduce_dtype,
                                          device=bucket.weights.device)
            for i in bucket.waiting:
                p, offset = bucket.params[i], bucket.layout.offsets[i]
                bucket.grad[offset:offset + p.numel()].copy_(p.grad.view(-1))
                p.grad = None  # the full gradient of this parameter is gone
            bucket.waiting.clear()
            if bucket.pending:
                return
            for earlier in self._in_flight:  # at most two flat gradients alive: the one filling, the one sent
                self._keep_shard(earlier)
            bucket.reduced = torch.empty(bucket.layout.shard_numel, dtype=self.mp.reduce_dtype, device=bucket.grad.device)
            bucket.handle = comm.reduce_scatter(bucket.reduced, bucket.grad, group=self.group, async_op=True,
                                                input_is_scratch=True)
            self._in_flight = [bucket]
            self._open += 1

    def _finish_reduction(self) -> None:
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            if self.stage == 1:  # once backward is over, one bucket after the other
                reduced = torch.empty(bucket.layout.shard_numel, dtype=self.mp.reduce_dtype, device=bucket.grad.device)
                comm.reduce_scatter(reduced, for_reduction(bucket.grad, self.mp), group=self.group)
                bucket.grad[bucket.layout.shard_slice].copy_(reduced.div_(self.world_size))  # sum -> average
        for bucket in self._in_flight:
            self._keep_shard(bucket)
        self._in_flight, self._open = [], 0
        offload.wait_for_copies()  # --cpu_offload: ZeRO-2's shards copied out, before the CPU reads them

    def _keep_shard(self, bucket: FlatBucket) -> None:
        """ZeRO-2: wait for a bucket's reduce-scatter; its output, averaged, is the shard's gradient
        (cast to the gradient's dtype where the sum was taken in another); the rest is dropped.
        With `accumulate_sharded` it stays in the reduction's dtype and, from the second micro-batch
        of a step on, is added into the shard's gradient the earlier ones left (on the host with
        --cpu_offload: the earlier copies were waited for when their backward ended)."""
        bucket.handle.wait()
        bucket.grad = bucket.handle = None  # the full flat gradient is summed and its shard copied out: let go
        shard = bucket.reduced.div_(self.world_size)
        shard = shard if self.accumulate_sharded else shard.to(self.mp.param_dtype)
        bucket.reduced = None  # only the shard's gradient stays; --cpu_offload: on the host, copied out at once
        adding = self.accumulate_sharded and bucket.grad_shard is not None
        if self.cpu_offload:
            shard = offload.to_host(shard, non_blocking=not adding)  # added at once: its copy must be done
        if adding:
            bucket.grad_shard += shard
        else:
            bucket.grad_shard = shard

    # ------------------------------------------------------------------ what the strategy reads
    def refresh_weights(self) -> None:
        """Every rank's weights from the masters (after loading a checkpoint into them)."""
        for bucket in self.buckets:
            bucket.refresh_weights(self.group)

    def gradient_shards(self) -> list[torch.Tensor]:
        """This rank's shard of each bucket's gradient."""
        return [b.own_gradient() for b in self.buckets]

    def clip_grad_norm_(self, max_norm: float, also=()) -> torch.Tensor:
        """Clip by the whole gradient's norm (`also`: more groups holding other parts: a pipeline's stages)."""
        return clip_sharded_grad_norm_(self.gradient_shards(), max_norm, self.group, also)

    def flats(self) -> list[Flat]:
        names = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        return [Flat(b.layout, b.master, [tuple(names[id(p)]) for p in b.params]) for b in self.buckets]

    def full_parameters(self, keep: bool) -> dict[str, torch.Tensor]:
        """The fp32 weights by name on this rank's CPU if it `keep`s them, gathered from the masters
        one bucket at a time (every rank calls it: `flat.gather_parameters`)."""
        full = gather_parameters(self.flats(), keep, self.group)
        if not keep:
            return {}
        return {name: full[name] if name in full else _frozen_on_cpu(p)
                for name, p in self.module.named_parameters(remove_duplicate=False)}


def _frozen_on_cpu(param: nn.Parameter) -> torch.Tensor:
    """A frozen parameter (in no bucket: every rank holds it whole) as an fp32 copy on the CPU."""
    return param.detach().to("cpu", torch.float32, copy=True)
