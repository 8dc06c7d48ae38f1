#!/bin/bash
# Lesson 08, checkpoints and preemption: CodeLlama-7b fine-tuned on chess with FSDP on one node of
# 4 A100-80GB GPUs, with a time limit too short for the 200 steps, so that SLURM's warning
# (USR1, 300 s before the limit) stops the run, the job requeues itself, and the next start
# resumes from the last checkpoint. The same code as notebooks/08_checkpoints.ipynb, at 7B.
#
#   sbatch slurm/08_checkpoints.sh                                  # sharded checkpoints every 20 steps
#   CHECKPOINT_FORMAT=full sbatch slurm/08_checkpoints.sh           # rank 0 writes one from_pretrained folder
#   SAVE_STEPS=50 IMPL=torch sbatch slurm/08_checkpoints.sh         # PyTorch's FSDP2 instead of FSDP by hand
#   sbatch slurm/08_checkpoints.sh --max_steps 100                  # any minidist.finetune flag, passed on
#   scancel --batch --signal=USR1 <jobid>                           # send the warning now: the same path
#
# Expected outcome (NOT run: this script has not run on GPUs yet). Log lines to look for, in order, in
# 08-checkpoints-<jobid>.out (one log for every start: --open-mode=append):
#   lesson 08: sharded checkpoints in OUTPUT_DIR, SAVE_STEPS=20, start 1; flags:
#   job <id> (start 1): 1 node(s) x 4 GPUs, ...
#   step   20/200 | ...                        checkpoint-20 published, then every SAVE_STEPS
#   USR1: the time limit is near; asking the training to save and stop
#   stopped by SIGUSR1 after step K: saved OUTPUT_DIR/checkpoint-K; exiting with status 75 ...
#   requeueing job <id>; the next start resumes from OUTPUT_DIR/checkpoint-K
#   lesson 08: ... start 2; ...  and  lesson 08: latest names checkpoint-K
#   job <id> (start 2): ...
#   resuming from OUTPUT_DIR/checkpoint-K
#   resumed from OUTPUT_DIR/checkpoint-K at step K (data epoch E, offset O)  (E, O) = divmod(32 K, 3000 games)
#   step K+1/200 | ...                         the loss goes on from where it was
# and OUTPUT_DIR/metrics.jsonl holds each step 1..200 exactly once. The 12-minute limit is chosen
# short (the warning comes at 7 minutes): each start spends a few minutes loading 7B, then ~1.3 s per step (an estimate from the published FSDP speed,
# see lesson 09) plus the saves, so the 200 steps take 2 or 3 starts. Raise --time for real runs.
# Estimates (P = 6.74e9, from `python -m minidist.memory codellama/CodeLlama-7b-hf`): a checkpoint
# holds the fp32 weights and AdamW's two fp32 moments, 12 x P = 80.9 GB. Sharded: each of the 4
# ranks writes its own 20.2 GB file at once (DCP); full: rank 0 gathers and writes all of it
# (27.0 GB of model.safetensors + 53.9 GB of optimizer.pt) and first holds it in CPU memory. At
# 1-2 GB/s per writer that is roughly 10-20 s per save sharded, if the shared file system keeps up
# with 4 writers, against 40-80 s full; at the 340-370 MB/s per writer measured on a CPU VM's disk,
# about 60 s sharded and 230 s full. The stop must save and exit within the 300 s warning
# (torchrun gives the ranks PET_SHUTDOWN_TIMEOUT=270 s, chess_finetune.sh says why): prefer the
# sharded form here. At 7B these figures are arithmetic, not measurements.
#
# This script only picks the lesson's defaults; the launch (srun, torchrun, the rendezvous) and the
# preemption path (the USR1 trap, `scontrol requeue`, --resume when OUTPUT_DIR/latest exists) are
# slurm/chess_finetune.sh's, run in this same batch shell (exec), so SLURM's USR1 reaches its trap.
# Environment variables: as chess_finetune.sh, plus CHECKPOINT_FORMAT (sharded or full).
#
#SBATCH --job-name=08-checkpoints
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --mem=96G
#SBATCH --time=00:12:00
#SBATCH --output=%x-%j.out
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail

export SAVE_STEPS=${SAVE_STEPS:-20}
CHECKPOINT_FORMAT=${CHECKPOINT_FORMAT:-sharded}

# chess_finetune.sh lies beside this script. Under sbatch "this script" is a copy in slurmd's spool
# folder, so ask SLURM for the path that was submitted (relative to the folder it was submitted from).
here=${BASH_SOURCE[0]}
[[ -z ${SLURM_JOB_ID:-} ]] || here=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
launcher=$(cd "${SLURM_SUBMIT_DIR:-.}" && cd "$(dirname "$here")" && pwd)/chess_finetune.sh || true
[[ -f $launcher ]] || { echo "error: $launcher not found: submit this script from its repository's slurm/ folder" >&2; exit 2; }
source "$(dirname "$launcher")/allocation.sh"
# A job keeps its id when it is requeued, so every start of it finds the same OUTPUT_DIR.
outputs "08-checkpoints-${SLURM_JOB_ID:-local}"  # OUTPUT_DIR, unless set: $SCRATCH/minidist/runs/08-checkpoints-<job id>

echo "lesson 08: $CHECKPOINT_FORMAT checkpoints in $OUTPUT_DIR, SAVE_STEPS=$SAVE_STEPS, start $((${SLURM_RESTART_COUNT:-0} + 1)); flags: $*"
[[ -f $OUTPUT_DIR/latest ]] && echo "lesson 08: latest names $(cat "$OUTPUT_DIR/latest")"
exec bash "$launcher" --checkpoint_format "$CHECKPOINT_FORMAT" --save_total_limit 2 "$@"
