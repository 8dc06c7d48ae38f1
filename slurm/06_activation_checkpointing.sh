#!/bin/bash
# Lesson 06: activation checkpointing (minidist/parallel/recompute.py) fine-tuning
# CodeLlama-7b on chess games with minidist's FSDP, on one node of 4 A100-80GB GPUs: the largest
# batch per GPU that fits when each decoder layer is recomputed in backward instead of stored.
#
#   sbatch slurm/06_activation_checkpointing.sh                  # checkpointing, 128 x 512 tokens per GPU
#   GRADIENT_CHECKPOINTING=0 sbatch slurm/06_activation_checkpointing.sh     # the same batch, stored: OOM
#   GRADIENT_CHECKPOINTING=0 BATCH_SIZE_PER_DEVICE=8 sbatch slurm/06_activation_checkpointing.sh
#                                                                 # stored, 8 per GPU x 16 accumulation steps
#   sbatch slurm/06_activation_checkpointing.sh --max_steps 5    # any minidist.finetune flag, passed on
#
# Expected outcome (estimates: this project has not run this script on GPUs yet; the figures are
# from `python -m minidist.memory codellama/CodeLlama-7b-hf --impl minidist --strategy fsdp
# --world_size 4 --max_seq_length 512 --gpu_memory 80GB --batch_size_per_device B
# [--gradient_checkpointing]`, bf16; notebooks/06_activation_checkpointing.ipynb, section 4):
#   default      checkpointing, batch 128 per GPU: saved activations 27.7 GB (each layer keeps
#                only its bf16 input, 8 kB per token: 17.2 GB; the loss's fp32 log-probabilities
#                8.4 GB), plus the logits (16.8 GB) at the end of forward, beside 20.2 GB of
#                parameter and optimizer-state shards and the root's gathered bf16 weights (0.5 GB):
#                peak ~65.2 GB, fits (the recomputed layer, 12.3 GB, comes once the logits are
#                gone). The estimator's largest batch is 170;
#                128 keeps the total batch a power of 2.
#   GRADIENT_CHECKPOINTING=0, batch 128: every layer keeps 96 MB per sequence, peak ~441 GB:
#                CUDA out of memory in the first step. The largest batch that fits without
#                checkpointing is 18 (peak ~79.9 GB at 18; ~47.1 GB at 8).
#   GRADIENT_CHECKPOINTING=0 BATCH_SIZE_PER_DEVICE=8: the same 512 sequences per step in 16
#                micro-batches; fits: ~53.9 GB with the --accumulate_sharded chess_finetune.sh passes
#                (only the fp32 gradient shard kept between micro-batches, a reduce-scatter each);
#                barely under no_sync (ACCUMULATE_SHARDED=0): ~74.0 GB with --gradient_accumulation_steps
#                16, which counts the full gradients minidist's FSDP sums in fp32 (4 x 6.74e9 = 27.0 GB). It gathers every layer twice per micro-batch and the root
#                once: 32 all-gathers of each layer (16 of the root) and one reduce-scatter per step
#                instead of 2 (1) and 1. Same losses as the default run,
#                up to bf16 rounding.
# Time: recomputation is one more forward of the 32 decoder layers, 2 x 6.48e9 FLOPs per token on
# top of 6 x 6.74e9 (Chen et al. 2016; PyTorch's torch.utils.checkpoint docs): expect the
# checkpointed run to process roughly a quarter fewer tokens per second than the stored one at
# the same utilisation (`tokens_per_s` and `mfu` in OUTPUT_DIR/metrics.jsonl; MFU does not count
# the recomputation as useful work), unless the larger batch uses the GPUs better. Not measured.
#
# Why TOTAL_BATCH_SIZE 512: 128 sequences x 4 GPUs in one micro-batch, no accumulation; the
# stored run at 8 per GPU reaches the same 512 with 16 micro-batches, so the two compare
# step for step. 50 steps are at most ~13M tokens (50 x 512 sequences x 512 tokens): enough to read the step time and the memory.
#
# This script only picks the lesson's defaults; the launch (srun, torchrun, the rendezvous,
# requeue on preemption) is slurm/chess_finetune.sh's, run in this same batch shell (exec), so
# SLURM's USR1 warning still reaches its trap. Environment variables: as chess_finetune.sh, plus
# GRADIENT_CHECKPOINTING (1, the default, or 0).
#
#SBATCH --job-name=06-activation-checkpointing
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

export BATCH_SIZE_PER_DEVICE=${BATCH_SIZE_PER_DEVICE:-128}
export TOTAL_BATCH_SIZE=${TOTAL_BATCH_SIZE:-512}
# The run's folder, unless OUTPUT_DIR is set: $SCRATCH/minidist/runs/$RUN_NAME-<job id> (chess_finetune.sh).
export RUN_NAME=06-activation-checkpointing
GRADIENT_CHECKPOINTING=${GRADIENT_CHECKPOINTING:-1}

# chess_finetune.sh lies beside this script. Under sbatch "this script" is a copy in slurmd's spool
# folder, so ask SLURM for the path that was submitted (relative to the folder it was submitted from).
here=${BASH_SOURCE[0]}
[[ -z ${SLURM_JOB_ID:-} ]] || here=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
launcher=$(cd "${SLURM_SUBMIT_DIR:-.}" && cd "$(dirname "$here")" && pwd)/chess_finetune.sh || true
[[ -f $launcher ]] || { echo "error: $launcher not found: submit this script from its repository's slurm/ folder" >&2; exit 2; }

flags=(--impl minidist --strategy fsdp --max_steps 50)
if [[ $GRADIENT_CHECKPOINTING == 1 ]]; then
    flags+=(--gradient_checkpointing)
    echo "lesson 06: minidist/fsdp with activation checkpointing, $BATCH_SIZE_PER_DEVICE sequences per GPU"
else
    echo "lesson 06: minidist/fsdp, activations stored (no checkpointing), $BATCH_SIZE_PER_DEVICE sequences per GPU"
fi
exec bash "$launcher" "${flags[@]}" "$@"
