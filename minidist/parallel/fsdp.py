"""FSDP (ZeRO-3) by hand: shard the parameters too, and gather each layer only while it runs.

ZeRO-2 (`zero.py`) shards gradients and optimizer states, but every rank still holds every
weight. FSDP, "fully sharded data parallel" (ZeRO stage 3; Zhao et al. 2023, "PyTorch FSDP:
Experiences on Scaling Fully Sharded Data Parallel", VLDB), keeps only 1/N of the weights too:
16P/N bytes of model states per rank, so 4 A100s hold CodeLlama-7b's 108 GB as 27 GB each.

**Units.** A wrap policy cuts the model into units: every module of a layer class (the decoder
layers, `LlamaDecoderLayer` or `GPT2Block`), and the *root* unit with everything left over
(embeddings, final norm, output layer). `unit_classes=()` (the loop's `--no_layer_wrap_policy`)
makes the whole model one unit. Each unit's parameters are laid out by one `flat.FlatLayout`:
flattened, padded to a multiple of N, cut into N shards. Rank r keeps shard r as an fp32
`nn.Parameter`, `flat_param`, registered on the unit's module: it is what the optimizer updates,
and all that lives between steps. The original parameters are removed from their modules.

**A unit's life in one step:**
1. *before its forward* (a forward pre-hook) the shards are all-gathered into the full flat
   buffer, and each module attribute (`q_proj.weight`, ...) is set to a view of it;
2. *after its forward* the full buffer's storage is freed: the views stay (autograd saved them)
   but point to no memory;
3. *before its backward* (a hook on the gradient of the unit's output) the shards are gathered
   again, into the same storage, so the views autograd saved are valid again;
4. *after its backward* (autograd has made the gradient of the full flat buffer) the gathered
   weights are freed and the gradient's reduce-scatter is launched, asynchronously: rank r will
   get the sum of its shard, averaged, in `flat_param.grad`. Then the previous unit's
   reduce-scatter is waited for and its full gradient let go (`Reductions`, the wrapper's queue):
   at most two units' full gradients are ever alive (one on the wire, one that autograd fills),
   not the whole model's.
The root skips steps 2 and 3 when there is a backward to come (grad enabled), as in PyTorch's FSDP2
(`reshard_after_forward=False` for the root): backward begins with the output layer, which needs
the root's weights at once, so there is nothing to prefetch them behind. It stays gathered from its
forward to its post-backward (the embedding's gradient, the last of the step); under `no_grad`
(evaluation, generation) it is freed after forward like every unit. The price: the root's weights stay
held between forward and backward, while the loss is computed: it was held through the whole
forward (the layers run inside the root's module) and the whole backward already.

**Bytes per rank per step**, P_root the root's elements: the layers are all-gathered twice
(P - P_root each time), the root once, and everything reduce-scattered once, each (N-1)/N:
(3P - P_root)(N-1)/N, against DDP's 2P(N-1)/N. With gradient accumulation, `no_sync()`
micro-batches send no reduce-scatter but still gather: ((2k + 1)P - k P_root)(N-1)/N for k
micro-batches. As one unit (`unit_classes=()`) the whole model is the root: (k + 1)P(N-1)/N, DDP's
2P(N-1)/N for k = 1. (Before the root was kept, it was gathered twice too: (2k + 1)P(N-1)/N.)

**Accumulation in fp32.** Under `no_sync()` a unit's gradient is not left in `full.grad`, where
autograd would add the next micro-batch's into it in the weights' dtype (bf16 under mixed
precision: every addition rounded to 8 bits). At each post-backward the unit adds it into a sum of
its own in the reduction's dtype (`reduce_dtype`, fp32 by default; `Unit._take_grad`), and the
synchronising micro-batch reduce-scatters that sum. As FSDP2: 4 bytes an element kept between
micro-batches, not 2.

**Under a pipeline** (`--pp_size`, lesson 12: `pipeline/executor.py`). The wrapper goes around one
stage, and the schedule runs several forwards before their backwards (GPipe all m micro-batches,
1F1B up to p), the backwards in any order the executor allows. A unit's life above holds for each
micro-batch: each forward frees its layers (every micro-batch's graph keeps views of the freed
storage), and each micro-batch's backward gathers them again, into the same storage, at its
pre-backward hook. That a unit is gathered for backward is forgotten when each backward pass ends
(`_end_backward`), not at the next forward: the next backward may be another micro-batch's, with
no forward between. The root stays gathered from a forward until the next backward frees it, and
the next forward or backward gathers it again: a step of m micro-batches gathers it m times, as
the loop's accumulation over k = m micro-batches does, so the bytes above hold with P the stage's
parameters. The executor runs every backward of the rank's list but the last under `no_sync`:
each unit keeps its gradients summed in the reduction's dtype (`Unit._take_grad`), and the last
reduce-scatters them once. With activation checkpointing, a layer recomputed in backward reads the
views its latest forward made: views of the same storage, gathered for this backward.

**Sharded accumulation** (`--accumulate_sharded`: the strategy's `no_sync` is then a null
context). Every micro-batch synchronises: each unit is reduce-scattered at its post-backward as
in the last one, and `Unit.accumulate` adds the new shard into `flat_param.grad` (fp32). So no
full-size gradient outlives its micro-batch: P/N fp32 elements kept between micro-batches instead
of P. Reduce-scatter is linear, so the k shards sum to the shard of the sum: the same gradient.
The gathers do not change; the reduce-scatters are k instead of 1: k(3P - P_root)(N-1)/N a step,
k times a step without accumulation. HSDP all-reduces each micro-batch's shard over the copies
too (as FSDP2 does unless told `set_requires_all_reduce(False)`), k 2(P/S)(R-1)/R across nodes:
simpler (each still overlaps the backward of the units after it, as in the last micro-batch); deferring
them to the last micro-batch would send them once, at the price of a step that tells the wrapper
which micro-batch is its last.

**Two streams** (`streams.py`). On a GPU the all-gathers run on one side stream and the
reduce-scatters on another (HSDP's all-reduces on a third), as FSDP2's `all_gather_stream` and
`reduce_scatter_stream`. CUDA then does not queue unit i-2's gather behind unit i's
reduce-scatter, but NCCL still does: it runs one communicator's collectives in launch order
whatever the stream, and both kinds run over one process group (`streams.py`; FSDP2 alike). The
compute stream waits for each collective's event before it reads the result, and only there. On a CPU the same calls are gloo's
asynchronous collectives, with no stream at all.

**Hybrid sharding (HSDP, `--strategy hsdp`).** Given a `replicate_group` (`mesh.py`: the ranks at
the same place on every node), the units are sharded over `process_group`, the S ranks of a node,
and the R nodes each hold a copy. Gathers and reduce-scatters stay within the node. When a unit's
reduce-scatter is waited for (at the next unit's post-backward, by the wrapper's queue of
reductions, `Reductions`), its gradient shard's all-reduce over the copies is launched,
asynchronously, and waited for one unit later (or when backward ends). The gradient is divided by
all R x S ranks. Loading scatters rank 0's weights over node 0 and broadcasts each shard from
there to the other copies. Bytes per rank: (3P - P_root)(S-1)/S within the node, 2(P/S)(R-1)/R
across.

**Prefetch.** While unit i computes, unit i+1's all-gather is already in flight (launched
asynchronously from unit i's pre-forward hook), and in backward unit i-1's while unit i computes.
The first layer's gather is launched right after the root's, before the root is waited for, so the
two are in flight together; in backward the root is already there, and the last layer's gather is
launched as backward begins. So at most three units are gathered at once: the root, the running
unit and the next one (`max_unsharded` records it). Layers are assumed to run in the order they are
registered, as in every decoder-only transformer (PyTorch's FSDP records the order of the first step
instead).

**Mixed precision.** The fp32 shard is the master weight. With `param_dtype=bf16` each unit is
all-gathered in bf16 (half the bytes and memory), forward and backward compute in bf16, and the
gradient is reduce-scattered in `reduce_dtype` (fp32 by default) into the fp32 gradient shard.

**Loading without N copies.** Only rank 0 needs the weights: the other ranks may build the model
on the meta device (shapes, no memory; `strategy.MinidistFSDP.load_model` does this), and each
unit is flattened on rank 0 and *scattered*, rank r receiving shard r. For CodeLlama-7b on a 4-GPU
node: rank 0 holds the fp32 model in host memory (27 GB) plus one flattened unit (a decoder layer,
202M parameters: 0.8 GB), the three other ranks hold nothing, and each GPU receives 6.7 GB of fp32
shards; if every rank loaded the model, the node would need 4 x 27 = 108 GB of host memory.
While rank 0 reads, the others wait on a CPU barrier with an hour's timeout
(`distributed.wait_for_rank0`), not inside the scatter, whose timeout (600 s) a slow read can outlast.

The learner's check that all this is right: `tests/parallel/test_zero_fsdp.py` trains it next to a
single process on the whole batch and finds the same losses and weights.
"""

