"""chess_finetune.sh passes `--accumulate_sharded` where it wins: with more than one micro-batch, a
strategy that shards gradients (FSDP, the default; HSDP; ZeRO-2) and one node (lesson 03: 42.0
against 61.6 GB per GPU for 7B at 4 x 2 micro-batches, for one more reduce-scatter per extra
micro-batch over NVLink). On several nodes each micro-batch would also cross the network, so there
it stays off unless ACCUMULATE_SHARDED=1; ACCUMULATE_SHARDED=0 turns it off everywhere. It must never
reach a strategy that refuses it (DDP, `--no_fsdp`, ZeRO-1): each case's arguments are parsed by
`minidist.finetune` and checked by `ParallelOptions`, as a job would.

No SLURM is needed: the function is read out of slurm/allocation.sh (which chess_finetune.sh and
lesson 00's script source) and run by bash with the variables the script has set by then (NNODES,
GRADIENT_ACCUMULATION_STEPS, STRATEGY), as test_requeue_message.py does for `requeue`."""

import os
import re
import subprocess
from pathlib import Path

import pytest

from minidist import finetune
from minidist.strategy.options import ParallelOptions

# The full suite only: the batch scripts' choices under a real SLURM started on this machine.
pytestmark = pytest.mark.slow

SLURM = Path(__file__).resolve().parents[2] / "slurm"
SCRIPT, LIBRARY = SLURM / "chess_finetune.sh", SLURM / "allocation.sh"
FLAG = "--accumulate_sharded"


def arguments(args: list[str], nodes: int = 1, accumulation: int = 2, choice: str = "auto") -> list[str]:
    """The arguments the script passes to the training: its accumulation, STRATEGY (after the choice),
    then the run's own."""
    text = LIBRARY.read_text()
    function = re.search(r"^sharded_accumulation\(\) \{.*?^\}", text, re.DOTALL | re.MULTILINE)
    assert function, "allocation.sh has no sharded_accumulation function"
    strategy = "(--strategy hsdp)" if nodes > 1 and not {"--strategy", "--no_fsdp"} & set(args) else "()"
    script = (f"set -euo pipefail\nNNODES={nodes} GRADIENT_ACCUMULATION_STEPS={accumulation} "
              f"ACCUMULATE_SHARDED={choice}\nSTRATEGY={strategy}\n{function.group(0)}\n"
              'sharded_accumulation "$@"\necho STRATEGY; printf "%s\\n" "${STRATEGY[@]}"')
    done = subprocess.run(["bash", "-c", script, "bash", *args], capture_output=True, text=True, check=True)
    lines = done.stdout.splitlines()
    chosen = [line for line in lines[lines.index("STRATEGY") + 1:] if line]  # printf prints one empty line for ()
    return ["--gradient_accumulation_steps", str(accumulation), *chosen, *args]  # in the script's order


def test_the_script_calls_it_and_passes_strategy_to_the_training():
    text = SCRIPT.read_text()
    call, launch = text.index('\nsharded_accumulation "$@"'), text.index("\n    -m minidist.finetune \\\n")
    assert call < launch and '"${STRATEGY[@]}"' in text[launch:], "the choice must reach torchrun's arguments"


@pytest.mark.parametrize("args,nodes,accumulation,choice,added", [
    ([], 1, 2, "auto", True),                                       # the default run: FSDP, 4 x 2 on one node
    (["--strategy", "zero2", "--impl", "minidist"], 1, 4, "auto", True),
    (["--strategy=fsdp", "--impl", "torch"], 1, 2, "auto", True),
    ([], 1, 1, "auto", False),                                      # one micro-batch: nothing accumulates
    (["--gradient_accumulation_steps", "1"], 1, 2, "auto", False),  # the run's own value wins
    (["--no_fsdp"], 1, 2, "auto", False),                           # DDP refuses the flag
    (["--strategy", "ddp"], 1, 2, "auto", False),
    (["--strategy=zero1", "--impl", "minidist"], 1, 2, "auto", False),
    ([], 1, 2, "0", False),                                         # the learner's switch
    ([], 2, 2, "auto", False),                                      # HSDP on 2 nodes: an all-reduce across per micro-batch
    (["--strategy", "fsdp"], 2, 2, "auto", False),
    ([], 2, 2, "1", True),                                          # asked for on 2 nodes
    (["--no_fsdp"], 2, 2, "1", False),
    ([FLAG], 1, 2, "auto", True),                                   # given by hand: passed once
])
def test_the_flag_is_passed_where_it_wins_and_never_where_it_is_refused(args, nodes, accumulation, choice, added):
    argv = arguments(args, nodes, accumulation, choice)
    assert argv.count(FLAG) == (1 if added else 0), argv
    parsed = finetune.parse_args(argv)
    options = ParallelOptions.from_args(parsed)  # raises where the flag does not apply
    assert options.accumulate_sharded == added, argv


def test_a_bad_switch_is_one_line():
    """Checked with the other variables, before the script looks for SLURM (run here outside it)."""
    env = {"PATH": "/usr/bin:/bin", "SITE_SETUP": "", "ACCUMULATE_SHARDED": "yes"}
    done = subprocess.run(["bash", str(SCRIPT)], check=False, env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr.splitlines()) == (2, [
        "error: ACCUMULATE_SHARDED=yes must be auto, 1 (sharded accumulation) or 0 (no_sync)"]), done.stderr


@pytest.mark.parametrize("strategy,choice,added", [("fsdp", "auto", True),   # 32 = 4 x 1 GPU x 8 micro-batches
                                                   ("ddp", "auto", False),   # the lesson's default: no shards
                                                   ("fsdp", "0", False)])
def test_lesson_00_estimates_the_run_it_starts(tmp_path, strategy, choice, added):
    """slurm/00_memory.sh prints the estimate of the run it hands to chess_finetune.sh, so the estimate
    carries `--accumulate_sharded` exactly where that script will pass it. Outside SLURM the script
    prints the estimate, then chess_finetune.sh stops in one line (no SLURM_JOB_ID)."""
    from minidist.hf import models

    model = models.write_tiny_llama(tmp_path / "tiny")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "MODEL": str(model), "STRATEGY": strategy,
           "ACCUMULATE_SHARDED": choice}
    env.pop("SLURM_JOB_ID", None)
    done = subprocess.run(["bash", str(SLURM / "00_memory.sh")], capture_output=True, text=True, env=env,
                          cwd=SLURM.parent, timeout=300)
    assert done.returncode == 2 and "SLURM_JOB_ID is not set" in done.stderr, done.stderr[-2000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("lesson 00: the memory estimate")]
    assert (f" --strategy {strategy} " in line) and ((FLAG in line) == added), line
