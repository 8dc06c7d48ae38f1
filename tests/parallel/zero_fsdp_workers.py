"""Worker functions for tests/parallel/test_zero_fsdp.py, run in each rank by `launch`.

One launch trains many variants one after the other in the same ranks: starting the processes
and importing transformers costs more on 2 cores than a 5-step variant of these tiny models.
Each variant returns what the tests hold to account: losses, gradient norms, every parameter by
name (rank 0), bytes sent per optimizer step, model-state bytes after each step, the flat
buffers' sizes and, for FSDP, how many units were gathered at once.
"""

import time

import torch

from minidist.runtime.distributed import get_env


def variant_name(strategy, mixed_precision="fp32", wrap=True, checkpointing=False, meta=False, cpu_offload=False,
                 impl="minidist", nccl_like=False, accumulate_sharded=False, hsdp_shard_size=None) -> str:
    """A readable key: `fsdp/no-wrap/ckpt`, `zero2/bf16`, `fsdp/meta`, `torch/fsdp/offload`, `zero1/nccl-like`,
    `hsdp/sharded-accum`."""
    parts = [*(["torch"] if impl == "torch" else []), strategy, *(["bf16"] if mixed_precision == "bf16" else []),
             *([] if wrap else ["no-wrap"]), *(["ckpt"] if checkpointing else []), *(["meta"] if meta else []),
             *(["offload"] if cpu_offload else []), *(["nccl-like"] if nccl_like else []),
             *(["sharded-accum"] if accumulate_sharded else [])]
    return "/".join(parts)


def _flats(model, strategy):
    """The flat layouts of a wrapped model: ZeRO's buckets, FSDP's units; none for DDP or PyTorch's FSDP2."""
    return [flat.layout for flat in model.flats()] if hasattr(model, "flats") else []


def run_plan(plan, global_batch, seq_len, lr, bucket_cap_mb):
    """Train every variant of every entry of `plan`, in this rank; return {key: {variant: result}}.

    An entry is (key, model folder, accumulation steps, variants), a variant a dict of
    `train_one`'s keyword arguments. The global batch stays `global_batch` sequences: each rank
    runs `accumulation` micro-batches of global_batch / (world_size x accumulation)."""
    from minidist import batches
    from minidist.chess import jsonl
    from minidist.chess.games import bundled_games
    from minidist.hf import models

    env = get_env()
    loaded = {}
    results = {}
    for key, model_dir, accum, variants in plan:
        if model_dir not in loaded:
            tokenizer = models.load_tokenizer(model_dir)
            games = jsonl.load_games(bundled_games("train"))
            loaded[model_dir] = tokenizer, batches.tokenize_games(games, tokenizer, seq_len)
        tokenizer, sequences = loaded[model_dir]
        micro_batch = global_batch // (env.world_size * accum)
        sampler = batches.GlobalBatchSampler(len(sequences), global_batch, seed=0)
        results[key] = {variant_name(**{k: v for k, v in kw.items() if k != "steps"}):
                        train_one(model_dir, tokenizer, sequences, sampler, micro_batch, lr, bucket_cap_mb, **kw)
                        for kw in variants}
    return results


def train_one(model_dir, tokenizer, sequences, sampler, micro_batch, lr, bucket_cap_mb, *, nccl_like=False, **variant):
    """`train_variant`, under the NCCL-like harness (`tests/nccl_like.py`) with nccl_like=True: every
    collective from wrapping to the gathered weights deferred to its `wait()`, minidist on its
    NCCL branches; the result says then how many collectives it deferred, and how many host tensors
    (`--cpu_offload`) went to a collective through `flat.collective_device`, as a GPU rank sends them
    through its GPU."""
    from nccl_like import under

    with under(nccl_like) as harness:
        result = train_variant(model_dir, tokenizer, sequences, sampler, micro_batch, lr, bucket_cap_mb, **variant)
    if nccl_like:
        result.update(collectives_deferred=harness.deferred, host_tensors_routed=harness.routed_count)
    return result


