"""Worker functions for lesson 06 (activation checkpointing), launched by `minidist.launch.launch`.

They live in a `.py` file because every rank is a *spawned* process that imports its worker by
name; a function defined in a notebook cell cannot be imported. Nothing here re-implements
minidist: each run is the real training loop, `minidist.finetune.train`, with the flags a learner
would type (`--gradient_checkpointing`, `--batch_size_per_device 8`, ...), and what comes back is
what that loop wrote to `metrics.jsonl`: per step, the loss, `step_time_s`, and `memory_bytes`
(the saved-activation peak that `minidist.memory.measure` counts through saved-tensor hooks, and
the model states), each as a list by rank.

One launch runs every configuration one after the other in the same ranks: starting processes and
importing transformers costs more on 2 cores than a few steps of a tiny model.
"""

import time

from minidist import finetune

import training


def _cpu_timed(train_step, seconds: list):
    """`finetune.train_step` (forward and backward of one step), recording the CPU seconds this
    process spent in it. The loop's `step_time_s` is wall time: on a laptop shared with other work
    it also counts the time the rank waited for a core. CPU time counts only the work done (the
    recomputation included), so it compares checkpointed and stored runs more steadily."""
    def timed(*args, **kwargs):
        t0 = time.process_time()
        loss = train_step(*args, **kwargs)
        seconds.append(time.process_time() - t0)
        return loss
    return timed


def train_and_measure(model_dir: str, data: str, runs: list[dict], steps: int, seq_len: int) -> list[dict]:
    """Train once per entry of `runs` (finetune flags as a dict), one after the other in the same
    ranks; return, per run, the flags, the records of `metrics.jsonl` (on rank 0; [] elsewhere) and
    this rank's CPU seconds in each step's forward and backward (`cpu_s`).

    Every run starts from the same weights and, for a given batch size, sees the same batches (the
    data order depends on the seed alone), so with and without checkpointing the losses must agree."""
    training.share_cores()  # else the step times would measure the contention, not the recomputation
    common = ["--model", model_dir, "--data", data, "--max_steps", str(steps), "--max_seq_length", str(seq_len),
              "--warmup_steps", "1", "--eval_prefixes", "0", "--no_save"]
    results = []
    for run in runs:
        cpu_s, train_step = [], finetune.train_step
        finetune.train_step = _cpu_timed(train_step, cpu_s)  # the loop looks it up at each step
        try:
            done = training.run([*common, *training.as_flags(run)])
        finally:
            finetune.train_step = train_step
        results.append({"run": run, "records": done["records"], "cpu_s": cpu_s, "log": done["log"]})
    return results