import torch
import torch.distributed as dist
from torch import nn

from minidist.parallel import comm, offload
from minidist.parallel.flat import Flat, clip_sharded_grad_norm_, gather_parameters
from minidist.parallel.comm import broadcast_from_first_copy
from minidist.parallel.precision import MixedPrecision
from minidist.parallel.streams import SideStream
from minidist.parallel.unit import Unit
from minidist.parallel.wrapper import DataParallelWrapper


class FullyShardedDataParallel(DataParallelWrapper):
    """ZeRO-3 around a model: units by layer class, flat shards, gather and free, prefetch.

    Its parameters are the units' fp32 shards (`flat_param`), so a plain optimizer over
    `model.parameters()` steps each rank's shard only."""

    def __init__(self, module: nn.Module, unit_classes=(), mixed_precision: MixedPrecision = MixedPrecision(),
                 device: torch.device | None = None, process_group=None, replicate_group=None,
                 cpu_offload: bool = False):
        super().__init__(module, process_group)
        self.mp, self.cpu_offload = mixed_precision, cpu_offload  # offload: masters and the step on the CPU (offload.py)
        device = device or torch.device("cpu")
        # HSDP: the copies of each shard, one per node (mesh.py); none: FSDP over `process_group` alone.
        self.replicate_group = replicate_group
        self.replicate_size = 1 if replicate_group is None else dist.get_world_size(replicate_group)
        self.replicate_rank = 0 if replicate_group is None else dist.get_rank(replicate_group)
        self.in_backward = False
        # One side stream per kind of collective, as FSDP2's (streams.py): the compute stream waits
        # only where it reads a result. Both kinds run over one communicator, and NCCL runs its
        # collectives in launch order whatever the stream (streams.py). On a CPU: gloo's async calls.
        self.all_gather_stream, self.reduce_scatter_stream = SideStream(device), SideStream(device)
        # The gradients' collectives still in flight, across units (HSDP: over the copies too, on a
        # stream of their own at default priority, as FSDP2's all_reduce_stream).
        self.reductions = Reductions(replicate_group if self.replicate_size > 1 else None,
                                     SideStream(device, priority=0) if self.replicate_size > 1 else None)
        self.unsharded = self.max_unsharded = 0
        unit_modules, slots = wrap_units(module, unit_classes)
        owner = {}
        for i, unit_slots in enumerate(slots):  # a weight tied across two units would be sharded twice
            for _, _, name, p in unit_slots:
                if owner.setdefault(id(p), i) != i:
                    raise ValueError(f"{name} is shared by two FSDP units; tie weights within one unit "
                                     "(or use --no_layer_wrap_policy)")
        self.layer_units = [Unit(self, m, s, device) for m, s in zip(unit_modules, slots)]
        self.root = Unit(self, module, slots[-1], device)
        self.units = self.layer_units + [self.root]
        for u in self.layer_units:
            u.module.register_forward_pre_hook(u.pre_forward)
            u.module.register_forward_hook(u.post_forward)
        self._materialize_buffers(device)

    def _materialize_buffers(self, device) -> None:
        """Buffers (rotary frequencies, ...) are small: rank 0's go to every rank, as in DDP."""
        slots = [(m, name) for m in self.module.modules() for name, buf in m._buffers.items() if buf is not None]
        for m, name in slots:
            buf = m._buffers[name]
            m._buffers[name] = torch.empty_like(buf, device=device) if buf.is_meta else buf.to(device)
        self.broadcast_from_first_rank([m._buffers[name] for m, name in slots])
        broadcast_from_first_copy([m._buffers[name] for m, name in slots], self.replicate_group)  # HSDP

    def forward(self, *args, **kwargs):
        self.in_backward = False
        # The root's gather and the first layer's in flight together: the root's forward is short
        # (the embedding lookup), and the first layer should not wait for the root's wait to start.
        self.root.gather()
        self.prefetch(self.root, +1)
        self.root.pre_forward()  # waits for the root (the prefetch it would start is in flight already)
        output = self.module(*args, **kwargs)
        return self.root.post_forward(self.module, args, output)

    # ------------------------------------------------------------------ shared by the units
    def prefetch(self, unit: Unit, step: int) -> None:
        """Start gathering the layer unit that runs after `unit` (step +1, forward) or before it
        (-1, backward); the root's neighbours are the first and the last layer."""
        if not self.layer_units:
            return
        if unit is self.root:
            nxt = self.layer_units[0 if step > 0 else -1]
        else:
            i = self.layer_units.index(unit) + step
            nxt = self.layer_units[i] if 0 <= i < len(self.layer_units) else None
        if nxt is not None:
            nxt.gather()

    def hook_outputs(self, output, hook) -> None:
        """Call `hook` when the gradient of any tensor in `output` is computed: the unit's backward starts."""
        if isinstance(output, torch.Tensor):
            if output.requires_grad:
                output.register_hook(hook)
        elif isinstance(output, (dict, tuple, list)):  # a model output is a dict; a layer's, a tuple
            for value in output.values() if isinstance(output, dict) else output:
                self.hook_outputs(value, hook)

    def start_backward(self) -> None:
        if not self.in_backward:
            self.in_backward = True
            # Ask autograd to call us once this whole backward pass is over.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self.reductions.finish()
        offload.wait_for_copies()  # --cpu_offload: the gradient shards' copies to the host, before the CPU reads them
        for unit in self.units:  # a prefetched unit that did not run after all
            unit.free()
            unit.gathered_for_backward = False  # the next backward (another micro-batch's) gathers again
        self.in_backward = False

    def _count_unsharded(self, change: int) -> None:
        self.unsharded += change
        self.max_unsharded = max(self.max_unsharded, self.unsharded)

    # ------------------------------------------------------------------ what the strategy reads
    def gradient_shards(self) -> list[torch.Tensor]:
        """This rank's shard of each unit's gradient (a unit with none yet has no shard)."""
        return [u.flat_param.grad for u in self.units if u.flat_param.grad is not None]

    def clip_grad_norm_(self, max_norm: float, also=()) -> torch.Tensor:
        """Clip by the whole gradient's norm (`also`: more groups holding other parts: a pipeline's stages)."""
        return clip_sharded_grad_norm_(self.gradient_shards(), max_norm, self.group, also)

    def flats(self) -> list[Flat]:
        """The trainable flats (what the optimizer steps and a checkpoint holds); a unit whose
        parameters are all frozen has none."""
        return [_flat(u.layout, u.flat_param, u.slots) for u in self.units if u.layout.numel]

    def frozen_flats(self) -> list[Flat]:
        """The frozen flats (LoRA's base, `frozen.py`): in the weights, never in the optimizer."""
        return [_flat(u.frozen.layout, u.frozen.shard, u.frozen_slots) for u in self.units if u.frozen is not None]

    def refresh_weights(self) -> None:
        """Nothing to do after loading shards: every unit is gathered from them before each use."""

    def full_parameters(self, keep: bool) -> dict[str, torch.Tensor]:
        """The fp32 weights by their original names on this rank's CPU if it `keep`s them, one
        unit at a time (every rank calls it: `flat.gather_parameters`), the frozen ones too."""
        return gather_parameters(self.flats() + self.frozen_flats(), keep, self.group)


