"""The SLURM script itself, run through fake sbatch/srun/scontrol on CPU with the tiny model.

The fakes (tests/fake_slurm) set the variables a one-node allocation sets and run the script's
real launch line: srun, then torchrun with a c10d rendezvous, then minidist.finetune on 2 CPU
ranks standing in for GPUs.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minidist.data import bundled_games
from minidist.distributed import find_free_port

ROOT = Path(__file__).resolve().parents[1]
FAKE_SLURM = ROOT / "tests" / "fake_slurm"


def sbatch(tmp_path, model, *args, sbatch_options=(), script="chess_finetune.sh", **env):
    variables = {
        **os.environ,
        "PATH": f"{FAKE_SLURM}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),  # the job runs from the submit folder, here tmp_path
        "MODEL": model, "DATA": str(bundled_games("train")), "OUTPUT_DIR": str(tmp_path / "out"),
        "TOTAL_BATCH_SIZE": "8", "BATCH_SIZE_PER_DEVICE": "2", "MASTER_PORT": str(find_free_port()),
        "FAKE_SLURM_JOB_ID": "42", **env,
    }
    done = subprocess.run(["sbatch", *sbatch_options, str(ROOT / "slurm" / script), *args], cwd=tmp_path,
                          env=variables, capture_output=True, text=True, timeout=300)
    logs = list(tmp_path.glob("*-42.out"))  # `#SBATCH --output=%x-%j.out`: named after the job
    assert len(logs) == 1, f"expected one job log, found {logs}: {done.stdout}{done.stderr}"
    return done, logs[0].read_text()


@pytest.mark.parametrize("extra,strategy", [([], "torch/fsdp"), (["--no_fsdp"], "torch/ddp")])
def test_the_slurm_script_trains_on_two_cpu_ranks(tiny_model, tmp_path, extra, strategy):
    done, log = sbatch(tmp_path, tiny_model, "--max_steps", "2", "--max_seq_length", "48", "--eval_prefixes", "8", *extra)
    assert done.returncode == 0, log
    assert "Submitted batch job 42" in done.stdout
    # 8 = 2 per device x 2 ranks x 2 accumulation steps, computed by the script.
    assert "total batch 8 = 2 x 2 x 2 accumulation" in log
    assert f"{strategy} on 2 x cpu" in log and "global batch 8 = 2 x 2 ranks x 2 accumulation" in log
    steps = [json.loads(line)["step"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert "legal-move rate after training" in log
    assert (tmp_path / "out" / "model" / "config.json").exists()


def test_two_nodes_meet_at_the_rendezvous_on_the_first(tiny_model, tmp_path):
    # Two "nodes" (both this machine) with one CPU rank each: two torchruns, one c10d rendezvous.
    done, log = sbatch(tmp_path, tiny_model, "--max_steps", "2", "--max_seq_length", "48", "--eval_prefixes", "4",
                       sbatch_options=["--nodes", "2"], FAKE_SLURM_GPUS_ON_NODE="1")
    assert done.returncode == 0, log
    assert "2 node(s) x 1 GPUs, rendezvous localhost" in log and "total batch 8 = 2 x 2 x 2 accumulation" in log
    assert "torch/fsdp on 2 x cpu" in log
    assert len((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()) == 2


def test_sizes_that_do_not_divide_stop_the_job_with_one_line(tiny_model, tmp_path):
    done, log = sbatch(tmp_path, tiny_model, TOTAL_BATCH_SIZE="10", BATCH_SIZE_PER_DEVICE="4")
    assert done.returncode != 0
    assert log.strip().splitlines() == [
        "error: TOTAL_BATCH_SIZE=10 is not divisible by 2 GPUs x BATCH_SIZE_PER_DEVICE=4; pick sizes whose product divides it"]


def test_usr1_saves_a_checkpoint_requeues_and_the_next_start_resumes(tiny_model, tmp_path):
    """The preemption path of a real cluster, through the fakes: SLURM's warning signal reaches the
    batch shell (`--signal=B:USR1@90`), which forwards it through srun and torchrun to the ranks;
    they save after their step and exit; the script requeues the job; the second start resumes."""
    log = tmp_path / "chess-finetune-42.out"
    done, text = sbatch(tmp_path, tiny_model, "--max_steps", "6", "--max_seq_length", "48", "--eval_prefixes", "0",
                        "--checkpoint_format", "full",
                        # The ranks wait after step 3 until a signal comes; "90 s before the time
                        # limit" is when the fake sbatch sees them waiting.
                        MINIDIST_PAUSE_AT="step:3", FAKE_SLURM_SIGNAL_WHEN=f"grep -q 'paused at step 3' {log}")
    assert done.returncode == 0, text
    first, _, second = text.partition("(start 2)")  # --open-mode=append: both starts in one log
    assert "(start 1)" in first and second, text
    assert "USR1: the time limit is near; asking the training to save and stop" in first
    assert "stopped by SIGUSR1 after step 3: saved" in first
    assert "scontrol (fake): job 42 requeued" in first
    assert "step    4/6" not in first
    assert f"resumed from {tmp_path / 'out' / 'checkpoint-3'} at step 3" in second
    steps = [json.loads(line)["step"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert (tmp_path / "out" / "model" / "config.json").exists()
    # Full form: the checkpoint's model is a Hugging Face folder.
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "checkpoint-3" / "model").config.hidden_size == 64


# The lesson scripts (slurm/NN_topic.sh). Most hand over to chess_finetune.sh with their own
# flags, so they take its environment variables and minidist.finetune arguments; the tiny model
# and two steps are enough to run their real launch lines. Per lesson: the lines its log must
# show, and, where it is not a two-step fine-tune, the arguments and environment it takes here
# and whether it trains (then metrics.jsonl must hold steps 1 and 2).
FINETUNE_ARGS = ["--max_steps", "2", "--max_seq_length", "48", "--eval_prefixes", "0", "--no_save"]
LESSONS = {
    "00_memory": {"log": ["lesson 00: the memory estimate for this run", "peak per rank", "fits in 80.00 GB: yes",
                          "torch/ddp on 2 x cpu", "step    2/2"]},
    # Not a fine-tune: the all-reduce benchmark over three small message sizes (1, 8 and 64 KiB).
    "01_collectives": {"args": ["--min_bytes", "1K", "--max_bytes", "64K", "--factor", "8", "--warmup", "1", "--iters", "2"],
                       "env": {"OPS": "all_reduce"}, "trains": False,
                       "log": ["lesson 01: collective bandwidth on 1 node(s) x 2 GPUs", "all_reduce on 2 x cpu (gloo)",
                               "peak busbw"]},
    "02_ddp": {"log": ["lesson 02: minidist/ddp (bucketed)", "minidist/ddp on 2 x cpu", "step    2/2"]},
    "03_accumulation": {"log": ["lesson 03: total batch 8, 2 per device, the rest accumulated",
                                "minidist/fsdp on 2 x cpu | global batch 8 = 2 x 2 ranks x 2 accumulation", "step    2/2"]},
    "04_zero": {"log": ["lesson 04: minidist/zero2", "minidist/zero2 on 2 x cpu", "step    2/2"]},
    "05_fsdp": {"log": ["lesson 05 (FSDP by hand)", "minidist/fsdp on 2 x cpu", "step    2/2"]},
    "06_activation_checkpointing": {"log": ["lesson 06: minidist/fsdp with activation checkpointing",
                                            "minidist/fsdp on 2 x cpu", "step    2/2"]},
    "07_mixed_precision": {"log": ["lesson 07: minidist/fsdp, compute bf16, gradients reduced in fp32",
                                   "minidist/fsdp on 2 x cpu", "step    2/2"]},
    "08_checkpoints": {"args": FINETUNE_ARGS + ["--save_steps", "1"], "latest": "checkpoint-2",
                       "log": ["lesson 08: sharded checkpoints", "torch/fsdp on 2 x cpu", "step    2/2"]},
    "09_capstone": {"log": ["lesson 09 (capstone): torch/fsdp", "torch/fsdp on 2 x cpu", "step    2/2"]},
}


@pytest.mark.parametrize("script", sorted((ROOT / "slurm").glob("[0-9][0-9]_*.sh")), ids=lambda p: p.stem)
def test_every_lesson_script_runs_through_the_fakes_on_the_tiny_model(tiny_model, tmp_path, script):
    lesson = LESSONS.get(script.stem, {})
    done, log = sbatch(tmp_path, tiny_model, *lesson.get("args", FINETUNE_ARGS), script=script.name, **lesson.get("env", {}))
    assert done.returncode == 0, log
    assert "Submitted batch job 42" in done.stdout
    assert "Traceback" not in log, log
    for line in lesson.get("log", []):
        assert line in log, f"{script.name}: expected {line!r} in its log:\n{log}"
    if lesson.get("trains", True):
        assert "on 2 x cpu" in log, log
        steps = [json.loads(line)["step"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2]
    if "latest" in lesson:  # the checkpoint the next start would resume from
        assert (tmp_path / "out" / "latest").read_text() == lesson["latest"] + "\n"
