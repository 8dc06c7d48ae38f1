#!/bin/bash
# Lesson 09, the capstone: fine-tune CodeLlama-7b on chess games with FSDP on one node of 4
# A100-80GB GPUs, judge it by its legal-move rate on 200 held-out positions, and run the three
# classic exercises. The same code as notebooks/09_capstone.ipynb, at 7B.
#
#   sbatch slurm/09_capstone.sh                                    # FSDP by hand (parallel/fsdp.py), the default
#   IMPL=torch sbatch slurm/09_capstone.sh                         # the same run with PyTorch's FSDP2, the reference
#   sbatch slurm/09_capstone.sh --no_fsdp                          # exercise 1: plain DDP
#   BATCH_SIZE_PER_DEVICE=8 sbatch slurm/09_capstone.sh            # exercise 2: 1, 2, 4 (default), 8 at total batch 32
#   sbatch slurm/09_capstone.sh --gradient_checkpointing           # exercise 3: recompute the layers in backward
#
# Expected outcome (estimated, NOT run: this script has not run on GPUs yet). Memory per GPU from
# `python -m minidist.memory codellama/CodeLlama-7b-hf --world_size 4 --max_seq_length 512
# --gpu_memory 80GB --batch_size_per_device B --gradient_accumulation_steps A [--strategy ddp]
# [--gradient_checkpointing]`, with each run's own accumulation. These are the figures of
# PyTorch's FSDP2 and DDP (IMPL=torch; the estimator's default); the hand-written ones the default
# run uses keep gradients differently through the accumulation: add `--impl minidist` to the command.
#   default (FSDP, 4 x 512 tokens, 2 accumulation steps)  model states 27.0 GB, peak ~42.0 GB: fits
#                                                          (chess_finetune.sh passes --accumulate_sharded:
#                                                          only the fp32 gradient shard is kept between
#                                                          micro-batches; add it to the command. Under
#                                                          no_sync, ACCUMULATE_SHARDED=0, the full fp32
#                                                          gradients, 27 GB, make it ~61.6 GB; 35.2 GB
#                                                          in one micro-batch)
#   --no_fsdp                                              model states 107.8 GB (+27 GB of DDP buckets),
#                                                          peak ~163.8 GB: CUDA out of memory in step 1
#   BATCH_SIZE_PER_DEVICE=1 / 2 / 8 (accumulation 8/4/1)   peak ~33.7 / 36.0 / 47.4 GB sharded (52.5 / 55.4
#                                                          under no_sync): all fit;
#                                                          16 would need TOTAL_BATCH_SIZE=64 (~73.7 GB)
#   --gradient_checkpointing                               activations 12.6 -> 0.9 GB, peak ~50.4 GB,
#                                                          about a third more time per step
# Speed: the published FSDP figure for a 7B Llama on A100s is about 3,700 tokens/s per GPU, 57%
# MFU (PyTorch blog "Maximizing training throughput using PyTorch FSDP", IBM and Meta, 2024: 128
# GPUs, 4,096 tokens per sequence); at ~3,000-3,700 tokens/s per GPU a step of 32 sequences (at
# most 512 tokens each) takes about 1-1.5 s. Compare `tokens_per_s` and `mfu` in
# OUTPUT_DIR/metrics.jsonl (mfu counts 6P + 12 L h T FLOPs per token against 312 TFLOP/s per GPU).
# The log ends with two lines to compare: "legal-move rate before training: x% (n/200)" and
# "legal-move rate after training: y% (m/200)": the fine-tuned model should play legal moves far
# more often than the untrained one (the notebook's tiny Llama goes from a few % to about a quarter).
#
# This script only picks the lesson's defaults; the launch (srun, torchrun, the rendezvous, batch
# sizes, requeue on preemption) is slurm/chess_finetune.sh's, run in this same batch shell (exec),
# so SLURM's USR1 warning still reaches its trap. Environment variables: as chess_finetune.sh,
# plus IMPL (minidist or torch). Arguments after the script name go to minidist.finetune and win.
#
#SBATCH --job-name=09-capstone
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --mem=96G
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail

IMPL=${IMPL:-minidist}
# One folder per implementation and job (a requeued job keeps its id, so it resumes from it).
# The run's folder, unless OUTPUT_DIR is set: $SCRATCH/minidist/runs/$RUN_NAME-<job id> (chess_finetune.sh).
export RUN_NAME=09-capstone-$IMPL

# chess_finetune.sh lies beside this script. Under sbatch "this script" is a copy in slurmd's spool
# folder, so ask SLURM for the path that was submitted (relative to the folder it was submitted from).
here=${BASH_SOURCE[0]}
[[ -z ${SLURM_JOB_ID:-} ]] || here=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
launcher=$(cd "${SLURM_SUBMIT_DIR:-.}" && cd "$(dirname "$here")" && pwd)/chess_finetune.sh || true
[[ -f $launcher ]] || { echo "error: $launcher not found: submit this script from its repository's slurm/ folder" >&2; exit 2; }

echo "lesson 09 (capstone): $IMPL/fsdp unless a flag says otherwise; flags: $*; metrics in $OUTPUT_DIR/metrics.jsonl"
exec bash "$launcher" --impl "$IMPL" --strategy fsdp --eval_prefixes 200 "$@"
