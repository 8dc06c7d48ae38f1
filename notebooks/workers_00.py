"""Worker functions for lesson 00 (where the memory goes), launched by `minidist.runtime.launch.launch`.

They live in a `.py` file because every rank is a fresh process that imports its worker by
name; a function defined in a notebook cell cannot be imported. Nothing here measures memory by
itself: each worker runs the real training loop, `minidist.finetune.train`, whose
`minidist.memory.measure.MemoryMeter` records per rank, after every optimizer step, the bytes of
the parameters, gradients and optimizer states, and the peak of the tensors autograd saved for
backward (`memory_bytes` in metrics.jsonl). We hand those records back to the notebook.
"""

import training


def train_and_measure(model_dir: str, data: str, runs: list[list[str]], steps: int, seq_len: int,
                      batch: int) -> list[dict]:
    """Train once per entry of `runs` (extra `minidist.finetune` flags, e.g. ["--strategy",
    "fsdp", "--gradient_checkpointing"]), one after the other in the same ranks; return, per run,
    the records the loop logged (rank 0's view of every rank: `memory_bytes` are lists by rank).
    A run trains PyTorch's own DDP or FSDP2 (`--impl torch`), whose memory lesson 00 counts,
    unless its flags name `--impl minidist`: they come after the common ones, and the last wins."""
    training.share_cores()
    common = ["--model", model_dir, "--data", data, "--impl", "torch", "--max_steps", str(steps),
              "--max_seq_length", str(seq_len), "--batch_size_per_device", str(batch), "--warmup_steps", "1",
              "--eval_prefixes", "0", "--no_save"]
    results = []
    for flags in runs:
        run = training.run([*common, *flags])
        results.append({"flags": flags, "records": run["records"], "log": run["log"]})
    return results