class Reductions:
    """The wrapper's queue of gradient reductions in flight, across units: each unit's
    post-backward hook hands it the reduce-scatter it launched (`add`), and the end of backward
    empties it (`finish`).

    A unit's reduce-scatter is waited for one unit later: the collective runs while autograd
    computes the next unit's gradient, and is finished (`make_room`) just before autograd
    concatenates the next unit's weight gradients into its full gradient (`Unit.use_views`), so
    that at most one full gradient is alive beside the pieces being concatenated, not the whole
    model's (at the latest, the next unit's `add` finishes it). Once it is done,
    the shard is added into the unit's `flat_param.grad` (`Unit.accumulate`). HSDP: the shard must
    first be summed over the copies too; that all-reduce is started where the reduce-scatter
    finishes (`_start_replicate`) and waited for one unit later again (`_finish_replicate`)."""

    def __init__(self, replicate_group=None, all_reduce_stream: SideStream | None = None):
        self.replicate_group = replicate_group  # HSDP's copies; None: FSDP, nothing to replicate
        self.all_reduce_stream = all_reduce_stream  # HSDP: where the all-reduces over the copies run
        self.scattering = None  # (unit, handle, shard out, full gradient): the last unit's reduce-scatter
        self.replicating = []  # HSDP: (unit, handle, shard) of the all-reduces over the copies in flight

    def add(self, unit, handle, out: torch.Tensor, grad: torch.Tensor) -> None:
        """`unit` launched the reduce-scatter of `grad` into `out`: finish the ones before it."""
        self._finish_replicate()  # HSDP: the all-reduce of two units back
        self._finish_scatter()  # the previous unit's: done, let go
        self.scattering = (unit, handle, out, grad)  # `grad` lives until its collective is done

    def make_room(self) -> None:
        """A unit's weight gradients are all computed and about to be concatenated into its full
        gradient: finish the reductions in flight first, and let their full gradients go."""
        self._finish_replicate()
        self._finish_scatter()

    def finish(self) -> None:
        """Backward is over: wait for everything still in flight (HSDP: the last unit's all-reduce
        is launched first, then the two are waited for)."""
        self._finish_scatter()
        self._finish_replicate()

    def _finish_scatter(self) -> None:
        if self.scattering is None:
            return
        unit, handle, out, _ = self.scattering
        self.scattering = None
        handle.wait()
        if self.replicate_group is not None:
            self._start_replicate(unit, out)
        else:
            unit.accumulate(out)

    def _start_replicate(self, unit, out: torch.Tensor) -> None:
        """HSDP: sum the reduced shard over the copies (one rank per node), asynchronously."""
        group = self.replicate_group
        work = self.all_reduce_stream.launch(lambda async_op: comm.all_reduce(out, group=group, async_op=async_op), out)
        self.replicating.append((unit, work, out))

    def _finish_replicate(self) -> None:
        """HSDP: wait for the all-reduces in flight; each unit takes its shard, now summed over
        every rank."""
        in_flight, self.replicating = self.replicating, []
        for unit, work, out in in_flight:
            work.wait()
            unit.accumulate(out)


