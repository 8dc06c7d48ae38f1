"""The moments of a training step where one rank's memory peaks, term by term, per strategy.

`estimator.py` says what a rank holds (model states) and what one micro-batch keeps for backward
(activations). The peak is the most that is alive *at once*, and each strategy allocates and
frees in its own order. Four moments cover the step, as `measure.LiveTensors` sees it:

- **forward**: the end of the last micro-batch's forward. Everything saved for backward, the
  logits term (two fp32 tensors the logits' size: the loss's, alive inside its forward and again
  as backward starts, counted here, at the boundary), autocast's weight copies; with accumulation,
  the gradients of the earlier micro-batches are already there (the first micro-batch finds none:
  `zero_grad(set_to_none)`).
- **backward**: while backward reduces. For DDP, the end of backward, when autograd's gradients
  and the buckets are both alive; for ZeRO-1, each bucket's reduce-scatter once backward is
  over; for ZeRO-2 and FSDP, the first units or buckets to be reduced, while most activations
  still wait for backward (activations are freed as backward passes each layer, so the share
  still alive is the share of the layers' parameters whose gradients are still to come).
- **step**: the optimizer step. AdamW's multi-tensor step allocates one fp32 temporary per
  element it updates (sqrt(v)); ZeRO steps a few buckets at a time (`zero.STEP_BYTES`).
- **refresh**: ZeRO's all-gather of the updated shards into every rank's weights.

A reduce-scatter's output, and its input cast to fp32 where the gradients are bf16, live until
it is done: one in flight and one being filled (ZeRO-2, FSDP). PyTorch's gloo backend (the CPU)
also copies a reduce-scatter's input into a buffer of its own, counted here where `LiveTensors`
sees it (`measure.py`); NCCL, on GPUs, does not, so `backend="nccl"` leaves these copies out. The
hand-written ZeRO-2 and FSDP make no such copy on either: their inputs are scratch buffers, which
`comm.reduce_scatter` all-reduces in place on gloo. ZeRO-1's input is the kept gradient buffer, so
gloo copies it.

**Sharded accumulation** (`--accumulate_sharded`: ZeRO-2, FSDP, HSDP): every micro-batch is
reduce-scattered, so no full gradient is kept between micro-batches ("accumulated gradients" is
0); instead the shards' gradients, summed in the reduction's dtype (fp32), are alive from the first
micro-batch on: in the last one's forward and all through its backward, where each new shard is
added into them and let go.

Checked against `LiveTensors` in tests/memory/test_memory.py (within 5%, every strategy; the flag's
cases in tests/parallel/test_accumulate_sharded.py). Where the
logits outweigh a layer's activations several times over, FSDP's figure strays further: the
loss's own tensors are one term here ("logits"), not walked operator by operator.
"""

import torch

from minidist.parallel.wrapper import pack_buckets
from minidist.parallel.zero import STEP_BYTES


def buckets(param_numels: list[int], cap_bytes: int) -> list[int]:
    """Elements per bucket, as `zero.ZeroDP` packs them: in reverse registration order (roughly
    backward's), fp32, at most `cap_bytes` (a larger parameter gets a bucket of its own)."""
    metas = [torch.empty(numel, device="meta") for numel in reversed(param_numels)]
    return [sum(meta.numel() for meta in run) for run in pack_buckets(metas, cap_bytes)]


