"""Worker functions for lesson 06 (activation checkpointing), launched by `minidist.launch.launch`.

They live in a `.py` file because every rank is a fresh process that imports its worker by
name; a function defined in a notebook cell cannot be imported. Nothing here re-implements
minidist: each run is the real training loop, `minidist.finetune.train`, with the flags a learner
would type (`--gradient_checkpointing`, `--batch_size_per_device 8`, ...), and what comes back is
what that loop wrote to `metrics.jsonl`: per step, the loss, `step_time_s`, and `memory_bytes`
(the saved-activation peak that `minidist.memory.measure` counts through saved-tensor hooks, and
the model states), each as a list by rank.

One launch runs every configuration in the same ranks: starting processes and importing
transformers costs more on 2 cores than a few steps of a tiny model. The configurations take
turns, round after round (`in_rounds`), so that a slow minute on a shared machine hurts all of
them alike instead of whichever happened to run then; `median_spread` summarises the step times.
"""

import statistics
import time
from contextlib import contextmanager
from functools import partial

import training


@contextmanager
def _cpu_timed(seconds: list):
    """Around each step's `train_step` (its forward and backward), where the loop lets a caller in
    (`finetune.train`'s `around_train_step`): append the CPU seconds this process spent in it to
    `seconds`. The loop's `step_time_s` is wall time: on a laptop shared with other work it also
    counts the time the rank waited for a core. CPU time counts only the work done (the
    recomputation included), so it compares checkpointed and stored runs more steadily."""
    started = time.process_time()
    yield
    seconds.append(time.process_time() - started)


def in_rounds(runs: dict, rounds: int, steps: int, common: list[str]) -> dict:
    """Run the training script `rounds` times over every entry of `runs` (name -> extra flags), in
    turn: round 1 runs each configuration for `steps` steps, then round 2 does it again, and so
    on. Returns, by name, one dict per round: the records of `metrics.jsonl` (rank 0's; [] on the
    others), this rank's CPU seconds in each step's forward and backward (`cpu_s`), and the
    loop's log. Each round is a fresh run from the same weights and batches (the data order
    depends on the seed alone), so its first step pays the warm-up again: `median_spread`
    leaves it out."""
    training.share_cores()  # else the step times would measure the contention between ranks
    results = {name: [] for name in runs}
    for r in range(rounds):
        for name, extra in runs.items():
            cpu_s = []
            done = training.run([*common, *extra, "--max_steps", str(steps), "--no_save"],
                                around_train_step=partial(_cpu_timed, cpu_s), announce=False)
            results[name].append({"records": done["records"], "cpu_s": cpu_s, "log": done["log"]})
        training.progress(f"  ranks: timing round {r + 1} of {rounds} done ({len(runs)} configurations)")
    return results


def median_spread(per_round: list[list[float]]) -> tuple[float, float, float]:
    """(median, first quartile, third quartile) of the timed steps of every round, the first step
    of each round left out (it allocates memory and fills caches). The quartiles are the spread:
    half the steps fall between them."""
    values = [t for times in per_round for t in (times[1:] or times)]
    if len(values) < 2:  # the small configuration times a single step: no spread to speak of
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return median, q1, q3


def train_and_measure(model_dir: str, data: str, runs: list[dict], rounds: int, steps: int, seq_len: int) -> list[dict]:
    """Train every entry of `runs` (finetune flags as a dict) for `steps` steps, in turn, `rounds`
    times (`in_rounds`); return, per entry, the flags, the rounds' records of `metrics.jsonl` (on
    rank 0; [] elsewhere), their step times (`step_s`, wall) and this rank's CPU seconds in each
    step's forward and backward (`cpu_s`), one list per round.

    Every run starts from the same weights and, for a given batch size, sees the same batches, so
    with and without checkpointing the losses must agree."""
    common = ["--model", model_dir, "--data", data, "--max_seq_length", str(seq_len),
              "--warmup_steps", "1", "--eval_prefixes", "0"]
    named = {str(i): training.as_flags(run) for i, run in enumerate(runs)}
    done = in_rounds(named, rounds, steps, common)
    return [{"run": run, "records": [r["records"] for r in done[str(i)]],
             "step_s": [[rec["step_time_s"] for rec in r["records"]] for r in done[str(i)]],
             "cpu_s": [r["cpu_s"] for r in done[str(i)]]} for i, run in enumerate(runs)]