def _flat(layout, shard, slots) -> Flat:
    names = [[] for _ in layout.shapes]
    for _, _, name, k in slots:
        names[k].append(name)  # a tied weight: each of its names
    return Flat(layout, shard, [tuple(n) for n in names])


def wrap_units(module: nn.Module, unit_classes) -> tuple[list, list]:
    """The wrap policy: the outermost modules of the given classes, in registration order, and the
    slots (`_slots`) of each, then the root's (the rest). It reads the module only, so a pipeline's
    full checkpoint can lay out the units a run without a pipeline makes (`strategy/state/data.run_units`)."""
    unit_modules = {}
    for name, m in module.named_modules():
        if type(m).__name__ in unit_classes and not any(name.startswith(u + ".") for u in unit_modules):
            unit_modules[name] = m
    claimed = {id(m) for m in unit_modules.values()}
    slots = [_slots(m, name + ".", claimed) for name, m in unit_modules.items()] + [_slots(module, "", claimed)]
    return list(unit_modules.values()), slots


def _slots(module: nn.Module, prefix: str, claimed: set) -> list:
    """(owning module, attribute, full name, parameter) for every parameter of `module` that is not
    inside another unit; a tied weight appears once per name."""
    out = []

    def walk(m, path):
        for attr, p in m._parameters.items():
            if p is not None:
                out.append((m, attr, path + attr, p))
        for name, child in m._modules.items():
            if child is not None and id(child) not in claimed:
                walk(child, path + name + ".")

    walk(module, prefix)
    return out
