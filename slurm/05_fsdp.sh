#!/bin/bash
# Lesson 05, FSDP by hand: CodeLlama-7b fine-tuned on chess with minidist's own FSDP
# (minidist/parallel/fsdp.py) on one node of 4 A100-80GB GPUs. The same code as
# notebooks/05_fsdp.ipynb, at 7B.
#
#   sbatch slurm/05_fsdp.sh                            # units per decoder layer: fits
#   sbatch slurm/05_fsdp.sh --no_layer_wrap_policy     # one unit, the whole model: does it fit?
#
# Expected outcome (estimated, NOT run: this script has not run on GPUs yet). From
#   python -m minidist.memory codellama/CodeLlama-7b-hf --impl minidist --strategy fsdp \
#       --world_size 4 --batch_size_per_device 4 --max_seq_length 512 --gpu_memory 80GB [--no_layer_wrap_policy]
# - with the layer wrap policy (33 units: 32 LlamaDecoderLayers and the root): model states
#   16P/N = 27.0 GB per GPU, gathered units (bf16 weights of the root and two layers) 1.33 GB,
#   peak about 35.3 GB, in backward: it fits in 80 GB, and the loss falls over the 200 steps as
#   in slurm/chess_finetune.sh. This script runs chess_finetune.sh's 4 per GPU x 2 accumulation
#   steps, with the --accumulate_sharded that chess_finetune.sh passes there: each unit is
#   reduce-scattered in every micro-batch and only its fp32 shard kept, about 42.0 GB (add
#   --accumulate_sharded to the estimate); with ACCUMULATE_SHARDED=0 (no_sync) the full gradients,
#   summed in fp32 between micro-batches (as FSDP2), make it about 61.6 GB;
# - with --no_layer_wrap_policy: the whole model is gathered at once (13.5 GB of bf16 weights),
#   and in backward its whole gradient arrives beside them (autograd's and the flat one, 2 x 2P
#   bytes for a moment): peak about 60.7 GB in one micro-batch (largest batch per GPU 10); with
#   this script's 2 accumulation steps about 67.4 GB sharded (the default here), but 86.7 GB under
#   no_sync (ACCUMULATE_SHARDED=0), which does NOT fit in 80 GB at any batch per GPU with
#   accumulation (`TOTAL_BATCH_SIZE=16 sbatch slurm/05_fsdp.sh --no_layer_wrap_policy` runs it
#   in one micro-batch of 4 per GPU: 60.7 GB);
# - per micro-batch the layers are all-gathered twice (in bf16) and the root once (it stays
#   gathered from forward to backward, as in FSDP2), and the gradients reduce-scattered once per
#   step in fp32: with the wrap policy ((2k + 1)P - k P_root)(N-1)/N elements for k micro-batches
#   (P_root = 262M: embeddings, final norm, output layer), 1.48x DDP's for k = 1; here, k = 2:
#   (2 x (2P - P_root) x 2 + 4P) bytes x 3/4 = 59.9 GB per step, the `comm_bytes` of
#   OUTPUT_DIR/metrics.jsonl; as one unit, (k + 1)P(N-1)/N, whole-model gathers in bf16:
#   (2 x 2P + 4P) x 3/4 = 40.4 GB (minidist/parallel/fsdp.py's docstring);
# - only rank 0 reads the 27 GB of fp32 weights into host memory; ranks 1-3 build the model on the
#   meta device and receive their 6.7 GB shards by a scatter.
# Read the measured figures per rank from OUTPUT_DIR/metrics.jsonl (`memory_bytes`, `comm_bytes`,
# `peak_memory_bytes`) and compare them with the lines above.
#
# The launch itself (srun, torchrun, rendezvous, batch sizes, requeue on preemption) is
# slurm/chess_finetune.sh's: this script only picks the lesson's flags and hands over to it, so
# the two cannot drift apart. Arguments after the script name are added last and win.
#
#SBATCH --job-name=lesson05-fsdp
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

# chess_finetune.sh lies beside this script. Under sbatch "this script" is a copy in slurmd's spool
# folder, so ask SLURM for the path that was submitted (relative to the folder it was submitted from).
here=${BASH_SOURCE[0]}
[[ -z ${SLURM_JOB_ID:-} ]] || here=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
launcher=$(cd "${SLURM_SUBMIT_DIR:-.}" && cd "$(dirname "$here")" && pwd)/chess_finetune.sh || true
[[ -f $launcher ]] || { echo "error: $launcher not found: submit this script from its repository's slurm/ folder" >&2; exit 2; }
# The run's folder, unless OUTPUT_DIR is set: $SCRATCH/minidist/runs/$RUN_NAME-<job id> (chess_finetune.sh).
export RUN_NAME=05-fsdp
echo "lesson 05 (FSDP by hand): minidist/fsdp on $(basename "${MODEL:-codellama/CodeLlama-7b-hf}"), flags: $*"
# exec: the same process, so SLURM's USR1 reaches chess_finetune.sh's trap directly.
exec bash "$launcher" --impl minidist --strategy fsdp "$@"
