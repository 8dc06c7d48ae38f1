"""Worker functions for tests/parallel/test_offload.py, run in each rank by `launch`.

The parity runs reuse `zero_fsdp_workers.run_plan` (variants with `cpu_offload=True`); this module
adds what only offload has: where each tensor lives after a step, and the device/host split of a
whole step's live tensors next to the estimator's.
"""

import torch

from minidist.runtime.distributed import get_env


def _wrapped(model_dir, strategy, mixed_precision, cpu_offload, bucket_cap_mb=0.05):
    from minidist.hf import models
    from minidist.strategy.options import ParallelOptions
    from minidist.strategy import get_strategy

    options = {"bucket_cap_mb": bucket_cap_mb} if strategy not in ("fsdp", "hsdp") else {}
    impl = get_strategy(ParallelOptions(strategy, "minidist", mixed_precision=mixed_precision,
                                        cpu_offload=cpu_offload, **options), get_env())
    model = impl.wrap(models.load_model(model_dir))
    return impl, model, impl.build_optimizer(model, 1e-3)


def _batch(model_dir, batch, seq):
    from minidist import batches
    from minidist.chess import jsonl
    from minidist.chess.games import bundled_games
    from minidist.hf import models

    tokenizer = models.load_tokenizer(model_dir)
    games = jsonl.load_games(bundled_games("train"))
    sequences = batches.tokenize_games(games, tokenizer, seq)
    rank = get_env().rank
    return batches.collate(sequences[rank * batch:(rank + 1) * batch], tokenizer.pad_token_id)


def _step(model, optimizer, batch):
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                use_cache=False)
    out.loss.backward()
    optimizer.step()


def where_things_live(model_dir, strategies=("zero1", "zero2", "fsdp")):
    """After one step of each sharded strategy with --cpu_offload (bf16), which side holds what:
    masters and their gradients on the host, the compute-dtype weights on the device."""
    from minidist.memory import sides  # before wrapping: it learns of the host tensors as they are placed
    from minidist.memory.measure import gradient_shards

    results = {}
    batch = _batch(model_dir, 2, 32)
    for strategy in strategies:
        _impl, model, optimizer = _wrapped(model_dir, strategy, "bf16", True)
        _step(model, optimizer, batch)
        masters = [g for group in optimizer.param_groups for g in group["params"]]
        if strategy in ("fsdp", "hsdp"):
            grads = [u.flat_param.grad for u in model.units]
            device_side = [u.device_shard.tensor for u in model.units]
        else:
            grads = gradient_shards(model) if strategy == "zero2" else []
            device_side = [b.weights for b in model.buckets]
        results[strategy] = {
            "masters_host": all(sides.is_host(m) for m in masters) and len(masters) > 0,
            "masters_fp32": all(m.dtype == torch.float32 for m in masters),
            "grads_host": all(sides.is_host(g) for g in grads), "num_grads": len(grads),
            "device_side_host": any(sides.is_host(t) for t in device_side),
            "device_side_dtype": {str(t.dtype) for t in device_side},
        }
    return results


def measured_split(model_dir, strategy, mixed_precision, batch, seq, bucket_cap_mb, games_path):
    """One whole step of the loop (forward, backward, clipping, the optimizer step), its peak of
    live tensors on this rank split into device and host (`memory/sides.py`). The second step is
    measured: the first creates AdamW's states."""
    from minidist import batches
    from minidist.chess import jsonl
    from minidist.hf import models
    from minidist.memory.sides import SplitLiveTensors
    from minidist.step import train_step

    env = get_env()
    impl, model, optimizer = _wrapped(model_dir, strategy, mixed_precision, True, bucket_cap_mb)
    tokenizer = models.load_tokenizer(model_dir)
    sequences = batches.tokenize_games(jsonl.load_games(games_path), tokenizer, seq)
    mine = batches.collate(sequences[env.rank * batch:(env.rank + 1) * batch], tokenizer.pad_token_id)
    num_targets = sum(len(sequences[i]) - 1 for i in range(env.world_size * batch))

    def step():
        train_step(model, impl, [mine], num_targets, env.world_size)
        impl.clip_grad_norm_(model, 1.0)
        optimizer.step()

    step()
    optimizer.zero_grad(set_to_none=True)
    with SplitLiveTensors(env.device, model, optimizer) as live:
        step()
    return {"device": live.device_peak, "host": live.host_peak, "peak": live.peak}


def measured_splits(model_dir, cases, batch, seq, games_path):
    """`measured_split` for each (strategy, precision, bucket_cap_mb) of `cases`, one after the other
    in the same ranks: one start-up for all of them. Each case's model and optimizer are gone
    (collected) before the next one is measured."""
    import gc

    results = []
    for strategy, precision, bucket_cap_mb in cases:
        results.append(measured_split(model_dir, strategy, precision, batch, seq, bucket_cap_mb, games_path))
        gc.collect()
    return results


def everything(parity, where, resumes, splits):
    """All of test_offload.py's work of one world size, one after the other in the same ranks: one
    start-up for all of them. Each argument is (a call's arguments) or None where this world size
    has none of it; returns {name: what the call returned}, None for those left out.

    - `splits`: `measured_splits(*splits)`, first, as when they had ranks of their own (what they
      measure starts from what the case's model and optimizer reach; each case's are collected
      before the next);
    - `where`: `where_things_live(*where)`;
    - `parity`: `zero_fsdp_workers.run_plan(*parity)`, each variant seeded and built afresh;
    - `resumes`: `train_workers.run_finetunes(*resumes)`, each run in its own folder with its own `--seed`.
    """
    from train_workers import run_finetunes
    from zero_fsdp_workers import run_plan

    calls = {"splits": (measured_splits, splits), "where": (where_things_live, where),
             "parity": (run_plan, parity), "resumes": (run_finetunes, resumes)}
    return {name: None if args is None else fn(*args) for name, (fn, args) in calls.items()}
