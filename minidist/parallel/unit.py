"""One FSDP unit's life: its flat shard, and the full weights gathered only while it runs.

`fsdp.py` cuts the model into units and tells the story of a step (its docstring: gather before
forward, free after it, gather again before backward, free and reduce-scatter after it); this
module is what each unit does at those four moments. A `Unit` never imports its wrapper: it is
handed the `FullyShardedDataParallel` it belongs to (`self.fsdp`), and reads from it the group,
the precision policy and the prefetch order. What spans several units is the wrapper's, never
written by a unit: the reduce-scatter a unit launches after its backward is handed to the
wrapper's queue (`fsdp.Reductions`), which waits for it one unit later (just before the next
unit's weight gradients are joined into its full gradient), runs HSDP's all-reduce
over the copies, and gives the finished shard back to the unit (`accumulate`). Each collective is
launched on the wrapper's side stream for its kind (`fsdp.all_gather_stream`,
`fsdp.reduce_scatter_stream`: `streams.py`), with every tensor it touches made before the launch.

Two things differ by unit and by micro-batch: the root stays gathered from its forward to its
backward when grad is on (`post_forward`), and under `no_sync` a unit keeps its gradient summed in
the reduction's dtype, `accumulated`, until the micro-batch that synchronises (`_take_grad`).
With `--accumulate_sharded` every micro-batch synchronises: `accumulated` stays None, and each
micro-batch's reduced shard is added into `flat_param.grad` (`accumulate`).

A unit may hold frozen parameters too (LoRA's base weights): they go in a second flat,
`self.frozen` (`frozen.py`), gathered and freed with the trainable one and never reduced. The
trainable flat is then the adapters alone, or empty (a root unit whose embeddings, norm and
output layer are all frozen): an empty flat is neither gathered nor handed to `flats()`.
"""

import torch
from torch import nn

from minidist.parallel import comm, offload
from minidist.parallel.flat import FlatLayout, scatter_flat
from minidist.parallel.frozen import FrozenFlat
from minidist.parallel.comm import broadcast_from_first_copy
from minidist.parallel.precision import for_reduction
from minidist.parallel.wrapper import weak_hook


