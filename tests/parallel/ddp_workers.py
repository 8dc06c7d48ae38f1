"""Worker functions for tests/parallel/test_comm.py and tests/parallel/test_ddp.py, run in each rank by `launch`."""

import torch
import torch.distributed as dist
from torch import nn

from minidist.parallel import comm
from minidist.runtime.distributed import get_env


def run_cases(cases) -> dict:
    """Several cases, one after the other in the same ranks: one start-up for all of them (starting
    a rank costs about 5 CPU s, more than any case here). `cases` is [(key, worker function, its
    arguments)]; returns {key: what the function returned}. Between two cases every rank waits for
    the others (a barrier) and the byte counter (`comm.counter`) starts again from zero, as in a
    fresh rank: a case that counts bytes counts only its own. Each case seeds its own generators;
    the one that patches `comm.all_reduce` (`overlap_order`) puts it back."""
    out = {}
    for key, fn, args in cases:
        comm.counter.reset()
        out[key] = fn(*args)
        dist.barrier()
    return out


def ring_against_library(sizes):
    """For each size: the hand-written ring all-reduce and dist.all_reduce on the same tensors."""
    env = get_env()
    out = []
    for size in sizes:
        generator = torch.Generator().manual_seed(1000 * env.rank + size)
        x = torch.randn(size, generator=generator, dtype=torch.float64)
        integers = torch.randint(-1000, 1000, (size,), generator=generator, dtype=torch.int64)
        expected, expected_int = x.clone(), integers.clone()
        dist.all_reduce(expected)
        dist.all_reduce(expected_int)
        comm.counter.reset()
        comm.ring_all_reduce(x)
        ring_bytes = comm.counter.bytes_sent
        comm.ring_all_reduce(integers)
        out.append({"size": size, "ring": x, "expected": expected, "ring_int": integers,
                    "expected_int": expected_int, "ring_bytes": ring_bytes})
    return out


def collectives_and_their_counts(shard_size):
    """reduce_scatter and all_gather through comm, with the bytes counted for each."""
    env = get_env()
    n = env.world_size
    full = torch.arange(n * shard_size, dtype=torch.float32) * (env.rank + 1)
    shard = torch.empty(shard_size)
    comm.counter.reset()
    comm.reduce_scatter(shard, full)
    rs_bytes = comm.counter.bytes_sent
    gathered = torch.empty(n * shard_size)
    comm.counter.reset()
    comm.all_gather(gathered, shard)
    ag_bytes = comm.counter.bytes_sent
    comm.counter.reset()
    comm.all_reduce(full)
    return {"shard": shard, "gathered": gathered, "all_reduced": full, "rs_bytes": rs_bytes,
            "ag_bytes": ag_bytes, "ar_bytes": comm.counter.bytes_sent}


def scratch_reduce_scatter(shard_size):
    """comm.reduce_scatter with and without `input_is_scratch`: the shard each gives, and the most
    bytes alive during the call (`LiveTensors`, which sees gloo's copy of the input)."""
    from minidist.memory.measure import LiveTensors

    env = get_env()
    n = env.world_size
    out = {}
    for scratch in (False, True):
        full = torch.arange(n * shard_size, dtype=torch.float32) * (env.rank + 1)
        shard = torch.empty(shard_size)
        with LiveTensors(torch.device("cpu"), full, shard) as live:
            comm.reduce_scatter(shard, full, async_op=True, input_is_scratch=scratch).wait()
        out[scratch] = {"shard": shard, "peak": live.peak, "held": (full.numel() + shard.numel()) * 4}
    return out


