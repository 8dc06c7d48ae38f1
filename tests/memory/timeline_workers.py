"""Worker for tests/memory/test_timeline.py, run in each rank by `launch`: one step of a strategy under
`torch.profiler`, after a warm-up step, written by rank 0 as a Chrome trace."""

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from minidist.bench import timeline
from minidist.runtime.distributed import get_env
from minidist.strategy.options import ParallelOptions
from minidist.strategy import get_strategy


def traced_step(model_dir: str, trace: str, strategy_name: str, prefetch: bool = True, **options) -> None:
    env = get_env()
    strategy = get_strategy(ParallelOptions(strategy=strategy_name, impl="minidist", **options), env)
    model = strategy.wrap(strategy.load_model(model_dir))
    optimizer = strategy.build_optimizer(model, 1e-3)
    if strategy_name == "fsdp" and not prefetch:
        model.prefetch = lambda unit, step: None  # the control: each unit gathered in its own turn
    ids = torch.randint(0, 40, (2, 48), generator=torch.Generator().manual_seed(env.rank))

    def step():
        with record_function("forward"):
            loss = model(input_ids=ids, labels=ids).loss
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer step"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: the bucketed DDP re-packs its buckets after its first backward
    if strategy_name == "fsdp":
        timeline.mark_units(model)
    dist.barrier()
    if env.rank == 0:
        timeline.record(step, env.device, trace)
    else:
        step()
