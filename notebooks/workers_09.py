"""Worker function for lesson 09 (the capstone), launched by `minidist.launch.launch`.

It lives in a `.py` file because every rank is a *spawned* process that imports its worker by
name. Nothing here re-implements minidist: each run is the real training script,
`minidist.finetune.train`, with the command-line flags a learner would pass to
`slurm/chess_finetune.sh`, and what comes back is what that script measured and logged.
"""

import training


def run_all(common: list[str], runs: dict[str, list[str]]) -> dict:
    """Run the training script once per entry of `runs` (name -> extra flags, added after
    `common`), one after the other in these ranks. Returns, by name, rank 0's view: the records of
    `metrics.jsonl` (one per step; memory lists by rank), the legal-move rates before and after
    training (None with `--eval_prefixes 0`), the lines the script printed, and its wall time."""
    training.share_cores()
    results = {}
    for name, extra in runs.items():
        done = training.run([*common, *extra, "--no_save"])
        result = done["result"]
        results[name] = {"flags": extra, "records": done["records"], "rate_before": result["rate_before"],
                         "rate_after": result.get("rate_after"), "log": done["log"], "seconds": done["seconds"]}
    return results
