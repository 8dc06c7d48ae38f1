#!/bin/bash
# Lesson 00, where the memory goes: a full fine-tune of CodeLlama-7b on ONE A100-80GB GPU, with
# the memory estimate for this very run printed first. The run is meant to fail: it shows what
# does not fit, and the estimate above the error says why.
#
#   sbatch slurm/00_memory.sh                                    # PyTorch DDP on 1 GPU, 4 x 512 tokens
#   IMPL=minidist sbatch slurm/00_memory.sh                      # the hand-written DDP (lesson 02) instead
#   STRATEGY=fsdp sbatch slurm/00_memory.sh                      # FSDP on 1 GPU: nothing to shard with
#   sbatch slurm/00_memory.sh --gradient_checkpointing           # smaller activations, same model states
#   sbatch --gpus-per-node=4 slurm/00_memory.sh                  # 4 GPUs: DDP still replicates everything
#   STRATEGY=fsdp sbatch --gpus-per-node=4 slurm/00_memory.sh    # what fits: FSDP on 4 (chess_finetune.sh)
#
# Expected outcome (estimated, NOT run: this script has not run on GPUs yet). From
#   python -m minidist.memory codellama/CodeLlama-7b-hf --strategy ddp --world_size 1 \
#       --batch_size_per_device 4 --max_seq_length 512 --gpu_memory 80GB
# (the same lines are the first of the job's log):
# - ddp, 1 GPU: model states 107.8 GB (16 bytes x 6.74e9 parameters: fp32 weights 27.0, fp32
#   gradients 27.0, AdamW's two moments 53.9) + DDP's gradient buckets 27.0 GB; peak about
#   161.7 GB, in AdamW's step (its temporary: another 27.0 GB); "fits in 80.00 GB: no; largest
#   batch per device that fits: none, not even 1".
#   The job ends with torch.OutOfMemoryError (CUDA out of memory) in the first step, before
#   any step is logged: weights and buckets (54 GB, allocated when the model is wrapped) + saved
#   activations (15.3 GB) + autocast's bf16 weight copies (13.2 GB) are 83 GB by the end of the
#   first forward; backward's 27 GB of gradients and AdamW's 54 GB of moments never get a chance.
# - STRATEGY=fsdp, 1 GPU: peak about 134.8 GB, out of memory too; --gradient_checkpointing does
#   not change the 107.8 GB of model states either. Only sharding them over GPUs does: FSDP on 4
#   GPUs holds 27.0 GB of model states, peak about 35.2 GB in one micro-batch; with
#   slurm/chess_finetune.sh's 2 accumulation steps (--gradient_accumulation_steps 2) about 42.0 GB
#   with the --accumulate_sharded it passes there (61.6 GB under no_sync, ACCUMULATE_SHARDED=0;
#   lesson 03). The estimate this script prints is of the run it starts: with --accumulate_sharded
#   where chess_finetune.sh will pass it (STRATEGY=fsdp accumulates 8 micro-batches on 1 GPU).
# Exit status: non-zero (the failure is the lesson). Read the estimate, then the traceback.
#
# The launch itself (srun, torchrun, rendezvous, batch sizes, requeue on preemption) is
# slurm/chess_finetune.sh's, run in this same batch shell (exec); this script only asks for one
# GPU, prints the estimate and picks the lesson's strategy. Unlike chess_finetune.sh it runs
# PyTorch's own DDP and FSDP2 by default (IMPL=torch), whose memory lesson 00 counts. Environment
# variables: as chess_finetune.sh (MODEL, DATA, OUTPUT_DIR, TOTAL_BATCH_SIZE, BATCH_SIZE_PER_DEVICE,
# SITE_SETUP, SCRATCH, HF_HOME, ...), plus STRATEGY (ddp or fsdp) and IMPL (torch or minidist).
# Arguments after the script name go to minidist.finetune and win.
#
#SBATCH --job-name=00-memory
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=8
# --mem=0, all of the node's memory: DDP (the default here) reads the fp32 model on every rank, 27 GB each (chess_finetune.sh's header).
#SBATCH --mem=0
#SBATCH --time=00:30:00
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
source "$(dirname "$launcher")/site_setup.sh"  # the site's set-up (module load, conda activate), before any Python
source "$(dirname "$launcher")/allocation.sh"
model_cache  # HF_HOME, where the estimate reads the model's config; or one line
export PYTHONPATH=$(dirname "$(dirname "$launcher")")${PYTHONPATH:+:$PYTHONPATH}  # minidist, from anywhere
cd "${SLURM_SUBMIT_DIR:-$PWD}"
MODEL=${MODEL:-codellama/CodeLlama-7b-hf}
STRATEGY=${STRATEGY:-ddp}
IMPL=${IMPL:-torch}
export BATCH_SIZE_PER_DEVICE=${BATCH_SIZE_PER_DEVICE:-4}
outputs "00-memory-${SLURM_JOB_ID:-local}"  # OUTPUT_DIR, unless set: $SCRATCH/minidist/runs/00-memory-<job id>
# As many ranks as chess_finetune.sh will start: the GPUs SLURM gave this node, times the nodes.
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
export GPUS_PER_NODE
WORLD_SIZE=$((${SLURM_NNODES:-1} * GPUS_PER_NODE))