def _shard(numel: int, ranks: int) -> int:
    """Elements of one rank's shard of a flat of `numel`: ceil(numel / ranks), the last one padded."""
    return -(-numel // ranks)


def moments(shape, setup, states: dict, acts: dict, whole=None) -> dict:
    """{moment: {term: bytes}} for one rank; the peak is the largest sum. `shape` is the shape of
    what is trained (LoRA: the adapters, `lora_terms.trained_shape`), `whole` the model's (FSDP's
    gathers)."""
    options, ranks, num_params = setup.options, setup.world_size, shape.num_params
    strategy, impl = options.strategy, options.impl
    gloo = setup.backend == "gloo" and ranks > 1  # gloo's copies (one rank sends nothing: comm.py copies locally)
    bf16 = options.mixed_precision == "bf16"
    # Bytes per element of what is computed with (DDP: autocast over fp32 weights).
    compute_bytes = 2 if bf16 and strategy != "ddp" else 4
    accum = setup.gradient_accumulation_steps > 1
    # --accumulate_sharded: the shards' gradients are kept between micro-batches, not full ones
    sharded = accum and options.accumulate_sharded
    accum = accum and not sharded
    kept = {"parameters": states["parameters"], "optimizer_states": states["optimizer_states"]}
    forward_acts = acts["saved"] + acts["weight_copies"] + max(acts["recompute"], acts["logits"])
    at = {}
    if strategy == "ddp":
        naive = impl == "minidist" and options.value("ddp_variant") == "naive"
        if not naive:
            kept["buckets"] = 4 * num_params  # one fp32 copy of every gradient, from the wrap on
        at["forward"] = {**kept, "activations": forward_acts,
                         "accumulated gradients": 4 * num_params if accum else 0}
        # A weight used twice (an embedding tied to the output layer) gets a second whole gradient
        # from the embedding's backward, the last; autograd's sum of the two is a third tensor
        # until it replaces the first (a bucket view cannot be added into in place): 8 bytes an
        # element.
        at["backward"] = {**kept, "gradients": 4 * num_params, "tied weight's second gradient": 8 * shape.tied_params}
        # PyTorch's DDP keeps the gradients beside the buckets; minidist's become views of them.
        grads = 0 if impl == "minidist" and not naive else 4 * num_params
        at["step"] = {**kept, "gradients": grads, "optimizer step temporary": 4 * num_params}
    elif strategy in ("zero1", "zero2"):
        weight_bytes = 2 if bf16 else 4  # the model's own weights and gradients: bf16 under mixed precision
        sizes = buckets([numel for _, numel in shape.param_rows], int(options.value("bucket_cap_mb") * 2**20))
        cast = 4 if bf16 else 0  # a bf16 gradient cast to fp32 for the reduction
        if strategy == "zero1":
            kept["gradients"] = weight_bytes * num_params  # flat gradient buffers, kept from step to step
            at["forward"] = {**kept, "activations": forward_acts}
            at["backward"] = {**kept, "reduce-scatter": max((cast + 4 * gloo) * bucket + 4 * _shard(bucket, ranks)
                                                            for bucket in sizes)}
        else:  # the shards' gradients come in backward (`_zero2_backward`); sharded: they are there already
            at["forward"] = {**kept, "activations": forward_acts,
                             "accumulated gradients": weight_bytes * num_params if accum else 0,
                             "gradients": states["gradients"] if sharded else 0}
            # the shards' gradients: in the weights' dtype, or with --accumulate_sharded in the reduction's
            shard_bytes = (2 if options.value("reduce_dtype") == "bf16" else 4) if options.accumulate_sharded else weight_bytes
            at["backward"] = {**kept, **_zero2_backward(sizes, ranks, shard_bytes, acts["saved"], num_params,
                                                        weight_bytes if accum else 0, options.cpu_offload,
                                                        shape.head_linear_params,
                                                        states["gradients"] if sharded else None)}
            kept["gradients"] = states["gradients"]  # all of them, for the step
            cast = 0 if shard_bytes == 4 else cast  # fp32 shards' gradients: no copy for the step
        # Per group of buckets (zero.STEP_BYTES of masters): the fp32 copies of bf16 gradient
        # shards and AdamW's temporary; then each bucket's all-gather.
        groups = pack_buckets([torch.empty(_shard(bucket, ranks), device="meta") for bucket in sizes], STEP_BYTES)
        at["step"] = {**kept, "optimizer step temporary": max((cast + 4) * sum(shard.numel() for shard in group)
                                                              for group in groups)}
        # The all-gather: the shard sent, a copy.
        at["refresh"] = {**kept, "all-gather": max(weight_bytes * _shard(bucket, ranks) for bucket in sizes)}
    else:  # the shards' gradients come in backward
        if sharded:  # every unit's shard gradient, from the earlier micro-batches (on the host with offload)
            kept["host gradients" if options.cpu_offload else "gradients"] = states["gradients"]
        at.update(_fsdp(shape, whole or shape, setup, kept, acts, compute_bytes, gloo, accum, sharded))
        kept.pop("host gradients", None)
        # AdamW's temporary is the size of the fp32 shard it steps, as is the shard's gradient.
        at["step"] = {**kept, "gradients": states["gradients"], "optimizer step temporary": states["gradients"]}
    return at


def _zero2_backward(sizes, ranks, grad_bytes, saved, num_params, accumulated, offload=False, head=0,
                    kept_shards=None) -> dict:
    """ZeRO-2, bucket by bucket in backward's order, at the two moments that can peak:
    - a bucket opens (its first gradient came): its flat fp32 gradient is allocated beside the
      one on the wire (fp32 input and output shard), while the activations of its layers and of
      those still to come are alive, and with accumulation (`accumulated` bytes per element) so
      are the kept gradients of its parameters and of those still to come (each goes once it is
      copied into the flat buffer); the first bucket opens with the output layer's gradient as
      autograd made it (`head` elements), before it is copied in;
    - a bucket is sent: the previous one's collective is done, the flat buffer and its output shard.
    The shards' gradients (`grad_bytes` per element) are made by the reduce-scatters and let go by
    `zero_grad`, so only the buckets already reduced hold theirs. With `offload` those are in host
    memory (`offload_split.py`): the device's worst moment is sought without them. `kept_shards`
    (bytes; --accumulate_sharded): every bucket's shard gradient is there from the start, and each
    reduce-scatter's output is added into it, in place."""

    def on_device(moment: dict) -> int:
        return sum(nbytes for term, nbytes in moment.items() if not (offload and term == "gradients"))

    worst, done, landed = {}, 0, kept_shards or 0
    if kept_shards is not None:
        grad_bytes = 0  # a bucket's reduction adds into its shard's gradient: nothing new lands
    for i, bucket in enumerate(sizes):
        previous = sizes[i - 1] if i else 0
        on_wire = 4 * previous + 4 * _shard(previous, ranks) if i else 0
        first = i == 0 and not accumulated  # the output layer's gradient, being made
        opening = {"buckets in flight": 4 * bucket + on_wire + (grad_bytes * head if first else 0),
                   "gradients": landed - grad_bytes * _shard(previous, ranks),
                   "activations still saved": saved * (num_params - done) // num_params,
                   "accumulated gradients": accumulated * (num_params - done)}
        sending = {"buckets in flight": 4 * bucket + 4 * _shard(bucket, ranks), "gradients": landed,
                   "activations still saved": saved * max(num_params - done - bucket, 0) // num_params,
                   "accumulated gradients": accumulated * (num_params - done - bucket)}
        for moment in (opening, sending):
            if on_device(moment) > on_device(worst):
                worst = moment
        done += bucket
        landed += grad_bytes * _shard(bucket, ranks)
    return worst


class _Timeline:
    """Bytes alive as a strategy allocates and frees, by term; keeps the breakdown at the peak."""

    def __init__(self, kept: dict):
        self.live, self.worst = dict(kept), dict(kept)

    def add(self, term: str, nbytes: float) -> None:
        self.live[term] = self.live.get(term, 0) + nbytes
        if sum(self.live.values()) > sum(self.worst.values()):
            self.worst = dict(self.live)


def _fsdp(trained, whole, setup, kept, acts, compute_bytes, gloo, accum, sharded=False) -> dict:
    """FSDP, walked unit by unit through the last micro-batch's forward and backward (`_FsdpWalk`).

    Units: one per decoder layer and the root (embeddings, final norm, output layer), or the
    whole model as one unit without the wrap policy. What each moment allocates:
    - a gather (in bf16, of a bf16 copy of the fp32 shard): minidist all-gathers straight into
      the unit's full buffer; FSDP2 into a buffer of its own, then copies out into the weights,
      and lets the buffer go (in forward, only at the next unit's copy-out);
    - forward: the root is gathered first (minidist starts the first layer's gather before it
      waits for the root's) and stays gathered while the layers run, and on into backward (both
      implementations: FSDP2's reshard_after_forward=False for the root); each layer is gathered
      with the next one prefetched, and freed after its forward; activations grow layer by layer;
    - backward: the output layer's gradient comes first, the embedding's last. Per layer: the
      unit is gathered with the one before prefetched, a checkpointed layer's activations come
      back, the weights' gradients arrive while the activations go; the unit is freed, and the
      previous unit's reduce-scatter is waited for (its input goes, its output is the shard's
      gradient): FSDP2 does both in its post-backward, minidist just before its autograd
      concatenates the weights' gradients into one flat gradient (split's backward; both alive
      for a moment; a unit with frozen LoRA weights is freed after it). Then the gradient is cast
      or copied to an fp32 reduce-scatter input (minidist in fp32 sends the flat gradient
      itself), with its output shard. Under FSDP2, gloo copies a reduce-scatter's input while the
      collective runs;
    - accumulation: the `no_sync` micro-batches before this one left every unit's full gradient,
      in the fp32 reduce dtype (both implementations); this backward adds into it. minidist adds
      the new gradient into that sum at the unit's post-backward and reduce-scatters the sum
      itself: no fp32 copy is made for the reduction;
    - sharded accumulation (`sharded`): no full gradient is kept, the shards' gradients are (in
      `kept`), and each reduce-scatter's output is added into its unit's, then let go.
    Under LoRA (`whole` is the model, `trained` its adapters) a unit is gathered whole, but only
    its adapters get gradients and are reduced; minidist's frozen shard is kept in the compute
    dtype, so only the trainable one is cast to be sent (FSDP2 keeps both in fp32, and casts
    both). A unit with nothing to train stays gathered until backward ends, except minidist's
    root, freed when the last layer's backward begins (`parallel/frozen.py`)."""
    walk = _FsdpWalk(trained, whole, setup, kept, acts, compute_bytes, gloo, accum, sharded)
    forward = walk.forward()
    return {"forward": forward, "backward": walk.backward()}


class _FsdpWalk(_Timeline):
    """The timeline of one FSDP rank, walked in the order FSDP gathers, reduces and frees (`_fsdp`).

    A unit is a pair of element counts, (gathered, trained): the whole unit, and its trainable
    part (the same without LoRA)."""

    def __init__(self, trained, whole, setup, kept, acts, compute_bytes, gloo, accum, sharded=False):
        self.ranks, self.torch_impl = setup.world_size, setup.options.impl == "torch"
        self.sharded = sharded  # --accumulate_sharded: each output shard is added into the kept one
        self.acts, self.compute_bytes, self.accum = acts, compute_bytes, accum
        self.kept_acts, self.rest = acts["kept_by_layer"], acts["saved"] - sum(acts["kept_by_layer"])
        if setup.options.layer_wrap_policy and whole.layer_params:
            self.root = (whole.root_params, trained.root_params)
            self.layers = list(zip(whole.layer_param_counts, trained.layer_param_counts))
        else:
            self.root, self.layers, self.rest = (whole.num_params, trained.num_params), [], acts["saved"]
        self.head = trained.head_linear_params if self.layers else self.root[1]  # the output layer's trained part
        self.kept_grad = 4  # bytes per element of the accumulated full gradients: the fp32 reduce dtype
        super().__init__({**kept, "accumulated gradients": self.kept_grad * trained.num_params if accum else 0})
        # minidist's offload keeps the compute-dtype shard on the device: it is sent as it is.
        self.offload = setup.options.cpu_offload and not self.torch_impl
        self.gradients_to_host = setup.options.cpu_offload  # each shard's gradient is copied out to the host
        self.lingering = 0  # FSDP2: the last all-gather buffer, let go at the next copy-out
        self.single = self.torch_impl and self.ranks == 1  # FSDP2 on one rank: no collectives, the shard is the unit
        self.full = "accumulated gradients" if accum else "gradients"  # where a unit's full gradient ends up
        # A weight's new gradient waits for the unit's post-backward, except in FSDP2 accumulating in
        # the weights' own dtype (fp32): autograd adds it into the kept gradient at once.
        self.fresh = 0 if self.torch_impl and accum and compute_bytes == 4 else compute_bytes
        self.pending = []  # the unit whose reduce-scatter is on the wire: (its size, its fp32 input, its output)
        # Bytes per element of gloo's copy of a reduce-scatter's input, while it runs. minidist's input is
        # scratch, all-reduced in place on gloo (`comm.reduce_scatter`): no copy.
        self.gloo_copy = 4 * gloo if self.torch_impl else 0

    def sent_copy(self, unit) -> int:
        """Bytes of the bf16 copy of the fp32 shard that a gather sends: every flat's under FSDP2,
        minidist's trainable one, as its frozen shard is in the compute dtype already. None in fp32,
        nor under minidist's offload."""
        if self.compute_bytes != 2 or self.offload:
            return 0
        return self.compute_bytes * _shard(unit[0] if self.torch_impl else unit[1], self.ranks)

    def held(self, unit) -> int:
        """Bytes a gathered unit holds: its full weights in the compute dtype. FSDP2 on one rank
        gathers nothing: in fp32 the weights are views of the shard, in bf16 a copy."""
        if self.single and self.compute_bytes != 2:
            return 0
        return self.compute_bytes * unit[0]

    def start_gather(self, unit) -> None:
        if self.single:
            self.add("gathered units", self.held(unit))
            return
        self.add("gathered units", self.compute_bytes * unit[0] + self.sent_copy(unit))

    def finish_gather(self, unit, linger=False) -> None:
        if self.single:
            return
        if self.torch_impl:  # copy out of the all-gather buffer into the weights
            self.add("gathered units", self.compute_bytes * unit[0])
            self.add("gathered units", -self.compute_bytes * self.lingering)  # the previous buffer, if it was kept
            self.lingering = unit[0] if linger else 0
            # This one's buffer goes now, or at the next copy-out.
            self.add("gathered units", 0 if linger else -self.compute_bytes * unit[0])
        self.add("gathered units", -self.sent_copy(unit))

    def gather(self, unit, prefetch, linger=False) -> None:
        """This unit, now; the next one, started."""
        if unit:
            self.finish_gather(unit, linger)
        if prefetch:
            self.start_gather(prefetch)

    def forward(self) -> dict:
        """Forward through the root and the layers: the worst moment of it. What is alive at its end
        is where backward starts."""
        self.start_gather(self.root)
        if self.torch_impl:
            self.finish_gather(self.root, linger=True)
        if self.layers:
            self.start_gather(self.layers[0])
        if not self.torch_impl:  # minidist: the first layer's gather in flight with the root's
            self.finish_gather(self.root)
        for i, unit in enumerate(self.layers):
            self.gather(unit, self.layers[i + 1] if i + 1 < len(self.layers) else None, linger=True)
            self.add("activations", self.kept_acts[i])
            self.add("gathered units", -self.held(unit))
        self.add("activations", self.rest + self.acts["weight_copies"])
        # The logits term: two fp32 tensors the logits' size (in forward the fp32 logits and the loss's
        # shifted copy, as backward starts the loss's gradients), beside the saved log-probabilities
        self.add("logits", self.acts["logits"])
        self.add("gathered units", -self.compute_bytes * self.lingering)  # FSDP2: backward's first copy-out lets it go
        self.lingering = 0
        forward, self.worst = self.worst, dict(self.live)
        return forward

    def backward(self) -> dict:
        """Backward from the loss to the embedding: the worst moment of it."""
        root, layers, head = self.root, self.layers, self.head
        self.add("logits", -self.acts["logits"])  # the loss's backward is done with them before the output layer's
        self.add("gradients", self.fresh * head)
        self.add("activations", -self.rest - self.acts["weight_copies"])  # the loss's and the output layer's
        if layers:
            self.start_gather(layers[-1])
        frozen_units = []  # gathered until backward ends
        early = not self.torch_impl and not root[1] and bool(layers)  # minidist frees a frozen root at the last layer's
        # Backward reaches the layers only if something in or before them trains (LoRA on the output
        # layer alone reaches none: the last one, prefetched, stays gathered until backward ends).
        reached = any(trained for _, trained in layers) or root[1] > head
        if layers and not reached:
            self.finish_gather(layers[-1])
            frozen_units.append(layers[-1])
        for i in reversed(range(len(layers)) if reached else []):
            unit, trained = layers[i], layers[i][1]
            if early and i == len(layers) - 1:
                self.add("gathered units", -self.held(root))
            self.gather(unit, layers[i - 1] if i else None)
            self.add("activations", self.acts["recompute_by_layer"][i])
            self.add("gradients", self.fresh * trained)
            self.add("activations", -self.acts["recompute_by_layer"][i] - self.kept_acts[i])
            if not trained:
                frozen_units.append(unit)
                continue
            self.concatenate(unit)
            self.reduce(trained)
        self.add("gradients", self.fresh * (root[1] - head))
        if root[1]:
            self.concatenate(root)
            self.reduce(root[1])
        self.finish_pending()  # at the end of backward
        for unit in frozen_units + ([] if root[1] or early else [root]):
            self.add("gathered units", -self.held(unit))
        return self.worst

    def finish_pending(self) -> None:
        """The reduce-scatter on the wire is waited for: its input goes, its output is the shard's
        gradient."""
        for size, sent, out in self.pending:  # (gloo's copy, FSDP2's only, went in `reduce`)
            self.add("reduce-scatters", -sent - out)
            self.add(self.full, 0 if sent else -self.kept_grad * size)  # no copy was sent: the full gradient was
            # offload: copied out; sharded accumulation: added into the kept shard, then let go
            self.add("host gradients" if self.gradients_to_host else "gradients", 0 if self.sharded else out)
        self.pending.clear()

    def concatenate(self, unit) -> None:
        """The unit's weights all have their gradients: the unit is freed (FSDP2 in its
        post-backward; minidist just before autograd joins the weights' gradients into the unit's
        flat one (split's backward), both alive for a moment, and with the previous unit's
        reduce-scatter finished first (`Unit._before_concatenation`); a minidist unit with frozen
        weights (LoRA) is freed after the joining)."""
        gathered, trained = unit
        frozen = gathered != trained
        if self.torch_impl or not frozen:
            self.add("gathered units", -self.held(unit))
        if not self.torch_impl:
            self.finish_pending()
            self.add("gradients", self.compute_bytes * trained)
            self.add("gradients", -self.compute_bytes * trained)
            if frozen:
                self.add("gathered units", -self.held(unit))

    def reduce(self, trained: int) -> None:
        """A unit whose weights all have this backward's gradients (`trained` elements in the compute
        dtype): reduce-scatter it."""
        if self.accum:
            # Added into the full gradient kept since the first micro-batch.
            self.add("gradients", -self.fresh * trained)
        if self.torch_impl:
            self.finish_pending()
        # minidist sends the flat gradient itself in fp32, and with accumulation the fp32 sum it was added to.
        into = 0 if not self.torch_impl and (self.compute_bytes == 4 or self.accum) else 4 * trained
        self.add("reduce-scatters", into)  # the fp32 input: a cast, or FSDP2's copy
        # Then the gradient it came from goes.
        self.add(self.full, -(self.kept_grad if self.accum else self.compute_bytes) * trained if into else 0)
        self.add("reduce-scatters", 4 * _shard(trained, self.ranks))  # the output shard
        if self.torch_impl:  # FSDP2's collective runs within its post-backward hook
            self.add("reduce-scatters", self.gloo_copy * trained)
            self.add("reduce-scatters", -self.gloo_copy * trained)
        self.finish_pending()
        self.pending.append((trained, into, 4 * _shard(trained, self.ranks)))
