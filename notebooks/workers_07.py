"""Worker functions for lesson 07 (mixed precision), launched by `minidist.runtime.launch.launch`.

They live in a `.py` file because every rank is a fresh process that imports its worker by
name; a function defined in a notebook cell cannot be imported. Nothing here re-implements
minidist: each run is the real training loop, `minidist.finetune.train`, with the flags a learner
would type (`--mixed_precision bf16`, `--reduce_dtype bf16`, `--impl torch`, ...), and what comes
back is what that loop wrote to `metrics.jsonl`: per step, the loss, `comm_bytes` (what rank 0
sent, counted by `minidist.parallel.comm`; None for `--impl torch`, whose collectives PyTorch runs
itself) and `memory_bytes` (model states and the saved-activation peak, as lists by rank).

One launch runs every configuration one after the other in the same ranks: starting processes and
importing transformers costs more on 2 cores than a few steps of a tiny model.
"""

import training


def train_and_measure(model_dir: str, data: str, runs: list[dict], steps: int, seq_len: int) -> list[dict]:
    """Train once per entry of `runs` (finetune flags as a dict), one after the other in the same
    ranks; return, per run, the flags and the records of `metrics.jsonl` (on rank 0; [] elsewhere).

    Every run starts from the same weights and sees the same batches (the data order depends on the
    seed alone), so the loss curves of fp32 and bf16 differ only by how each one rounds."""
    training.share_cores()
    common = ["--model", model_dir, "--data", data, "--max_steps", str(steps), "--max_seq_length", str(seq_len),
              "--warmup_steps", "1", "--eval_prefixes", "0", "--no_save"]
    results = []
    for run in runs:
        done = training.run([*common, *training.as_flags(run)])
        results.append({"run": run, "records": done["records"], "log": done["log"]})
    return results
