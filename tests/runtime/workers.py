"""Worker functions for tests/runtime/test_launch.py.

They live in their own module because launch() spawns fresh interpreters that import the
worker by name; a module without pytest imports keeps each child's start-up short.
"""

import os
import time

import torch
import torch.distributed as dist

from minidist.runtime.distributed import get_env


def rank_info(pid_dir=None):
    """All-reduce (rank + 1) so the sum proves the ranks really talked: 1 + 2 + ... + N."""
    env = get_env()
    _record_pid(pid_dir)
    t = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(t)
    return {
        "rank": env.rank,
        "world_size": env.world_size,
        "local_rank": env.local_rank,
        "backend": env.backend,
        "device": str(env.device),
        "sum": t.item(),
        "big": list(range(100_000)),  # several hundred KB: more than a pipe buffer holds
    }


def environment(names):
    """The rank's values of the variables `names` (None where unset), and its torch thread count."""
    return {**{name: os.environ.get(name) for name in names}, "threads": torch.get_num_threads()}


def hub_home():
    """The cache folder huggingface_hub took from HF_HOME when it was imported, and whether that
    import happened before this rank existed (in the fork server: `launch._PRELOAD`)."""
    import sys

    preloaded = "huggingface_hub.constants" in sys.modules
    from huggingface_hub import constants

    return {"HF_HOME": constants.HF_HOME, "preloaded": preloaded}


def frozen_objects() -> int:
    """How many objects the cycle collector leaves alone in this rank (`gc.freeze`)."""
    import gc

    return gc.get_freeze_count()


def fail_on_rank_1(pid_dir):
    """Rank 1 raises; rank 0 waits for it in an all_reduce; rank 2 (if any) is busy elsewhere
    and would never notice on its own, so only launch() stopping it ends the run."""
    env = get_env()
    _record_pid(pid_dir)
    if env.rank == 1:
        time.sleep(0.5)  # let rank 0 enter the collective first
        raise ValueError("boom")
    if env.rank == 2:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))
    return env.rank


def exit_on_rank_1(pid_dir):
    """Rank 1 vanishes without a word, as a segfault or an OOM kill would."""
    env = get_env()
    _record_pid(pid_dir)
    if env.rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))
    return env.rank


def sleep_forever(pid_dir):
    _record_pid(pid_dir)
    time.sleep(3600)


def _record_pid(pid_dir):
    # The test checks afterwards that every one of these processes is gone.
    if pid_dir is not None:
        with open(os.path.join(pid_dir, f"{os.getpid()}.pid"), "w") as f:
            f.write(str(get_env().rank))


def wait_for_a_rank_that_never_comes():
    """Rank 0 enters an all_reduce that rank 1 never joins; the collective timeout must end it."""
    if get_env().rank == 1:
        time.sleep(120)
    dist.all_reduce(torch.ones(1))