class Unit:
    """One FSDP unit: a module, its flat fp32 shard, and its full flat buffer while gathered."""

    def __init__(self, fsdp, module: nn.Module, slots: list, device: torch.device):
        self.fsdp, self.module = fsdp, module
        unique = list({id(p): p for *_, p in slots}.values())  # a tied weight once
        params = [p for p in unique if p.requires_grad]
        frozen = [p for p in unique if not p.requires_grad]  # LoRA's base: a flat of its own (frozen.py)
        index = {id(p): k for k, p in enumerate(params)}
        self.slots = [(owner, attr, name, index[id(p)]) for owner, attr, name, p in slots if id(p) in index]
        findex = {id(p): k for k, p in enumerate(frozen)}
        self.frozen_slots = [(owner, attr, name, findex[id(p)]) for owner, attr, name, p in slots if id(p) in findex]
        self.frozen = FrozenFlat(frozen, fsdp.mp.param_dtype, fsdp.group, fsdp.world_size, fsdp.rank, device,
                                 lambda layout, out: load_shard(fsdp, layout, frozen, out)) if frozen else None
        self.layout = FlatLayout(params, fsdp.world_size, fsdp.rank)
        # Load once and shard: rank 0 flattens the weights and sends shard r to rank r.
        shard = torch.empty(self.layout.shard_numel, dtype=torch.float32, device=device)
        load_shard(fsdp, self.layout, params, shard)
        # --cpu_offload: the fp32 shard (the master) on the host, a compute-dtype copy on the device (offload.py)
        self.flat_param = nn.Parameter(offload.to_host(shard) if fsdp.cpu_offload else shard)
        self.device_shard = offload.DeviceCopy(self.flat_param, device, fsdp.mp.param_dtype) if fsdp.cpu_offload else None
        module.register_parameter("flat_param", self.flat_param)
        for owner, attr, _, _ in self.slots + self.frozen_slots:
            del owner._parameters[attr]  # from now on a plain attribute, set to a view when gathered
        # The full flat buffer: a leaf that requires grad, so autograd accumulates the gradient of
        # every view of it into full.grad, in one tensor. Its storage is freed when not in use.
        self.full = torch.empty(self.layout.padded_numel, dtype=fsdp.mp.param_dtype, device=device, requires_grad=True)
        self._data = self.full.data  # same storage, own version counter: gathering into it is no
        self._free_storage()  # "in-place modification" in autograd's eyes
        self.full.register_post_accumulate_grad_hook(weak_hook(self._post_backward))
        self.handle = self._send = None
        self.accumulated = None  # under no_sync: the sum of this unit's gradients so far (`_take_grad`)
        self.state = "sharded"  # "gathering" (all-gather in flight), "gathered"
        self.gathered_for_backward = False

    # ------------------------------------------------------------------ gather and free
    def gather(self) -> None:
        """Start the all-gather of this unit (asynchronous); `wait` finishes it."""
        if self.state != "sharded":
            return
        side = self.fsdp.all_gather_stream  # its own stream, as FSDP2's (NCCL still orders it: streams.py)
        if self.frozen is not None:
            self.frozen.gather(side)
        if self.layout.numel:
            # Both tensors are made here, on the compute stream, before the launch (streams.py's rule).
            self._data.untyped_storage().resize_(self.layout.padded_numel * self._data.element_size())
            self._send = send = (self.device_shard.get() if self.device_shard  # bf16: half the bytes
                                 else self.flat_param.detach().to(self.fsdp.mp.param_dtype))
            data, group = self._data, self.fsdp.group
            self.handle = side.launch(lambda async_op: comm.all_gather(data, send, group=group, async_op=async_op),
                                      data, send)
        self.state = "gathering"
        self.fsdp._count_unsharded(+1)

    def wait(self) -> None:
        if self.state == "gathering":
            if self.frozen is not None:
                self.frozen.wait()
            if self.handle is not None:
                self.handle.wait()
            self.handle = self._send = None
            self.state = "gathered"

    def use_views(self) -> None:
        """Point every module attribute at its slice of the full buffer (fresh views each forward)."""
        views = self.layout.views(self.full)
        for owner, attr, _, k in self.slots:
            setattr(owner, attr, views[k])
        if views and views[0].grad_fn is not None:
            # In backward, autograd concatenates the weights' gradients into one full-size gradient
            # of the unit (the backward of `layout.views`' split), while those gradients are still
            # alive, and only then calls `_post_backward`. By then nothing needs the gathered
            # weights (every operation that read them has made its gradients), and the previous
            # unit's reduce-scatter has run during this unit's whole backward. So both are let go
            # first, as FSDP2 frees a unit's weights and its last reduce-scatter input before it
            # makes the next one: the weights, the pieces, the new full gradient and the previous
            # one are never alive at once.
            split = views[0].grad_fn.next_functions[0][0]
            split.register_prehook(weak_hook(self._before_concatenation))
        if self.frozen is not None:
            frozen_views = self.frozen.views()
            for owner, attr, _, k in self.frozen_slots:
                setattr(owner, attr, frozen_views[k])

    def free(self) -> None:
        if self.state != "sharded":
            self.wait()
            self._free_storage()
            self.state = "sharded"
            self.fsdp._count_unsharded(-1)

    def _free_storage(self) -> None:
        self._data.untyped_storage().resize_(0)
        if self.frozen is not None:
            self.frozen.free()

    # ------------------------------------------------------------------ the hooks
    def pre_forward(self, *_) -> None:
        self.gather()
        self.wait()
        self.use_views()
        if not self.fsdp.in_backward:
            self.fsdp.prefetch(self, +1)

    def post_forward(self, module, args, output):
        if self.fsdp.in_backward:  # a recomputation inside backward: the unit is needed now
            return output
        # The root stays gathered from forward to backward when there is a backward to come (FSDP2's
        # reshard_after_forward=False for the root): backward starts with the output layer, at once.
        if not (self is self.fsdp.root and torch.is_grad_enabled()):
            self.free()
        if torch.is_grad_enabled():
            self.gathered_for_backward = False
            self.fsdp.hook_outputs(output, self.pre_backward)
        return output

    def pre_backward(self, grad):
        self.fsdp.start_backward()
        if not self.gathered_for_backward:  # once a backward pass (fsdp._end_backward forgets it), however many outputs
            self.gathered_for_backward = True
            root = self.fsdp.root
            if self is not root and not root.layout.numel:
                # A root with nothing to train (LoRA on the layers alone) has no gradient to say its
                # backward is over; the last layer's output gradient does: the output layer and final
                # norm made it, and nothing in backward reads their weights again (layers run between
                # the embedding and the norm, and a frozen embedding has no backward). `frozen.py`.
                root.free()
            self.gather()
            self.wait()
            self.fsdp.prefetch(self, -1)
        return grad

    def _before_concatenation(self, grads) -> None:
        """Every weight of this unit has its gradient; autograd is about to join them into one."""
        if self.frozen is None:  # LoRA's frozen weights may still be read by the input's gradient
            self.free()
        self.fsdp.reductions.make_room()

    def _post_backward(self, full: torch.Tensor) -> None:
        self.free()  # the gathered weights first: the reduction does not need them
        grad = self._take_grad(full)
        if not self.fsdp.require_sync:
            self.accumulated = grad  # no_sync: kept, in the reduction's dtype, for the next backward to add to
            return
        self.accumulated = None  # from here on the reduce-scatter's input (scratch: gloo sums into it)
        grad.div_(self.fsdp.world_size * self.fsdp.replicate_size)  # the average over every rank, as DDP takes it
        out = torch.empty(self.layout.shard_numel, dtype=grad.dtype, device=grad.device)  # on the compute stream
        group = self.fsdp.group
        handle = self.fsdp.reduce_scatter_stream.launch(
            lambda async_op: comm.reduce_scatter(out, grad, group=group, async_op=async_op, input_is_scratch=True),
            out, grad)
        self.fsdp.reductions.add(self, handle, out, grad)  # the wrapper's queue: finished before the next unit's joining

    def _take_grad(self, full: torch.Tensor) -> torch.Tensor:
        """This backward's gradient of the unit, in the dtype it is summed in (`reduce_dtype`: fp32 by
        default), added into what the `no_sync` micro-batches before it accumulated; `full.grad` let go.

        Autograd would accumulate into `full.grad` in the weights' dtype: in bf16, every micro-batch's
        addition rounds the running sum to 8 bits. Here each bf16 gradient is added into an fp32 sum
        (exact conversion, one fp32 rounding), as FSDP2 accumulates in its reduce dtype, for 4 bytes an
        element kept between micro-batches instead of 2."""
        new, full.grad = full.grad, None
        if self.accumulated is None:
            return for_reduction(new, self.fsdp.mp)  # a cast (bf16 -> fp32), or the gradient itself
        return self.accumulated.add_(new)

    def accumulate(self, out: torch.Tensor) -> None:
        """Add a reduced gradient shard (its collectives done) into `flat_param.grad`: once a step,
        or once a micro-batch with `--accumulate_sharded` (the shards of the micro-batches sum to
        the shard of their sum)."""
        out = out.to(torch.float32)
        if self.fsdp.cpu_offload:  # copied out at once, while backward goes on
            offload.accumulate_grad(self.flat_param, out)
        elif self.flat_param.grad is None:
            self.flat_param.grad = out
        else:
            self.flat_param.grad += out


def load_shard(fsdp, layout: FlatLayout, params: list, out: torch.Tensor) -> None:
    """Fill `out` with this rank's shard of `params`, flattened by `layout`, read on rank 0 only.

    Rank 0 flattens the weights and scatters them over its shard group; under HSDP that is the
    first copy (node 0), and the other copies receive their shard from the rank of node 0 that
    holds it (one broadcast per replicate group) instead of reading the model again."""
    if not params:  # an empty flat (LoRA: a unit whose parameters are all frozen)
        return
    if fsdp.replicate_rank == 0:
        whole = layout.flatten(params, torch.float32) if fsdp.rank == 0 else None
        scatter_flat(layout, whole, out, group=fsdp.group)
    broadcast_from_first_copy([out], fsdp.replicate_group)
