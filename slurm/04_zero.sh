#!/bin/bash
# Lesson 04: ZeRO-1 and ZeRO-2 by hand (minidist/parallel/zero.py) fine-tuning CodeLlama-7b on
# chess games, on one node of 4 A100-80GB GPUs.
#
#   sbatch slurm/04_zero.sh                                     # ZeRO-2, 8 sequences x 512 tokens per GPU
#   STRATEGY=zero1 sbatch slurm/04_zero.sh                      # ZeRO-1: full gradients on every GPU
#   STRATEGY=ddp sbatch slurm/04_zero.sh                        # minidist's DDP: the run that does not fit
#   sbatch slurm/04_zero.sh --max_steps 20 --eval_prefixes 0    # any minidist.finetune flag, passed on
#
# Expected outcome (estimates: this project has not run this script on GPUs yet; the figures are
# from `python -m minidist.memory codellama/CodeLlama-7b-hf --strategy zero2 --world_size 4
# --gpu_memory 80GB --mixed_precision bf16 --batch_size_per_device 8 --max_seq_length 512`, and
# the same with --strategy zero1 and ddp):
#   zero2  model states 37.1 GB per GPU (13.5 bf16 weights + 3.4 gradient shard + 20.2 fp32
#          master and Adam moments of the shard), peak ~60.0 GB (in forward, before backward
#          makes the gradient shards): fits; largest batch per GPU 14.
#   zero1  model states 47.2 GB (the full 13.5 GB of gradients), peak ~73.5 GB: fits, with little
#          room; largest batch per GPU 9 (BATCH_SIZE_PER_DEVICE=4: peak ~60.3 GB).
#   ddp    model states 107.8 GB (16 bytes x 6.74e9 parameters): out of GPU memory in the first step.
# Every rank sends the same bytes per step with zero1 and zero2: a reduce-scatter of the fp32
# gradients and an all-gather of the bf16 weights, (4 + 2) x P x 3/4 = 30 GB per GPU per step
# (`comm_bytes` in OUTPUT_DIR/metrics.jsonl). The loss curve should match FSDP's
# (`sbatch slurm/chess_finetune.sh`) up to bf16 rounding.
#
# Why 8 per device and no gradient accumulation: inside `no_sync()` micro-batches ZeRO-2 keeps
# the full local gradients until the last one reduce-scatters their sum, so accumulation under
# no_sync would bring back the 13.5 GB that ZeRO-2 saves. TOTAL_BATCH_SIZE 32 = 8 x 4 GPUs x 1.
# (With a smaller BATCH_SIZE_PER_DEVICE, chess_finetune.sh passes --accumulate_sharded: every
# micro-batch is reduce-scattered and only the fp32 shard kept, lesson 04's exercise 3.)
#
# This script only picks the lesson's defaults; the launch (srun, torchrun, the rendezvous,
# requeue on preemption) is slurm/chess_finetune.sh's, run in this same batch shell (exec), so
# SLURM's USR1 warning still reaches its trap. Environment variables: as chess_finetune.sh, plus
# STRATEGY (zero2, zero1 or ddp).
#
#SBATCH --job-name=04-zero
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
# --mem=0, all of the node's memory: ZeRO reads the fp32 model on every rank, 4 x 27 = 108 GB (chess_finetune.sh's header).
#SBATCH --mem=0
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail

export BATCH_SIZE_PER_DEVICE=${BATCH_SIZE_PER_DEVICE:-8}
# The run's folder, unless OUTPUT_DIR is set: $SCRATCH/minidist/runs/$RUN_NAME-<job id> (chess_finetune.sh).
export RUN_NAME=04-zero
STRATEGY=${STRATEGY:-zero2}

# chess_finetune.sh lies beside this script. Under sbatch "this script" is a copy in slurmd's spool
# folder, so ask SLURM for the path that was submitted (relative to the folder it was submitted from).
here=${BASH_SOURCE[0]}
[[ -z ${SLURM_JOB_ID:-} ]] || here=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
launcher=$(cd "${SLURM_SUBMIT_DIR:-.}" && cd "$(dirname "$here")" && pwd)/chess_finetune.sh || true
[[ -f $launcher ]] || { echo "error: $launcher not found: submit this script from its repository's slurm/ folder" >&2; exit 2; }

echo "lesson 04: minidist/$STRATEGY, bf16 (ZeRO's 2 + 2 + 12 bytes per parameter)"
exec bash "$launcher" --impl minidist --strategy "$STRATEGY" "$@"