def ddp_parity(model_dir, micro_batch, accum, steps, seq_len, lr, frozen, bucket_cap_mb):
    """Train the hand-written DDP (naive, then bucketed; fp32, then fp64) from weights that
    differ by rank; then the bucketed one in fp32 again under the NCCL-like harness
    (`tests/nccl_like.py`: its bucket all-reduces deferred to `wait()`, the buckets NaN until
    then), as variant "bucketed/nccl-like". (The naive one's all-reduces are synchronous.)

    Rank 0 keeps the weights in `model_dir`; the other ranks add noise to theirs before wrapping,
    so only the broadcast at wrap time can make the runs agree with the reference.
    """
    from nccl_like import under

    from minidist import batches
    from minidist.chess import jsonl
    from minidist.chess.games import bundled_games
    from minidist.hf import models

    env = get_env()
    tokenizer = models.load_tokenizer(model_dir)
    sequences = batches.tokenize_games(jsonl.load_games(bundled_games("train")), tokenizer, seq_len)
    sampler = batches.GlobalBatchSampler(len(sequences), micro_batch * env.world_size * accum, seed=0)
    results = {}
    variants = [(v, d) for d in (torch.float32, torch.float64) for v in ("naive", "bucketed")]
    for variant, dtype in variants + [("bucketed/nccl-like", torch.float32)]:
        with under(variant.endswith("nccl-like")) as harness:
            results[variant, str(dtype)] = _train_ddp(model_dir, variant.split("/")[0], dtype, tokenizer, sequences,
                                                      sampler, micro_batch, steps, lr, frozen, bucket_cap_mb)
        results[variant, str(dtype)]["collectives_deferred"] = harness.deferred if harness else 0
    return results


def _train_ddp(model_dir, variant, dtype, tokenizer, sequences, sampler, micro_batch, steps, lr, frozen, bucket_cap_mb):
    """One of `ddp_parity`'s runs: what the test checks."""
    from train_workers import train_steps

    from minidist.hf import models
    from minidist.strategy.options import ParallelOptions
    from minidist.strategy import get_strategy

    env = get_env()
    torch.manual_seed(env.rank)
    model = models.load_model(model_dir, dtype=dtype)
    model.get_parameter(frozen).requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * env.rank)
    checksum_before = sum(p.double().sum().item() for p in model.parameters())
    strategy = get_strategy(ParallelOptions("ddp", "minidist", ddp_variant=variant, bucket_cap_mb=bucket_cap_mb), env)
    model = strategy.wrap(model)
    optimizer = strategy.build_optimizer(model, lr)
    strategy.take_comm_bytes()
    losses, _, comm_bytes, _ = train_steps(model, strategy, optimizer, sequences, sampler, tokenizer.pad_token_id,
                                           micro_batch, steps)
    return {
        "losses": losses, "comm_bytes": comm_bytes, "checksum_before": checksum_before,
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "parameters": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
    }


def overlap_order(model_dir, bucket_cap_mb):
    """The interleaving of gradient-ready events and bucket launches in one synced backward."""
    from minidist.hf import models
    from minidist.parallel import ddp

    env = get_env()
    model = models.load_model(model_dir)
    wrapped = ddp.BucketedDDP(model, bucket_cap_mb=bucket_cap_mb)
    order = []
    for p in wrapped.params:
        p.register_post_accumulate_grad_hook(lambda p: order.append("grad"))
    launch = comm.all_reduce

    def counting_all_reduce(*args, **kwargs):
        order.append("all_reduce")
        return launch(*args, **kwargs)

    comm.all_reduce = counting_all_reduce
    try:
        ids = torch.randint(4, 100, (2, 16), generator=torch.Generator().manual_seed(env.rank))
        wrapped(input_ids=ids, use_cache=False).logits.sum().backward()
    finally:  # the ranks may run other cases after this one (`run_cases`)
        comm.all_reduce = launch
    return {"order": order, "num_buckets": len(wrapped.buckets)}


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def unused_parameter_is_named():
    """A parameter that gets no gradient must be reported, not silently left unsynchronised."""
    from minidist.parallel.ddp import BucketedDDP

    model = BucketedDDP(TwoLayers())
    model(torch.ones(2, 4)).sum().backward()
    try:
        model(torch.ones(2, 4))
    except RuntimeError as err:
        return str(err)
    return None
