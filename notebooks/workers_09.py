"""Worker function for lesson 09 (the capstone), launched by `minidist.runtime.launch.launch`.

It lives in a `.py` file because every rank is a fresh process that imports its worker by
name. Nothing here re-implements minidist: each run is the real training script,
`minidist.finetune.train`, with the command-line flags a learner would pass to
`slurm/chess_finetune.sh`, and what comes back is what that script measured and logged. The
timings reuse lesson 06's turn-taking runner (`workers_06.in_rounds`) and the benchmark behind
`python -m minidist.bench fsdp` (`minidist.bench.strategies.time_implementations`).
"""

from minidist.bench import strategies

import training
import workers_06


def run_all(common: list[str], runs: dict[str, list[str]], timed: dict[str, list[str]], rounds: int, steps: int,
            bench: dict) -> dict:
    """In one launch of these ranks:

    - `runs`: the training script once per entry (name -> extra flags, added after `common`), one
      after the other. By name, rank 0's view: the records of `metrics.jsonl` (one per step;
      memory lists by rank), the legal-move rates before and after training (None with
      `--eval_prefixes 0`), the lines the script printed, and its wall time.
    - `timed`: the configurations to time, `steps` steps each, taking turns for `rounds` rounds
      (`workers_06.in_rounds`): by name, one list of step times per round.
    - `bench`: minidist's FSDP against PyTorch's FSDP2 (and ZeRO-2) on one model, in alternating
      rounds: `time_implementations("fsdp", **bench)`'s result."""
    training.share_cores()
    results = training.run_each(common, runs)
    rounds_done = workers_06.in_rounds(timed, rounds, steps, common)
    step_s = {name: [[r["step_time_s"] for r in done["records"]] for done in per_round]
              for name, per_round in rounds_done.items()}
    return {"runs": results, "step_s": step_s, "bench": strategies.time_implementations("fsdp", **bench)}


def accelerate_parity(model_dir: str, out: str) -> dict:
    """`minidist.bench.accelerate_parity.both_sides` on this rank (minidist's run, then Accelerate's),
    without two things a learner would take for errors, red under the cell: transformers' "Loading
    weights" progress bar, and Accelerate's warning that OMP_NUM_THREADS is unset and that it sets it
    to 1 (it does, for its side; what is compared is the losses, step by step)."""
    import warnings

    from transformers.utils import logging

    from minidist.bench import accelerate_parity as parity

    logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="OMP_NUM_THREADS/MKL_NUM_THREADS unset")
    return parity.both_sides(model_dir, out)