def train_variant(model_dir, tokenizer, sequences, sampler, micro_batch, lr, bucket_cap_mb, *, strategy, steps,
                  mixed_precision="fp32", wrap=True, checkpointing=False, meta=False, cpu_offload=False,
                  impl="minidist", accumulate_sharded=False, hsdp_shard_size=None):
    """Train one variant from weights that differ by rank; return what the tests check.

    Rank 0 keeps the weights in `model_dir`; the other ranks add noise to theirs before wrapping
    or, with meta=True, build the model on the meta device through FSDP's `load_model`. Either
    way only the broadcast (ZeRO, DDP) or the scatter (FSDP) at wrap time can make the runs
    agree with the single-process reference."""
    from minidist.hf import models
    from minidist.memory import measure
    from minidist.strategy.options import ParallelOptions
    from minidist.strategy import get_strategy
    from train_workers import train_steps

    env = get_env()
    started = time.perf_counter()
    torch.manual_seed(env.rank)
    options = {"bucket_cap_mb": bucket_cap_mb} if strategy not in ("fsdp", "hsdp") else {}  # several buckets, not one
    options.update({"hsdp_shard_size": hsdp_shard_size} if hsdp_shard_size else {})
    apart = impl == "minidist"  # PyTorch's FSDP2 shards each rank's own weights, with no broadcast: not apart
    impl = get_strategy(ParallelOptions(strategy, impl, layer_wrap_policy=wrap, mixed_precision=mixed_precision,
                                        cpu_offload=cpu_offload, accumulate_sharded=accumulate_sharded, **options), env)
    if meta:  # FSDP: rank 0 reads the weights, the others only build shapes
        model = impl.load_model(model_dir)
        assert all(p.is_meta for p in model.parameters()) == (env.rank > 0)
        checksum_before = None
    else:
        model = models.load_model(model_dir)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * env.rank * apart)
        checksum_before = sum(p.double().sum().item() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # a tied weight once
    if checkpointing:
        impl.checkpoint_activations(model)
    model = impl.wrap(model)
    optimizer = impl.build_optimizer(model, lr)
    impl.take_comm_bytes()  # what wrapping sent is not a step's
    # memory: model-state bytes after each optimizer step, before zero_grad
    losses, grad_norms, comm_bytes, memory = train_steps(
        model, impl, optimizer, sequences, sampler, tokenizer.pad_token_id, micro_batch, steps,
        after_optimizer_step=lambda: measure.model_state_bytes(model, optimizer))
    flats = _flats(model, strategy)
    result = {
        "losses": losses, "grad_norms": grad_norms, "comm_bytes": comm_bytes, "memory": memory,
        "checksum_before": checksum_before, "trainable": trainable, "num_flat": len(flats),
        "numel": sum(f.numel for f in flats), "padded_numel": sum(f.padded_numel for f in flats),
        "optimizer_tensors": len(optimizer.param_groups[0]["params"]),
        "parameters": impl.full_state_dict(model),  # every rank takes part; rank 0 gets it
        "seconds": time.perf_counter() - started,  # for choosing what a launch can afford
    }
    if strategy in ("fsdp", "hsdp") and impl.options.impl == "minidist":
        result.update(max_unsharded=model.max_unsharded, unsharded_after=model.unsharded,
                      num_layer_units=len(model.layer_units), root_numel=model.root.layout.padded_numel)
    return result


def sharded_optimizer_matches_its_inner_optimizer(steps=5):
    """ZeRO-1 used as an optimizer alone (`zero.ShardedOptimizer`), around AdamW and around SGD
    with momentum, against the same optimizer unsharded. Every rank computes the same gradient
    here (the same batch, no averaging needed), so the two must agree to rounding; each rank
    keeps the optimizer state of its shard only."""
    import copy

    from torch import nn

    from minidist.strategy.options import ADAMW_BETAS
    from minidist.parallel.zero import ShardedOptimizer

    env = get_env()
    results = {}
    for name, cls, kwargs in [("AdamW", torch.optim.AdamW, dict(lr=1e-2, betas=ADAMW_BETAS, weight_decay=0.1)),
                              ("SGD", torch.optim.SGD, dict(lr=1e-2, momentum=0.9))]:
        torch.manual_seed(0)  # the same model on every rank
        reference = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))  # odd sizes: padded shards
        sharded = copy.deepcopy(reference)
        plain = cls(reference.parameters(), **kwargs)
        zero1 = ShardedOptimizer(sharded.parameters(), cls, bucket_cap_mb=400 / 2**20, **kwargs)  # 400 bytes
        data = torch.Generator().manual_seed(1)  # the same batches on every rank
        for _ in range(steps):
            x = torch.randn(8, 7, generator=data)
            for model, optimizer in ((reference, plain), (sharded, zero1)):
                optimizer.zero_grad()
                model(x).pow(2).mean().backward()
                optimizer.step()
        diff = max((a - b).abs().max().item() for a, b in zip(reference.parameters(), sharded.parameters()))
        state = sum(t.numel() for s in zero1.state.values() for t in s.values() if t.dim() > 0)
        results[name] = {"max_diff": diff, "state_numel": state, "num_buckets": len(zero1.buckets),
                         "numel": sum(p.numel() for p in reference.parameters()), "rank": env.rank}
    return results


