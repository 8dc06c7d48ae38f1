#!/bin/bash
# Lesson 07: mixed precision (minidist/parallel/precision.py) fine-tuning CodeLlama-7b on chess
# games with minidist's FSDP, on one node of 4 A100-80GB GPUs: bf16 compute over fp32 master
# weights, or fp32.
#
#   sbatch slurm/07_mixed_precision.sh                           # bf16 gathers and compute, fp32 reduction
#   MIXED_PRECISION=fp32 sbatch slurm/07_mixed_precision.sh      # everything fp32: the comparison run
#   REDUCE_DTYPE=bf16 sbatch slurm/07_mixed_precision.sh         # bf16 reduce-scatter too: fewer bytes
#   sbatch slurm/07_mixed_precision.sh --max_steps 20            # any minidist.finetune flag, passed on
#
# Expected outcome (estimates: this project has not run this script on GPUs yet; the memory
# figures are from `python -m minidist.memory codellama/CodeLlama-7b-hf --impl minidist --strategy
# fsdp --world_size 4 --batch_size_per_device 4 --max_seq_length 512 --gpu_memory 80GB
# --mixed_precision bf16|fp32`; notebooks/07_mixed_precision.ipynb, section 6):
#   bf16 (default)  model states 27.0 GB per GPU (fp32 master shard, gradient shard, Adam moments:
#                   16P/N in both precisions), activations 12.6 GB, peak ~35.3 GB in backward
#                   (largest batch 18); with this script's 2 accumulation steps
#                   (--gradient_accumulation_steps 2) ~42.0 GB with the --accumulate_sharded that
#                   chess_finetune.sh passes (only the fp32 gradient shard kept), ~61.6 GB under
#                   no_sync (ACCUMULATE_SHARDED=0: full gradients summed in fp32): fits. Sent per GPU per micro-batch: the layers all-gathered twice in bf16,
#                   the root (P_root = 262M, kept gathered from forward to backward) once, and per step
#                   an fp32 reduce-scatter: (2 x 2 x (2P - P_root) + 4P) x 3/4 = 59.9 GB per step
#                   with the 2 micro-batches, 40.0 GB in one (`comm_bytes`).
#   MIXED_PRECISION=fp32  activations 22.8 GB, gathered units 2.7 GB, peak ~47.1 GB (largest
#                   batch 9); with the 2 accumulation steps ~53.7 GB sharded, ~73.6 GB under no_sync
#                   (the full gradients are fp32 too): fits; sent 4 x (3P - P_root) x 3/4 = 59.9 GB in one micro-batch,
#                   (4 x 2 x (2P - P_root) + 4P) x 3/4 = 99.5 GB per step with the 2. Much slower:
#                   an A100 does 19.5 TFLOP/s in fp32 (no TF32: PyTorch's default for matmuls)
#                   against 312 in bf16 (NVIDIA A100 datasheet), so expect several times, up to
#                   16x, the bf16 step time (`step_time_s`, `tokens_per_s` in
#                   OUTPUT_DIR/metrics.jsonl; its `mfu` is against the bf16 peak).
#   REDUCE_DTYPE=bf16  the reduce-scatter in bf16 too: (2 x (2P - P_root) + 2P) x 3/4 = 29.9 GB in
#                   one micro-batch (49.8 GB per step with the 2).
# The loss curves of the bf16 and fp32 runs should agree to bf16's rounding (the notebook's
# 2-rank CPU runs of a tiny Llama: within 1.1e-3 over 20 steps); compare the `loss` of the two
# OUTPUT_DIR/metrics.jsonl files. Not measured at 7B.
#
# This script only picks the lesson's defaults; the launch (srun, torchrun, the rendezvous,
# requeue on preemption) is slurm/chess_finetune.sh's, run in this same batch shell (exec), so
# SLURM's USR1 warning still reaches its trap. chess_finetune.sh passes `--mixed_precision bf16`;
# the flag given here comes after it and wins. Environment variables: as chess_finetune.sh, plus
# MIXED_PRECISION (bf16 or fp32) and REDUCE_DTYPE (fp32 or bf16).
#
#SBATCH --job-name=07-mixed-precision
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

MIXED_PRECISION=${MIXED_PRECISION:-bf16}
REDUCE_DTYPE=${REDUCE_DTYPE:-fp32}
# The run's folder, unless OUTPUT_DIR is set: $SCRATCH/minidist/runs/$RUN_NAME-<job id> (chess_finetune.sh).
export RUN_NAME=07-mixed-precision-$MIXED_PRECISION

# chess_finetune.sh lies beside this script. Under sbatch "this script" is a copy in slurmd's spool
# folder, so ask SLURM for the path that was submitted (relative to the folder it was submitted from).
here=${BASH_SOURCE[0]}
[[ -z ${SLURM_JOB_ID:-} ]] || here=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
launcher=$(cd "${SLURM_SUBMIT_DIR:-.}" && cd "$(dirname "$here")" && pwd)/chess_finetune.sh || true
[[ -f $launcher ]] || { echo "error: $launcher not found: submit this script from its repository's slurm/ folder" >&2; exit 2; }

echo "lesson 07: minidist/fsdp, compute $MIXED_PRECISION, gradients reduced in $REDUCE_DTYPE, master weights fp32"
exec bash "$launcher" --impl minidist --strategy fsdp --mixed_precision "$MIXED_PRECISION" --reduce_dtype "$REDUCE_DTYPE" "$@"
