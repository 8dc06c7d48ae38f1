"""The moments of a training step where one rank's memory peaks, term by term, per strategy.

`estimator.py` says what a rank holds (model states) and what one micro-batch keeps for backward
(activations). The peak is the most that is alive *at once*, and each strategy allocates and
frees in its own order. Four moments cover the step, as `measure.LiveTensors` sees it:

- **forward**: the end of the last micro-batch's forward. Everything saved for backward, the
  logits moment, autocast's weight copies; with accumulation, the gradients of the earlier
  micro-batches are already there (the first micro-batch finds none: `zero_grad(set_to_none)`).
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

Checked against `LiveTensors` in tests/memory/test_memory.py (within 5%, every strategy). Where the
logits outweigh a layer's activations several times over, FSDP's figure strays further: the
loss's own tensors are one term here ("logits"), not walked operator by operator.
"""

import torch

from minidist.parallel.wrapper import pack_buckets
from minidist.parallel.zero import STEP_BYTES


def buckets(param_numels: list[int], cap_bytes: int) -> list[int]:
    """Elements per bucket, as `zero.ZeroDP` packs them: in reverse registration order (roughly
    backward's), fp32, at most `cap_bytes` (a larger parameter gets a bucket of its own)."""
    metas = [torch.empty(n, device="meta") for n in reversed(param_numels)]
    return [sum(p.numel() for p in run) for run in pack_buckets(metas, cap_bytes)]


