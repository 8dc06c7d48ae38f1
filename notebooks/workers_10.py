"""Worker function for lesson 10 (more than one node, and LoRA), launched by `minidist.runtime.launch.launch`.

It lives in a `.py` file because every rank is a fresh process that imports its worker by name.
Nothing here re-implements minidist: each run is the real training script, `minidist.finetune.train`,
with the flags a learner would pass to `slurm/10_multinode.sh` or `slurm/chess_finetune.sh`, and
what comes back is what that script measured and logged in `metrics.jsonl`: the bytes each rank
sent within its node and across nodes (`parallel/comm.py`), the model states each rank held
(`memory/measure.py`) and the legal-move rates before and after training. `split_steps` watches
CPU offload instead: it steps the model with the loop's own `train_step`, as lesson 05's workers
do, and counts one whole step's live tensors per side, device or host
(`memory.sides.SplitLiveTensors`).

The notebook launches it with `launch(..., nodes=2)`: 4 ranks pretending to be 2 nodes of 2
(ranks 0, 1 on "node 0", ranks 2, 3 on "node 1"), with the LOCAL_RANK, LOCAL_WORLD_SIZE and
GROUP_RANK torchrun would set, so that `--strategy hsdp` finds its shard groups within a node and
the byte counter knows which ring links cross nodes. All runs share one launch: starting 4
processes and importing transformers costs more on 2 cores than a few steps of a tiny model.
"""

import warnings

from minidist import batches
from minidist.chess import jsonl
from minidist.hf import models
from minidist.step import train_step
from minidist.runtime.distributed import get_env
from minidist.memory.sides import SplitLiveTensors, is_host
from minidist.strategy.options import ParallelOptions
from minidist.strategy import get_strategy

import training


def run_all(common: list[str], runs: dict[str, list[str]]) -> dict:
    """The training script once per entry of `runs` (name -> extra flags, added after `common`),
    one after the other in the same ranks, sharing the cores: `training.run_each`."""
    training.share_cores()
    return training.run_each(common, runs)


def split_steps(model_dir: str, games: str, variants: list[tuple[str, bool]], batch: int = 2, seq: int = 32,
                mixed_precision: str = "bf16") -> dict:
    """For each (strategy, cpu_offload) in `variants`: wrap the model, take two steps with the
    loop's own calls, and watch the second (the first makes AdamW's moments). By variant, this
    rank's device and host peaks over the whole step, and whether every tensor the optimizer steps
    (the fp32 masters) is on the host (`sides.is_host`)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no loading bar per rank and per variant in the notebook
    # nor torch's notice, on every rank, that the collectives comm.py calls have newer names
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    env = get_env()
    tokenizer = models.load_tokenizer(model_dir)
    sequences = batches.tokenize_games(jsonl.load_games(games), tokenizer, seq)
    mine = batches.collate(sequences[env.rank * batch:(env.rank + 1) * batch], tokenizer.pad_token_id)
    targets = sum(len(sequences[i]) - 1 for i in range(env.world_size * batch))
    out = {}
    for name, cpu_offload in variants:
        options = ParallelOptions(strategy=name, impl="minidist", mixed_precision=mixed_precision, cpu_offload=cpu_offload)
        strategy = get_strategy(options, env)
        model = strategy.wrap(strategy.load_model(model_dir))
        optimizer = strategy.build_optimizer(model, 1e-3)

        def step():
            train_step(model, strategy, [mine], targets, env.world_size)
            strategy.clip_grad_norm_(model, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()
        with SplitLiveTensors(env.device, model, optimizer) as live:
            step()
        masters = [p for group in optimizer.param_groups for p in group["params"]]
        out[name, cpu_offload] = {"device": live.device_peak, "host": live.host_peak,
                                  "masters_on_host": all(is_host(p) for p in masters)}
        del model, optimizer, strategy
    return out


def lesson(common: list[str], runs: dict[str, list[str]], model_dir: str, games: str,
           variants: list[tuple[str, bool]]) -> dict:
    """The notebook's one launch of 2 x 2 ranks: `run_all`, then `split_steps` in the same ranks
    (starting 4 processes costs more on 2 cores than what they run here)."""
    return {"runs": run_all(common, runs), "split": split_steps(model_dir, games, variants)}
