"""Worker functions that `minidist.runtime.launch` imports in each spawned rank (see tests/runtime/workers.py)."""

import os

from minidist import finetune


def run_finetune(argv):
    """Train as `torchrun ... -m minidist.finetune ARGV` would, and return the measurements."""
    return finetune.train(finetune.parse_args(argv))


def run_finetunes(argvs):
    """Several runs, one after the other, in the same ranks: one start-up for all of them."""
    return [run_finetune(argv) for argv in argvs]


def evaluate_sharded(model_dir, strategy_name, num_prefixes):
    """The legal-move rate of a model wrapped by `strategy_name`, each rank judging its share."""
    from minidist.chess import jsonl, legal_moves
    from minidist.chess.games import bundled_games
    from minidist.hf import models
    from minidist.runtime.distributed import get_env
    from minidist.parallel.options import ParallelOptions
    from minidist.parallel.strategy import get_strategy

    env = get_env()
    tokenizer = models.load_tokenizer(model_dir)
    model = get_strategy(ParallelOptions(strategy_name, "torch"), env).wrap(models.load_model(model_dir))
    prefixes = legal_moves.game_prefixes(jsonl.load_games(bundled_games("test")), num_prefixes)
    return legal_moves.legal_move_rate(model, tokenizer, prefixes, env.device, batch_size=2)


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