def _shard(numel: int, n: int) -> int:
    return -(-numel // n)


def moments(s, setup, states: dict, acts: dict, whole=None) -> dict:
    """{moment: {term: bytes}} for one rank; the peak is the largest sum. `s` is the shape of what
    is trained (LoRA: the adapters, `lora_terms.trained_shape`), `whole` the model's (FSDP's gathers)."""
    o, n, P = setup.options, setup.world_size, s.num_params
    k, impl = o.strategy, o.impl
    gloo = setup.backend == "gloo" and n > 1  # gloo's copies (one rank sends nothing: comm.py copies locally)
    bf16 = o.mixed_precision == "bf16"
    c = 2 if bf16 and k != "ddp" else 4  # bytes of what is computed with (DDP: autocast over fp32 weights)
    accum = setup.gradient_accumulation_steps > 1
    kept = {"parameters": states["parameters"], "optimizer_states": states["optimizer_states"]}
    forward_acts = acts["saved"] + acts["weight_copies"] + max(acts["recompute"], acts["logits"])
    at = {}
    if k == "ddp":
        naive = impl == "minidist" and o.value("ddp_variant") == "naive"
        if not naive:
            kept["buckets"] = 4 * P  # one fp32 copy of every gradient, from the wrap on
        at["forward"] = {**kept, "activations": forward_acts, "accumulated gradients": 4 * P if accum else 0}
        # A weight used twice (an embedding tied to the output layer) gets a second whole gradient
        # from the embedding's backward, the last; autograd's sum of the two is a third tensor
        # until it replaces the first (a bucket view cannot be added into in place): 8 bytes an element.
        at["backward"] = {**kept, "gradients": 4 * P, "tied weight's second gradient": 8 * s.tied_params}
        # PyTorch's DDP keeps the gradients beside the buckets; minidist's become views of them.
        grads = 0 if impl == "minidist" and not naive else 4 * P
        at["step"] = {**kept, "gradients": grads, "optimizer step temporary": 4 * P}
    elif k in ("zero1", "zero2"):
        w = 2 if bf16 else 4  # the model's own weights and gradients: bf16 under mixed precision
        sizes = buckets([numel for _, numel in s.param_rows], int(o.value("bucket_cap_mb") * 2**20))
        cast = 4 if bf16 else 0  # a bf16 gradient cast to fp32 for the reduction
        if k == "zero1":
            kept["gradients"] = w * P  # flat gradient buffers, kept from step to step
            at["forward"] = {**kept, "activations": forward_acts}
            at["backward"] = {**kept, "reduce-scatter": max((cast + 4 * gloo) * b + 4 * _shard(b, n) for b in sizes)}
        else:  # the shards' gradients come in backward (`_zero2_backward`)
            at["forward"] = {**kept, "activations": forward_acts, "accumulated gradients": w * P if accum else 0}
            at["backward"] = {**kept, **_zero2_backward(sizes, n, w, acts["saved"], P, w if accum else 0,
                                                               o.cpu_offload, s.head_linear_params)}
            kept["gradients"] = states["gradients"]  # all of them, for the step
        # Per group of buckets (zero.STEP_BYTES of masters): the fp32 copies of bf16 gradient
        # shards and AdamW's temporary; then each bucket's all-gather.
        groups = pack_buckets([torch.empty(_shard(b, n), device="meta") for b in sizes], STEP_BYTES)
        at["step"] = {**kept, "optimizer step temporary": max((cast + 4) * sum(m.numel() for m in g) for g in groups)}
        at["refresh"] = {**kept, "all-gather": max(w * _shard(b, n) for b in sizes)}  # the shard sent, a copy
    else:
        at.update(_fsdp(s, whole or s, setup, kept, acts, c, gloo, accum))  # the shards' gradients come in backward
        # AdamW's temporary is the size of the fp32 shard it steps, as is the shard's gradient.
        at["step"] = {**kept, "gradients": states["gradients"], "optimizer step temporary": states["gradients"]}
    return at


def _zero2_backward(sizes, n, w, saved, P, accumulated, offload=False, head=0) -> dict:
    """ZeRO-2, bucket by bucket in backward's order, at the two moments that can peak:
    - a bucket opens (its first gradient came): its flat fp32 gradient is allocated beside the
      one on the wire (fp32 input and output shard), while the activations of its layers and of
      those still to come are alive, and with accumulation (`accumulated` bytes per element) so
      are the kept gradients of its parameters and of those still to come (each goes once it is
      copied into the flat buffer); the first bucket opens with the output layer's gradient as
      autograd made it (`head` elements), before it is copied in;
    - a bucket is sent: the previous one's collective is done, the flat buffer and its output shard.
    The shards' gradients (`w` bytes per element) are made by the reduce-scatters and let go by
    `zero_grad`, so only the buckets already reduced hold theirs. With `offload` those are in host
    memory (`offload_split.py`): the device's worst moment is sought without them."""
    weight = lambda now: sum(v for k, v in now.items() if not (offload and k == "gradients"))  # noqa: E731
    worst, done, landed = {}, 0, 0
    for i, b in enumerate(sizes):
        previous = sizes[i - 1] if i else 0
        on_wire = 4 * previous + 4 * _shard(previous, n) if i else 0
        first = i == 0 and not accumulated  # the output layer's gradient, being made
        opening = {"buckets in flight": 4 * b + on_wire + (w * head if first else 0),
                   "gradients": landed - w * _shard(previous, n),
                   "activations still saved": saved * (P - done) // P,
                   "accumulated gradients": accumulated * (P - done)}
        sending = {"buckets in flight": 4 * b + 4 * _shard(b, n), "gradients": landed,
                   "activations still saved": saved * max(P - done - b, 0) // P,
                   "accumulated gradients": accumulated * (P - done - b)}
        for now in (opening, sending):
            if weight(now) > weight(worst):
                worst = now
        done += b
        landed += w * _shard(b, n)
    return worst


class _Timeline:
    """Bytes alive as a strategy allocates and frees, by term; keeps the breakdown at the peak."""

    def __init__(self, kept: dict):
        self.live, self.worst = dict(kept), dict(kept)

    def add(self, term: str, nbytes: float) -> None:
        self.live[term] = self.live.get(term, 0) + nbytes
        if sum(self.live.values()) > sum(self.worst.values()):
            self.worst = dict(self.live)


def _fsdp(s, whole, setup, kept, acts, c, gloo, accum) -> dict:
    """FSDP, walked unit by unit through the last micro-batch's forward and backward.

    Units: one per decoder layer and the root (embeddings, final norm, output layer), or the
    whole model as one unit without the wrap policy. What each moment allocates:
    - a gather (in bf16, of a bf16 copy of the fp32 shard): minidist all-gathers straight into
      the unit's full buffer; FSDP2 into a buffer of its own, then copies out into the weights,
      and lets the buffer go (in forward, only at the next unit's copy-out);
    - forward: the root is gathered first and stays gathered while the layers run; each layer is
      gathered with the next one prefetched, and freed after its forward; activations grow layer
      by layer. minidist frees the root after forward; FSDP2 keeps it gathered for backward;
    - backward: the root is gathered again (minidist); the output layer's gradient comes first,
      the embedding's last. Per layer: the unit is gathered with the one before prefetched, a
      checkpointed layer's activations come back, the weights' gradients arrive while the
      activations go; minidist's autograd concatenates them into one flat gradient (split's
      backward; both for a moment); the gradient is cast or copied to an fp32 reduce-scatter
      input (minidist in fp32 sends the flat gradient itself), with its output shard; the unit
      is freed. The previous unit's reduce-scatter is waited for (by FSDP2 before it starts this
      one, by minidist after): its input goes, its output is the shard's gradient. Under FSDP2,
      gloo copies a reduce-scatter's input while the collective runs;
    - accumulation: the `no_sync` micro-batches before this one left every unit's full gradient,
      in the compute dtype (FSDP2: in its fp32 reduce dtype); this backward adds into it.
    Under LoRA (`whole` is the model, `s` its adapters) a unit is gathered whole, but only its
    adapters get gradients and are reduced; minidist's frozen shard is kept in the compute dtype, so
    only the trainable one is cast to be sent (FSDP2 keeps both in fp32, and casts both). A unit
    with nothing to train stays gathered until backward ends, except minidist's root, freed when
    the last layer's backward begins (`parallel/frozen.py`)."""
    n, torch_impl = setup.world_size, setup.options.impl == "torch"
    kept_acts, rest = acts["kept_by_layer"], acts["saved"] - sum(acts["kept_by_layer"])
    if setup.options.layer_wrap_policy and whole.layer_params:  # (gathered, trained) per unit
        root, layers = (whole.root_params, s.root_params), list(zip(whole.layer_param_counts, s.layer_param_counts))
    else:
        root, layers, rest = (whole.num_params, s.num_params), [], acts["saved"]
    kept_grad = 4 if torch_impl else c  # bytes per element of the accumulated full gradients
    t = _Timeline({**kept, "accumulated gradients": kept_grad * s.num_params if accum else 0})
    offload = setup.options.cpu_offload and not torch_impl  # the compute-dtype shard is kept on the device: sent as it is
    send = lambda u: c * _shard(u[0] if torch_impl else u[1], n) if c == 2 and not offload else 0  # noqa: E731 (a bf16 copy sent:
    # FSDP2 casts every fp32 shard; minidist its trainable one, as its frozen shard is in the compute dtype already)
    lingering = [0]  # FSDP2: the last all-gather buffer, let go at the next copy-out
    single = torch_impl and n == 1  # FSDP2 on one rank: no collectives, the shard is the whole unit
    held = lambda u: (c * u[0] if c == 2 else 0) if single else c * u[0]  # noqa: E731 (fp32 views, or a bf16 copy)

    def start_gather(u):
        if single:
            t.add("gathered units", held(u))
            return
        t.add("gathered units", c * u[0] + send(u))

    def finish_gather(u, linger=False):
        if single:
            return
        if torch_impl:  # copy out of the all-gather buffer into the weights
            t.add("gathered units", c * u[0])
            t.add("gathered units", -c * lingering[0])  # the previous buffer, if it was kept
            lingering[0] = u[0] if linger else 0
            t.add("gathered units", 0 if linger else -c * u[0])  # this one's, now or at the next copy-out
        t.add("gathered units", -send(u))

    def gather(u, prefetch, linger=False):  # this unit, now; the next one, started
        if u:
            finish_gather(u, linger)
        if prefetch:
            start_gather(prefetch)

    start_gather(root)
    finish_gather(root, linger=True)
    if layers:
        start_gather(layers[0])
    for i, u in enumerate(layers):
        gather(u, layers[i + 1] if i + 1 < len(layers) else None, linger=True)
        t.add("activations", kept_acts[i])
        t.add("gathered units", -held(u))
    t.add("activations", rest + acts["weight_copies"])
    t.add("logits", acts["logits"])  # the head's output, its fp32 copy and log-probabilities
    if not torch_impl:
        t.add("gathered units", -c * root[0])
    t.add("gathered units", -c * lingering[0])  # FSDP2: backward's first copy-out lets the last one go
    lingering[0] = 0
    forward, t.worst = t.worst, dict(t.live)
    if not torch_impl:
        start_gather(root)
        finish_gather(root)
    full = "accumulated gradients" if accum else "gradients"  # where a unit's full gradient ends up
    # A weight's new gradient waits for the unit's post-backward, except in FSDP2 accumulating in
    # the weights' own dtype (fp32): autograd adds it into the kept gradient at once.
    fresh = 0 if torch_impl and accum and c == 4 else c
    pending = []  # the unit whose reduce-scatter is on the wire: (its size, its fp32 input, its output)

    # Bytes per element of gloo's copy of a reduce-scatter's input, while it runs. minidist's input is
    # scratch, all-reduced in place on gloo (`comm.reduce_scatter`): no copy.
    copy = 4 * gloo if torch_impl else 0

    def finish_pending():
        for size, sent, out in pending:
            t.add("reduce-scatters", 0 if torch_impl else copy * size)  # minidist's async call: seen at the wait
            t.add("reduce-scatters", -sent - out - (0 if torch_impl else copy * size))
            t.add(full, 0 if sent else -kept_grad * size)  # no copy was sent: the full gradient itself was
            t.add("host gradients" if setup.options.cpu_offload else "gradients", out)  # offload: copied out
        pending.clear()

    def concatenate(u):
        """minidist: autograd joins the weights' gradients into the unit's flat one (split's
        backward), both alive for a moment, before the unit is freed."""
        if not torch_impl:
            t.add("gradients", c * u)
            t.add("gradients", -c * u)

    def reduce(u):
        """A unit whose weights all have this backward's gradients (c u bytes): reduce-scatter it."""
        if accum:
            t.add("gradients", -fresh * u)  # added into the full gradient kept since the first micro-batch
        if torch_impl:
            finish_pending()
        into = 0 if c == 4 and not torch_impl else 4 * u
        t.add("reduce-scatters", into)  # the fp32 input: a cast, or FSDP2's copy
        t.add(full, -(kept_grad if accum else c) * u if into else 0)  # then the gradient it came from goes
        t.add("reduce-scatters", 4 * _shard(u, n))  # the output shard
        if torch_impl:  # FSDP2's collective runs within its post-backward hook
            t.add("reduce-scatters", copy * u)
            t.add("reduce-scatters", -copy * u)
        finish_pending()
        pending.append((u, into, 4 * _shard(u, n)))

    head = s.head_linear_params if layers else root[1]  # the trained part of the output layer
    t.add("logits", -acts["logits"])  # consumed by the output layer's backward, which makes its gradient
    t.add("gradients", fresh * head)
    t.add("activations", -rest - acts["weight_copies"])  # the loss's and the output layer's, used first
    if layers:
        start_gather(layers[-1])
    frozen_units = []  # gathered until backward ends
    early = not torch_impl and not root[1] and bool(layers)  # minidist frees a frozen root at the last layer's
    # Backward reaches the layers only if something in or before them trains (not LoRA on the output layer alone).
    reached = any(trained for _, trained in layers) or root[1] > head
    if layers and not reached:
        finish_gather(layers[-1])
        frozen_units.append(layers[-1])
    for i in reversed(range(len(layers)) if reached else []):
        u, trained = layers[i], layers[i][1]
        t.add("gathered units", -held(root) if early and i == len(layers) - 1 else 0)  # freed at the last layer's
        gather(u, layers[i - 1] if i else None)
        t.add("activations", acts["recompute_by_layer"][i])
        t.add("gradients", fresh * trained)
        t.add("activations", -acts["recompute_by_layer"][i] - kept_acts[i])
        if not trained:
            frozen_units.append(u)
            continue
        concatenate(trained)
        t.add("gathered units", -held(u))
        reduce(trained)
    t.add("gradients", fresh * (root[1] - head))
    if root[1]:
        concatenate(root[1])
        t.add("gathered units", -held(root))
        reduce(root[1])
    finish_pending()  # at the end of backward
    for u in frozen_units + ([] if root[1] or early else [root]):
        t.add("gathered units", -held(u))
    return {"forward": forward, "backward": t.worst}
