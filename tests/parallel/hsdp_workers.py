"""Worker functions for tests/parallel/test_hsdp.py, run in each rank by `launch(..., nodes=2)`."""

import shutil
from pathlib import Path

from nccl_like import under

from minidist.runtime.distributed import get_env


def one_step_bytes(model_dir, strategies, seq_len=32, micro_batches=1, **options):
    """One optimizer step of each hand-written strategy (`fsdp`, `hsdp`), fp32 unless `options` (of
    `ParallelOptions`) say otherwise, `micro_batches` micro-batches of 2 sequences per rank; return
    per strategy the bytes this rank sent (`across_nodes.take_split`), the padded size of every FSDP
    unit and the mesh this rank saw."""
    from minidist import batches
    from minidist.chess import jsonl
    from minidist.chess.games import bundled_games
    from minidist.hf import models
    from minidist.strategy.options import ParallelOptions
    from minidist.strategy import get_strategy
    from minidist.step import train_step

    env = get_env()
    tokenizer = models.load_tokenizer(model_dir)
    sequences = batches.tokenize_games(jsonl.load_games(bundled_games("train")), tokenizer, seq_len)
    out = {}
    for name in strategies:
        strategy = get_strategy(ParallelOptions(name, "minidist", **options), env)
        model = strategy.wrap(models.load_model(model_dir))
        optimizer = strategy.build_optimizer(model, 1e-3)
        strategy.take_comm_bytes()  # what wrapping sent is not a step's
        first = 2 * micro_batches * env.rank
        micro = [batches.collate(sequences[first + 2 * i:first + 2 * i + 2], tokenizer.pad_token_id)
                 for i in range(micro_batches)]
        num_targets = 2 * micro_batches * env.world_size * seq_len  # any scale will do: bytes do not depend on it
        train_step(model, strategy, micro, num_targets, env.world_size)
        strategy.clip_grad_norm_(model, 1.0)
        optimizer.step()
        mesh = strategy.mesh
        out[name] = {"bytes": strategy.take_comm_bytes(split=True),
                     "units": [u.layout.padded_numel for u in model.units],
                     "shard_size": mesh.shard_size, "replicate_size": mesh.replicate_size,
                     "shard_rank": mesh.shard_rank, "replicate_rank": mesh.replicate_rank,
                     "local": (env.local_rank, env.local_world_size),
                     "grads": [u.flat_param.grad.clone() for u in model.units]}
    return out


def step_bytes_for_each(model_dir, strategies, option_sets, **kwargs):
    """`one_step_bytes` once per set of options, in the same ranks: one start-up for all of them."""
    return [one_step_bytes(model_dir, strategies, **kwargs, **options) for options in option_sets]


def run_finetunes_nccl_like(argvs, nccl_like=()):
    """`train_workers.run_finetunes`, with the runs whose index is in `nccl_like` under the NCCL-like
    harness (`tests/nccl_like.py`): one start-up for the plain runs and their twins."""
    from train_workers import run_finetune

    results = []
    for i, argv in enumerate(argvs):
        with under(i in nccl_like) as harness:
            results.append(run_finetune(argv))
        results[-1]["collectives_deferred"] = harness.deferred if harness else 0
    return results


def everything(model_dir, argvs, nccl_like, resumes):
    """All of test_hsdp.py's runs, one after the other in the same ranks: one start-up for all of them.

    - `run_finetunes_nccl_like(argvs, nccl_like)`, every run uninterrupted;
    - then each run of `resumes`, (checkpoint, folder, argv), resumed in a fresh folder from a copy
      of its checkpoint (rank 0 copies it between two barriers: after every rank wrote it, before
      any rank reads the copy);
    - then offload's placement (`offload_workers.where_things_live`, hsdp) and one step's bytes of
      fsdp and hsdp (`one_step_bytes`).
    """
    import torch.distributed as dist
    from offload_workers import where_things_live
    from train_workers import run_finetunes

    whole = run_finetunes_nccl_like(argvs, nccl_like)
    dist.barrier()  # the runs leave the group up: every rank has written all it saves
    if get_env().rank == 0:
        for checkpoint, folder, _ in resumes:
            shutil.copytree(checkpoint, Path(folder) / Path(checkpoint).name)
    dist.barrier()
    resumed = run_finetunes([argv for _, _, argv in resumes])
    return {"whole": whole, "resumed": resumed, "offload": where_things_live(model_dir, ("hsdp",)),
            "step_bytes": one_step_bytes(model_dir, ["fsdp", "hsdp"])}
