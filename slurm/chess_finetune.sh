#!/bin/bash
# Fine-tune CodeLlama-7b on chess games with FSDP on one node of 4 A100-80GB GPUs.
#
#   sbatch slurm/chess_finetune.sh                                    # FSDP, the default
#   sbatch slurm/chess_finetune.sh --no_fsdp                          # plain DDP: does 7B fit?
#   BATCH_SIZE_PER_DEVICE=8 sbatch slurm/chess_finetune.sh            # same total batch, less accumulation
#   sbatch slurm/chess_finetune.sh --gradient_checkpointing           # trade compute for memory
#   sbatch --nodes 2 slurm/chess_finetune.sh                          # 8 GPUs on 2 nodes
#
# Expected: FSDP fits (about 27 GB of model state per GPU plus activations); --no_fsdp runs out
# of GPU memory in its first step (16 bytes x 6.7e9 parameters = 108 GB > 80 GB). While loading,
# each rank holds the full fp32 model in host memory before it is sharded: about 4 x 27 GB of
# the node's RAM (--mem=0 asks for all of it).
#
# Before the first job, on a login node with internet, cache the model once:
#   python -m minidist.models download codellama/CodeLlama-7b-hf
# Compute nodes then load it offline (HF_HUB_OFFLINE=1) from $HF_HOME.
#
# Environment variables (all optional): MODEL, DATA, OUTPUT_DIR, TOTAL_BATCH_SIZE,
# BATCH_SIZE_PER_DEVICE, GPUS_PER_NODE, MASTER_PORT. Arguments after the script name go to
# minidist.finetune unchanged and override the defaults below.
#
#SBATCH --job-name=chess-finetune
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --mem=0
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

# sbatch runs a copy of this script from a spool folder: work from where it was submitted.
cd "${SLURM_SUBMIT_DIR:-$PWD}"

MODEL=${MODEL:-codellama/CodeLlama-7b-hf}
DATA=${DATA:-minidist/games/train.jsonl}
OUTPUT_DIR=${OUTPUT_DIR:-runs/chess-${SLURM_JOB_ID:-local}}
TOTAL_BATCH_SIZE=${TOTAL_BATCH_SIZE:-32}
BATCH_SIZE_PER_DEVICE=${BATCH_SIZE_PER_DEVICE:-4}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-4}}
NNODES=${SLURM_NNODES:-1}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}   # compute nodes have no internet: use the cache

# The total batch stays fixed; whatever one device cannot hold at once is accumulated.
WORLD_SIZE=$((NNODES * GPUS_PER_NODE))
PER_STEP=$((WORLD_SIZE * BATCH_SIZE_PER_DEVICE))
if (( TOTAL_BATCH_SIZE % PER_STEP != 0 )); then
    echo "error: TOTAL_BATCH_SIZE=$TOTAL_BATCH_SIZE is not divisible by $WORLD_SIZE GPUs x BATCH_SIZE_PER_DEVICE=$BATCH_SIZE_PER_DEVICE; pick sizes whose product divides it" >&2
    exit 2
fi
GRADIENT_ACCUMULATION_STEPS=$((TOTAL_BATCH_SIZE / PER_STEP))

# Every node runs one torchrun; they meet at a c10d rendezvous on the first node of the job.
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
echo "job ${SLURM_JOB_ID:-?}: $NNODES node(s) x $GPUS_PER_NODE GPUs, rendezvous $HEAD_NODE:$MASTER_PORT," \
     "total batch $TOTAL_BATCH_SIZE = $BATCH_SIZE_PER_DEVICE x $WORLD_SIZE x $GRADIENT_ACCUMULATION_STEPS accumulation"

srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
    torchrun \
    --nnodes "$NNODES" \
    --nproc_per_node "$GPUS_PER_NODE" \
    --rdzv_id "${SLURM_JOB_ID:-0}" \
    --rdzv_backend c10d \
    --rdzv_endpoint "$HEAD_NODE:$MASTER_PORT" \
    -m minidist.finetune \
    --model "$MODEL" \
    --data "$DATA" \
    --output_dir "$OUTPUT_DIR" \
    --batch_size_per_device "$BATCH_SIZE_PER_DEVICE" \
    --gradient_accumulation_steps "$GRADIENT_ACCUMULATION_STEPS" \
    --mixed_precision bf16 \
    --learning_rate 2e-5 \
    --max_seq_length 512 \
    --max_steps 200 \
    --eval_prefixes 200 \
    "$@"