# chess_finetune.sh reaches TOTAL_BATCH_SIZE by accumulating micro-batches, and the gradients kept
# between them count: the same steps here (a size it refuses, it says why once it starts).
TOTAL=${TOTAL_BATCH_SIZE:-32}
ACCUMULATION=1
if [[ $TOTAL =~ ^[0-9]+$ && $BATCH_SIZE_PER_DEVICE =~ ^[1-9][0-9]*$ ]] && (( TOTAL % (WORLD_SIZE * BATCH_SIZE_PER_DEVICE) == 0 )); then
    ACCUMULATION=$((TOTAL / (WORLD_SIZE * BATCH_SIZE_PER_DEVICE)))
fi

# The estimate for the run about to start: chess_finetune.sh's sizes (bf16, 512 tokens), then the
# flags given to this script that change it (later ones win, as in argparse): every flag of the
# training loop that the estimator takes.
ESTIMATE=(--impl "$IMPL" --strategy "$STRATEGY" --world_size "$WORLD_SIZE" --batch_size_per_device "$BATCH_SIZE_PER_DEVICE"
          --gradient_accumulation_steps "${ACCUMULATION:-1}" --max_seq_length 512 --mixed_precision bf16 --gpu_memory 80GB)
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case ${args[i]} in
        --strategy|--impl|--max_seq_length|--mixed_precision|--batch_size_per_device|--reduce_dtype|--bucket_cap_mb|--ddp_variant)
            ESTIMATE+=("${args[i]}" "${args[i + 1]:-}") ;;
        --gradient_checkpointing|--no_layer_wrap_policy|--accumulate_sharded) ESTIMATE+=("${args[i]}") ;;
        --no_fsdp) ESTIMATE+=(--strategy ddp) ;;
    esac
done
# chess_finetune.sh accumulates sharded where that wins (allocation.sh's sharded_accumulation): ask
# the same rule, in a subshell (the STRATEGY array it fills is its own), so that the estimate is of
# the run it starts.
if ( NNODES=${SLURM_NNODES:-1} GRADIENT_ACCUMULATION_STEPS=$ACCUMULATION ACCUMULATE_SHARDED=${ACCUMULATE_SHARDED:-auto}
     STRATEGY=(--strategy "$STRATEGY")
     sharded_accumulation "$@" >/dev/null
     [[ " ${STRATEGY[*]} " == *" --accumulate_sharded "* ]] ); then
    ESTIMATE+=(--accumulate_sharded)
fi
[[ ${PACK:-1} == 0 ]] || ESTIMATE+=(--pack)  # chess_finetune.sh packs the games unless PACK=0
echo "lesson 00: the memory estimate for this run (python -m minidist.memory $MODEL ${ESTIMATE[*]}):"
python -m minidist.memory "$MODEL" "${ESTIMATE[@]}"
echo "lesson 00: now the run itself, $IMPL/$STRATEGY on $WORLD_SIZE GPU(s); on 1 A100-80GB expect CUDA out of memory in the first step"

# exec: the same process, so SLURM's USR1 reaches chess_finetune.sh's trap directly.
MODEL=$MODEL exec bash "$launcher" --impl "$IMPL" --strategy "$STRATEGY" "$@"
