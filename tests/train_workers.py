"""Worker functions that `minidist.runtime.launch` imports in each spawned rank (see tests/runtime/workers.py)."""

import os

from minidist import finetune


def run_finetune(argv):
    """Train as `torchrun ... -m minidist.finetune ARGV` would, and return the measurements."""
    return finetune.train(finetune.parse_args(argv))


def run_finetunes(argvs):
    """Several runs, one after the other, in the same ranks: one start-up for all of them."""
    return [run_finetune(argv) for argv in argvs]


def run_finetunes_counting_checkpoints(argvs) -> list[int]:
    """Several runs, as `run_finetunes`; for each, the checkpoint's bytes its disk check counted
    (`minidist/checkpoint/disk_room.checkpoint_bytes`, once per start)."""
    from minidist.checkpoint import disk_room

    counted, count = [], disk_room.checkpoint_bytes

    def counting(*args):
        counted.append(count(*args))
        return counted[-1]

    disk_room.checkpoint_bytes = counting
    try:
        run_finetunes(argvs)
    finally:
        disk_room.checkpoint_bytes = count
    return counted


def run_finetunes_then_refusal(argvs, refused_argv) -> tuple[list, str | None]:
    """`run_finetunes(argvs)`, then the one line that a run stopping on a usage mistake says (None
    if it trains instead), in the same ranks."""
    from minidist.runtime.errors import UsageError

    results = run_finetunes(argvs)
    try:
        run_finetune(refused_argv)
    except UsageError as err:
        return results, str(err)
    return results, None


def train_steps(model, strategy, optimizer, sequences, sampler, pad_token_id, micro_batch, steps,
                after_optimizer_step=None) -> tuple[list, list, list, list]:
    """The loop's step, bare, for the parity workers (tests/parallel/): each step, this rank's
    micro-batches of the global batch, `train_step`, clipping at 1.0, the optimizer's step.

    Returns, one entry per step: the global batch's mean token loss (all ranks' sums, over all its
    targets), the gradient norm before clipping, the bytes sent, and what `after_optimizer_step()`
    returned between the optimizer's step and `zero_grad` (nothing when it is not given)."""
    import torch.distributed as dist

    from minidist import batches
    from minidist.runtime.distributed import get_env
    from minidist.step import train_step

    env = get_env()
    losses, grad_norms, comm_bytes, after = [], [], [], []
    for step in range(steps):
        global_ids = sampler.global_batch(step)
        num_targets = sum(len(sequences[i]) - 1 for i in global_ids)
        micro_batches = [batches.collate([sequences[i] for i in ids], pad_token_id)
                         for ids in sampler.micro_batches(step, env.rank, env.world_size, micro_batch)]
        loss_sum = train_step(model, strategy, micro_batches, num_targets, env.world_size)
        grad_norms.append(float(strategy.clip_grad_norm_(model, 1.0)))  # of the averaged gradient, before clipping
        optimizer.step()
        if after_optimizer_step is not None:
            after.append(after_optimizer_step())
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)
        losses.append(loss_sum.item() / num_targets)
        comm_bytes.append(strategy.take_comm_bytes())
    return losses, grad_norms, comm_bytes, after


def evaluate_sharded(model_dir, strategy_name, num_prefixes, impl="torch"):
    """The legal-move rate of a model wrapped by `strategy_name`, each rank judging its share, and
    (`continuations`) the greedy continuation of every prefix, each rank writing them all."""
    from minidist.chess import jsonl, legal_moves
    from minidist.chess.games import bundled_games
    from minidist.hf import models
    from minidist.runtime.distributed import get_env
    from minidist.strategy.options import ParallelOptions
    from minidist.strategy import get_strategy

    env = get_env()
    tokenizer = models.load_tokenizer(model_dir)
    strategy = get_strategy(ParallelOptions(strategy_name, impl), env)
    model = strategy.wrap(models.load_model(model_dir))
    prefixes = legal_moves.game_prefixes(jsonl.load_games(bundled_games("test")), num_prefixes)
    # generation through the strategy's wrapper, as the loop does (`Strategy.continue_fn`)
    result = legal_moves.legal_move_rate(model, tokenizer, prefixes, env.device, batch_size=2,
                                         continue_fn=strategy.continue_fn())
    new_tokens = legal_moves.tokens_per_move(tokenizer) + 1
    prompts = [" ".join(p) for p in prefixes]
    return {**result, "continuations": legal_moves.greedy_continue(model, tokenizer, prompts, new_tokens, env.device,
                                                                   ready=strategy.ready_to_generate)}


def run_finetunes_then_leave(argvs):
    """Several runs, then `cleanup`: how many gloo worker threads does the process still run?"""
    from minidist.runtime.distributed import cleanup

    run_finetunes(argvs)
    cleanup()
    return gloo_worker_threads()


def gloo_worker_threads() -> int:
    """How many gloo worker threads (`pt_gloo...`) this process runs; Linux only (0 elsewhere)."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return 0
    names = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while we looked
            pass
    return sum(name.startswith("pt_gloo") for name in names)


def count_host_syncs(argvs) -> list:
    """Several runs, each step under `minidist.runtime.host_syncs.HostSyncs`: for each run, what
    it counted on this rank (tests/loop/test_host_syncs.py)."""
    from minidist.runtime.host_syncs import HostSyncs

    counted = []
    for argv in argvs:
        syncs = HostSyncs("cpu")
        finetune.train(finetune.parse_args(argv), around_step=syncs.step)
        counted.append(syncs)
    return counted


def run_finetunes_then_refusals(argvs, refused_argvs) -> tuple[list, list]:
    """`run_finetunes(argvs)`, then each of `refused_argvs` in turn: the one line each says (None
    where it trains instead), in the same ranks."""
    from minidist.runtime.errors import UsageError

    results, lines = run_finetunes(argvs), []
    for argv in refused_argvs:
        try:
            run_finetune(argv)
            lines.append(None)
        except UsageError as err:
            lines.append(str(err))
    return results, lines


def count_reduce_scatters(argvs) -> list[int]:
    """Several runs, as `run_finetunes`, each of one step; for each, how many reduce-scatters this
    rank launched: the hand-written FSDP's (`comm.reduce_scatter`, one per unit and reduction) and
    FSDP2's (`foreach_reduce`, one per parameter group and reduction)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from minidist.parallel import comm

    counts = [0]

    def counting(real):
        def counted(*args, **kwargs):
            counts[-1] += 1
            return real(*args, **kwargs)
        return counted

    real_hand, real_torch = comm.reduce_scatter, _fsdp_param_group.foreach_reduce
    comm.reduce_scatter, _fsdp_param_group.foreach_reduce = counting(real_hand), counting(real_torch)
    try:
        for argv in argvs:
            run_finetune(argv)
            counts.append(0)
    finally:
        comm.reduce_scatter, _fsdp_param_group.foreach_reduce = real_hand, real_torch
    return counts[:-1]
