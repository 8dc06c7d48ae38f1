"""Worker function for lesson 10 (more than one node, and LoRA), launched by `minidist.launch.launch`.

It lives in a `.py` file because every rank is a fresh process that imports its worker by name.
Nothing here re-implements minidist: each run is the real training script, `minidist.finetune.train`,
with the flags a learner would pass to `slurm/10_multinode.sh` or `slurm/chess_finetune.sh`, and
what comes back is what that script measured and logged in `metrics.jsonl`: the bytes each rank
sent within its node and across nodes (`parallel/comm.py`), the model states each rank held
(`memory/measure.py`) and the legal-move rates before and after training.

The notebook launches it with `launch(..., nodes=2)`: 4 ranks pretending to be 2 nodes of 2
(ranks 0, 1 on "node 0", ranks 2, 3 on "node 1"), with the LOCAL_RANK, LOCAL_WORLD_SIZE and
GROUP_RANK torchrun would set, so that `--strategy hsdp` finds its shard groups within a node and
the byte counter knows which ring links cross nodes. All runs share one launch: starting 4
processes and importing transformers costs more on 2 cores than a few steps of a tiny model.
"""

import training


def run_all(common: list[str], runs: dict[str, list[str]]) -> dict:
    """The training script once per entry of `runs` (name -> extra flags, added after `common`),
    one after the other in the same ranks. By name, rank 0's view: the records of `metrics.jsonl`
    (one per step; `memory_bytes` holds lists by rank), the legal-move rates before and after
    training (None with `--eval_prefixes 0`), the lines the script printed, and its wall time."""
    training.share_cores()
    results = {}
    for name, extra in runs.items():
        done = training.run([*common, *extra, "--no_save"])
        result = done["result"]
        results[name] = {"flags": extra, "records": done["records"], "rate_before": result["rate_before"],
                         "rate_after": result.get("rate_after"), "log": done["log"], "seconds": done["seconds"]}
    return results