def fsdp_full_gradients_alive_at_once(model_dir, collectives_keep_inputs=False):
    """The most full unit gradients whose memory is held at once during one backward of the
    hand-written FSDP, counted with weak references: a gradient counts until nothing holds it any
    more or its storage has been freed.

    `collectives_keep_inputs` keeps every collective's handle until backward ends. A handle holds
    its input tensors, as gloo's worker thread does for a moment after each collective completes
    (until the thread is next scheduled): the gradients must go even then."""
    import weakref

    import torch.distributed as dist

    from minidist.hf import models
    from minidist.parallel import fsdp
    from minidist.strategy.options import ParallelOptions
    from minidist.strategy import get_strategy

    env = get_env()
    alive, most, kept = [], 0, []
    post_backward, all_reduce = fsdp.Unit._post_backward, dist.all_reduce

    def held(ref):
        return ref() is not None and ref().untyped_storage().nbytes() > 0

    def watched(unit, full):
        nonlocal most
        alive.append(weakref.ref(full.grad))  # in fp32 it is the reduce-scatter's input itself
        most = max(most, sum(map(held, alive)))
        post_backward(unit, full)

    def keeping(*args, **kwargs):
        kept.append(all_reduce(*args, **kwargs))
        return kept[-1]

    fsdp.Unit._post_backward = watched  # before wrapping: the units' hooks bind it then
    if collectives_keep_inputs:
        dist.all_reduce = keeping  # gloo's reduce-scatter of a scratch input is an all-reduce (comm.py)
    try:
        model = get_strategy(ParallelOptions("fsdp", "minidist"), env).wrap(models.load_model(model_dir))
        ids = torch.randint(4, 100, (2, 16), generator=torch.Generator().manual_seed(env.rank))
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    finally:
        fsdp.Unit._post_backward, dist.all_reduce = post_backward, all_reduce
    return {"most": most, "units": len(model.units), "kept": len(kept),
            "reduced": all(u.flat_param.grad is not None for u in model.units)}


def zero2_flat_gradients_alive_at_once(model_dir):
    """The most flat gradient buffers the hand-written ZeRO-2 holds at once during one backward
    (the bucket filling, the one on the wire, any other), read after every gradient's hook. The
    buckets hold about one and a half decoder layers, so their edges fall inside layers, as the
    25 MB default's do in the benchmark's model: a layer's `input_layernorm` comes last in
    backward but is packed before its attention weights."""
    from minidist.hf import models
    from minidist.parallel import zero
    from minidist.strategy.options import ParallelOptions
    from minidist.strategy import get_strategy

    env = get_env()
    model = models.load_model(model_dir)
    cap_mb = 1.5 * 4 * sum(p.numel() for p in model.model.layers[0].parameters()) / 2**20
    most, on_grad_ready = 0, zero.ZeroDP._on_grad_ready

    def watched(self, param):
        nonlocal most
        on_grad_ready(self, param)
        most = max(most, sum(b.grad is not None for b in self.buckets))

    zero.ZeroDP._on_grad_ready = watched  # before wrapping: the gradient hooks bind it then
    try:
        wrapped = get_strategy(ParallelOptions("zero2", "minidist", bucket_cap_mb=cap_mb), env).wrap(model)
        ids = torch.randint(4, 100, (2, 16), generator=torch.Generator().manual_seed(env.rank))
        wrapped(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    finally:
        zero.ZeroDP._on_grad_ready = on_grad_ready
    return {"most": most, "buckets": len(wrapped.buckets),
            "reduced": all(b.grad_shard is not None and b.grad is None for b in wrapped.buckets)}


def flats_alive_while_saving(model_dir):
    """For FSDP and ZeRO-2 by hand: the most gathered flats alive at once while the strategy
    collects the full weights (the final save) and a full checkpoint's state, and what each rank
    ends up holding."""
    import weakref

    from minidist.hf import models
    from minidist.parallel import flat_state
    from minidist.parallel import flat
    from minidist.strategy.options import ParallelOptions
    from minidist.strategy import get_strategy

    env = get_env()
    results = {}
    for name in ("fsdp", "zero2"):
        strategy = get_strategy(ParallelOptions(name, "minidist", **({} if name == "fsdp" else {"bucket_cap_mb": 0.05})),
                                env)
        model = strategy.wrap(models.load_model(model_dir))
        optimizer = strategy.build_optimizer(model, 1e-3)
        gathered, most = [], 0
        real = flat.gather_flat

        def watched(*args, **kwargs):
            nonlocal most
            out = real(*args, **kwargs)
            gathered.append(weakref.ref(out))
            most = max(most, sum(ref() is not None for ref in gathered))
            return out

        flat.gather_flat = flat_state.gather_flat = watched
        try:
            weights = strategy.full_state_dict(model)
            model_sd, optim_sd = strategy.get_state_dict(model, optimizer, full=True)
        finally:
            flat.gather_flat = flat_state.gather_flat = real
        results[name] = {"most": most, "flats": len(model.flats()), "gathers": len(gathered),
                         "weights": None if weights is None else len(weights), "model_sd": len(model_sd),
                         "optim_flats": len(optim_sd.get("flats", {})),
                         "on_cpu": all(t.device.type == "cpu" for t in (weights or {}).values())}
    return results


def alive_at_once_checks(model_dir):
    """Every one-backward check of test_zero_fsdp.py's last tests, one after the other in the same
    two ranks (one start-up instead of five). Each one puts back what it patched before the next."""
    return {"optimizer": sharded_optimizer_matches_its_inner_optimizer(),
            "fsdp handles-dropped": fsdp_full_gradients_alive_at_once(model_dir, False),
            "fsdp handles-kept": fsdp_full_gradients_alive_at_once(model_dir, True),
            "zero2": zero2_flat_gradients_alive_at_once(model_dir),
            "saving": flats_alive_while_saving(model_dir)}
