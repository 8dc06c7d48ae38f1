#!/bin/bash
# Lesson 02: data parallelism by hand (minidist/parallel/ddp.py) on CodeLlama-7b, on one node
# of 4 A100-80GB GPUs. The run that shows why DDP is not enough for a 7B model.
#
#   sbatch slurm/02_ddp.sh                                  # bucketed DDP (25 MB buckets, overlap)
#   DDP_VARIANT=naive sbatch slurm/02_ddp.sh                # all-reduce after backward, one per tensor
#   sbatch slurm/02_ddp.sh --bucket_cap_mb 100              # any minidist.finetune flag, passed on
#   MODEL=/path/to/a/smaller/model sbatch slurm/02_ddp.sh   # a model that fits (see below)
#
# Expected outcome (estimates: this project has not run this script on GPUs yet; from
# `python -m minidist.memory codellama/CodeLlama-7b-hf --impl minidist --strategy ddp
# --world_size 4 --batch_size_per_device 4 --max_seq_length 512 --gpu_memory 80GB`):
#   The model loads and wraps: every GPU holds the fp32 weights (27.0 GB) and, for the bucketed
#   DDP, the gradient buckets (27.0 GB). Then CUDA runs out of memory in the first step, on every
#   rank: autocast's bf16 weight copies (13.2 GB) and the activations (15.3 GB at 4 x 512 tokens)
#   pass 80 GB by the end of the first forward. Once AdamW's two moments (53.9 GB) exist, the
#   estimated peak is about 136.9 GB per GPU for one micro-batch, at the end of forward (the
#   gradients are not there yet), and 163.8 GB with chess_finetune.sh's 2 accumulation steps
#   (--gradient_accumulation_steps 2: the first micro-batch's gradients are still held). Model
#   states alone are 16 bytes x 6.74e9 parameters = 107.8 GB > 80 GB, on any number of GPUs: DDP
#   replicates them. The naive variant has no buckets, and still needs
#   107.8 GB. Lesson 04 (ZeRO) and lesson 05 (FSDP) shard what DDP replicates, and fit.
#   With a model that fits (minidist/memory/moments.py: DDP holds 16 bytes per parameter at the
#   end of forward, weights, moments and buckets, plus the activations and autocast's bf16 weight
#   copies, 2 bytes per parameter; 20 in backward and in AdamW's step, the gradients or the step's
#   4-byte temporary beside them: check with
#   `python -m minidist.memory MODEL --impl minidist --strategy ddp ...`),
#   each step sends 2P(N-1)/N x 4 bytes per GPU (fp32 gradients; `comm_bytes` in
#   OUTPUT_DIR/metrics.jsonl), and the loss curve matches FSDP's on the same model.
#
# This script only picks the lesson's defaults; the launch (srun, torchrun, the rendezvous, the
# accumulation that keeps TOTAL_BATCH_SIZE fixed, requeue on preemption) is
# slurm/chess_finetune.sh's, run in this same batch shell (exec), so SLURM's USR1 warning still
# reaches its trap. Environment variables: as chess_finetune.sh, plus DDP_VARIANT (bucketed or naive).
#
#SBATCH --job-name=02-ddp
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
# --mem=0, all of the node's memory: DDP reads the fp32 model on every rank, 4 x 27 = 108 GB (chess_finetune.sh's header).
#SBATCH --mem=0
#SBATCH --time=00:30:00
#SBATCH --output=%x-%j.out
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail

# The run's folder, unless OUTPUT_DIR is set: $SCRATCH/minidist/runs/$RUN_NAME-<job id> (chess_finetune.sh).
export RUN_NAME=02-ddp
DDP_VARIANT=${DDP_VARIANT:-bucketed}

# chess_finetune.sh lies beside this script. Under sbatch "this script" is a copy in slurmd's spool
# folder, so ask SLURM for the path that was submitted (relative to the folder it was submitted from).
here=${BASH_SOURCE[0]}
[[ -z ${SLURM_JOB_ID:-} ]] || here=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
launcher=$(cd "${SLURM_SUBMIT_DIR:-.}" && cd "$(dirname "$here")" && pwd)/chess_finetune.sh || true
[[ -f $launcher ]] || { echo "error: $launcher not found: submit this script from its repository's slurm/ folder" >&2; exit 2; }

echo "lesson 02: minidist/ddp ($DDP_VARIANT), bf16: 16 bytes per parameter on every GPU"
exec bash "$launcher" --impl minidist --strategy ddp --ddp_variant "$DDP_VARIANT" "$@"
