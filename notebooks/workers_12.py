"""Worker functions for lesson 12 (pipeline parallelism), run in every rank by `minidist.runtime.launch.launch`.

They live in a `.py` file because `launch` starts fresh processes that import the worker by name;
a function defined in a notebook cell cannot be imported. Nothing here re-implements minidist:
`pipeline` loads the tiny chess Llama through `models.load_model` (from_pretrained), keeps this rank's
stage (`pipeline/stages.Stage`), builds the step's micro-batches with the loop's own
`step.assemble_micro_batches`, and runs the schedule's table with `pipeline/executor.Executor`. It only
*watches*: the loss on the last stage, the bytes `comm.counter` saw sent, the micro-batches' shapes (for
the formula b x s x h per cut), and how many micro-batches' activations the stage held at once.
`reference` is the single-process run the pipeline is compared with: the whole model, the same batches.
`lesson` runs `pipeline` and then the bubble's measurement (`bench/bubble.measure`) in the same
ranks, so that one launch of N ranks does everything the notebook needs of N.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
import training

from minidist import batches
from minidist.chess import jsonl
from minidist.chess.games import bundled_games
from minidist.hf import models
from minidist.parallel import comm
from minidist.bench import bubble
from minidist.parallel.pipeline import executor, schedules, stages
from minidist.step import assemble_micro_batches


def _quiet() -> None:
    """No loading bar per rank, nor torch's notice (every rank) that comm.py's collectives have newer names."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def _data(model_dir: str, seq_len: int, batch: int) -> dict:
    """The chess games as token ids, and the sampler of global batches (one data-parallel rank: all of it)."""
    tokenizer = models.load_tokenizer(model_dir)
    sequences = batches.tokenize_games(jsonl.load_games(bundled_games("train")), tokenizer, seq_len)
    return {"sequences": sequences, "pad": tokenizer.pad_token_id,
            "sampler": batches.GlobalBatchSampler(len(sequences), batch, seed=0)}


def _micro_batches(data: dict, step: int, batch: int, m: int) -> tuple[list[dict], int]:
    """Step `step`'s global batch of `batch` sequences as m micro-batches, as the loop cuts it."""
    return assemble_micro_batches(data["sampler"], data["sequences"], step, 0, 1, batch // m, data["pad"],
                                  torch.device("cpu"))


def pipeline(model_dir: str, cases: list[tuple[str, int]], num_steps: int = 2, batch: int = 8,
             seq_len: int = 32, lr: float = 1e-3) -> list[dict]:
    """Each case (schedule, m): the model cut into one stage per rank, `num_steps` AdamW steps of the
    global batch in m micro-batches through the schedule's table. Per case, on this rank: the loss per
    token of each step (the last stage; None elsewhere), the bytes sent in each step, the bytes the
    formula gives (b x s x h x 4 per micro-batch, forward unless last, backward unless first), and
    `peak_held`."""
    _quiet()
    training.share_cores()
    pp, rank = dist.get_world_size(), dist.get_rank()
    data = _data(model_dir, seq_len, batch)
    out = []
    for schedule, m in cases:
        torch.manual_seed(0)
        model = models.load_model(model_dir)
        stage = stages.Stage(model, rank, pp)
        del model  # this rank keeps its stage only
        run = executor.Executor(stage)
        optimizer = torch.optim.AdamW(stage.parameters(), lr=lr)
        directions = (rank < pp - 1) + (rank > 0)
        losses, sent, formula = [], [], []
        comm.counter.take()
        for step in range(num_steps):
            micro, num_targets = _micro_batches(data, step, batch, m)
            loss_sum = run.step(schedules.table(schedule, m, pp), micro, num_targets)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sent.append(comm.counter.take())
            formula.append(directions * sum(b["input_ids"].numel() * stage.config.hidden_size * 4 for b in micro))
            losses.append(None if loss_sum is None else loss_sum.item() / num_targets)
        out.append({"schedule": schedule, "m": m, "losses": losses, "sent": sent, "formula": formula,
                    "peak_held": run.peak_held, "layers": list(stage.layer_ids)})
        training.progress(f"  ranks: pp {pp}, {schedule} with m = {m}: {num_steps} steps done")
    return out


def reference(model_dir: str, num_steps: int = 2, batch: int = 8, seq_len: int = 32, lr: float = 1e-3) -> list[float]:
    """The whole model in this one process, on the same global batches (one micro-batch): the loss
    per token of each step, the summed next-token cross-entropy over the batch's target count."""
    _quiet()
    data = _data(model_dir, seq_len, batch)
    model = models.load_model(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(num_steps):
        (b,), num_targets = _micro_batches(data, step, batch, 1)
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten(), ignore_index=-100,
                               reduction="sum")
        (loss / num_targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item() / num_targets)
    return losses


def lesson(model_dir: str, cases: list[tuple[str, int]], num_steps: int, batch: int, seq_len: int,
           bubble_tables: list | None = None, bubble_sizes: dict | None = None) -> dict:
    """One launch for everything the notebook asks of these ranks: `pipeline`'s cases, then, if given,
    each of `bubble_tables` timed by `bubble.measure` (one thread per rank, its own model of
    `bubble_sizes`: bubble.py's docstring says why) as (timeline, step_time) per step."""
    out = {"pipeline": pipeline(model_dir, cases, num_steps, batch, seq_len)}
    if bubble_tables:
        training.progress(f"  ranks: timing the bubble, {len(bubble_tables)} schedules")
        out["bubble"] = bubble.measure(bubble_tables, **(bubble_sizes or {}))
    return out
