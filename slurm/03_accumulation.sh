#!/bin/bash
# Lesson 03: gradient accumulation on CodeLlama-7b, one node of 4 A100-80GB GPUs. The global
# batch stays at TOTAL_BATCH_SIZE=32 sequences of 512 tokens; each job picks how many sequences a
# GPU computes at once, and accumulates the rest. One job per batch size, the sweep:
#
#   for b in 1 2 4 8; do BATCH_SIZE_PER_DEVICE=$b sbatch slurm/03_accumulation.sh; done
#   BATCH_SIZE_PER_DEVICE=4 sbatch slurm/03_accumulation.sh --impl torch   # PyTorch's FSDP2 instead
#
# Each job runs the hand-written FSDP (minidist/parallel/fsdp.py; a 7B model does not fit with
# DDP, see lesson 02) in bf16 for 30 steps, with no evaluation, and logs per step in
# OUTPUT_DIR=$SCRATCH/minidist/runs/03-accumulation-b<B>-<job id>/metrics.jsonl: `loss`, `step_time_s`,
# `tokens_per_s`, `mfu`, `peak_memory_bytes`, `comm_bytes`. Compare the four jobs' files.
#
# Expected outcome (estimates: this project has not run this script on GPUs yet). Peaks from
# `python -m minidist.memory codellama/CodeLlama-7b-hf --impl minidist --strategy fsdp
# --world_size 4 --mixed_precision bf16 --max_seq_length 512 --gpu_memory 80GB
# --batch_size_per_device B --gradient_accumulation_steps A [--accumulate_sharded]`; bytes from
# fsdp.py's docstring, ((2k + 1)P - k P_root)(N-1)/N elements for k micro-batches under no_sync
# (the layers gathered twice per micro-batch, the root, P_root = 262M, once), k(3P - P_root)(N-1)/N
# sharded (a reduce-scatter per micro-batch), weights gathered in bf16 (2 bytes) and gradients
# reduce-scattered in fp32 (4). chess_finetune.sh passes --accumulate_sharded when it accumulates
# on one node (lesson 03): the sharded columns are what the sweep runs;
# `ACCUMULATE_SHARDED=0 BATCH_SIZE_PER_DEVICE=$b sbatch slurm/03_accumulation.sh` runs no_sync's.
#   B  accumulation  peak per GPU: sharded  no_sync   sent per GPU per step: sharded  no_sync
#   1  8                           33.7 GB  52.5 GB                          320.3 GB  178.8 GB
#   2  4                           36.0 GB  55.4 GB                          160.2 GB   99.5 GB
#   4  2                           42.0 GB  61.6 GB                           80.1 GB   59.9 GB
#   8  1                           47.1 GB  47.1 GB                           40.0 GB   40.0 GB
# Every size fits in 80 GB (the estimate's largest batch per GPU is 18 in one micro-batch; B=16
# would not divide 32 over 4 GPUs anyway, and the script refuses it). Every peak falls in
# backward. Inside no_sync() FSDP keeps each unit's full gradient until the last micro-batch,
# summed in fp32 as FSDP2 does (4 bytes x 6.74e9 = 27.0 GB, "accumulated gradients" in the
# estimate): that is why B=4 peaks above B=8 under no_sync, which does not accumulate. Sharded, only
# the fp32 shard is kept (6.7 GB), for one more reduce-scatter per extra micro-batch. The loss curves of the four jobs should coincide up to bf16
# rounding (the same global batches, normalised by their token count). Time per step should fall
# and tokens/s rise with B: fewer, larger micro-batches, and with FSDP fewer all-gathers.
#
# This script only picks the lesson's defaults; the launch (srun, torchrun, the rendezvous, the
# accumulation steps computed from TOTAL_BATCH_SIZE, requeue on preemption) is
# slurm/chess_finetune.sh's, run in this same batch shell (exec), so SLURM's USR1 warning still
# reaches its trap. Environment variables: as chess_finetune.sh.
#
#SBATCH --job-name=03-accumulation
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --mem=96G
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail

export TOTAL_BATCH_SIZE=${TOTAL_BATCH_SIZE:-32}
export BATCH_SIZE_PER_DEVICE=${BATCH_SIZE_PER_DEVICE:-4}
# The run's folder, unless OUTPUT_DIR is set: $SCRATCH/minidist/runs/$RUN_NAME-<job id> (chess_finetune.sh).
export RUN_NAME=03-accumulation-b${BATCH_SIZE_PER_DEVICE}

# chess_finetune.sh lies beside this script. Under sbatch "this script" is a copy in slurmd's spool
# folder, so ask SLURM for the path that was submitted (relative to the folder it was submitted from).
here=${BASH_SOURCE[0]}
[[ -z ${SLURM_JOB_ID:-} ]] || here=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
launcher=$(cd "${SLURM_SUBMIT_DIR:-.}" && cd "$(dirname "$here")" && pwd)/chess_finetune.sh || true
[[ -f $launcher ]] || { echo "error: $launcher not found: submit this script from its repository's slurm/ folder" >&2; exit 2; }

echo "lesson 03: total batch $TOTAL_BATCH_SIZE, $BATCH_SIZE_PER_DEVICE per device, the rest accumulated"
exec bash "$launcher" --impl minidist --strategy fsdp --max_steps 30 --eval_prefixes 0 --no_save "$@"
