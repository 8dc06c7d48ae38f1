#!/bin/bash
# Lesson 11, splitting a layer: CodeLlama-7b fine-tuned on chess on one node of 4 A100-80GB GPUs,
# first with tensor parallelism over all 4 GPUs (--strategy ddp --tp_size 4: every layer's matrices
# cut in four, one data-parallel rank), then tensor x data parallel on a 2-D mesh (--strategy fsdp
# --tp_size 2: the layers cut in two, and the hand-written FSDP sharding those halves over 2 GPUs),
# all by hand (minidist/parallel/tensor/, fsdp.py, mesh.py), so that the bytes each GPU sends are
# counted (parallel/comm.py) and printed per step, tensor parallelism's apart from FSDP's. The same
# code as notebooks/11_tensor_parallel.ipynb (CPU ranks), at 7B.
#
#   sbatch slurm/11_tensor_parallel.sh                       # 20 steps of each, then bytes and peaks per step
#   sbatch slurm/11_tensor_parallel.sh --sequence_parallel   # arguments go to both runs and win
#
# Expected outcome (estimated, NOT run: this script has not run on GPUs yet). The total batch stays
# chess_finetune.sh's 32 sequences of at most 512 tokens, 4 per micro-batch: the 4 GPUs of a
# tensor-parallel group see the same 4 sequences, so with tp 4 there is one data-parallel rank and
# 8 accumulated micro-batches, with tp 2 x FSDP 2 two data-parallel ranks and 4.
# - Bytes tensor parallelism sends per GPU per step (parallel/tensor/traffic.py, 4 x 512 tokens per
#   micro-batch; shorter games send less): tp 4, per layer and micro-batch 4 all-reduces of
#   b x s x h = 4 x 512 x 4096 activations, 2(t-1)/t of it each, 101 MB in bf16; with 8
#   micro-batches 26.2 GB per step in all, up to 52.3 GB, as DDP computes under autocast over fp32
#   weights and some activations stay fp32 (the docstring's bound). tp 2 x FSDP 2, bf16 (FSDP's
#   units compute in bf16): 67 MB per layer and micro-batch, 8.7 GB per step for 4 micro-batches;
#   FSDP's own bytes (the halved layers gathered over 2 GPUs) come on top, counted apart:
#   `comm_bytes` minus `comm_bytes_tensor_parallel` in metrics.jsonl.
# - Memory per GPU, from `python -m minidist.memory codellama/CodeLlama-7b-hf --impl minidist
#   --world_size 4 --batch_size_per_device 4 --max_seq_length 512 --mixed_precision bf16 --gpu_memory 80GB`
#   with `--strategy ddp --tp_size 4 --gradient_accumulation_steps 8`: model states 16P/4 = 27.0 GB,
#   peak about 46.3 GB (DDP's buckets and autocast's bf16 copies on top); with `--strategy fsdp
#   --tp_size 2 --gradient_accumulation_steps 4 --accumulate_sharded` (chess_finetune.sh adds the
#   flag on one node): 16P/4 again, peak about 36.7 GB; FSDP alone on the 4 GPUs, 42.0 GB (lesson
#   05). Both fit in 80 GB. (The estimator's figures of 2026-11-26: rerun the command.)
# Which runs faster, and why tensor parallelism stays inside a node, is lessons/11_tensor_parallel.md's
# subject: compare `step_time_s` in the two metrics.jsonl, and with lesson 05's FSDP alone.
# These short runs measure: they save no checkpoint (SAVE_STEPS=0) and no final model (--no_save),
# and are not requeued. `--save_steps 10` (an argument: it wins) tries the sharded checkpoints of a
# tensor-parallel run (minidist/strategy/state/tensor.py) on both layouts.
#
# Each run is slurm/chess_finetune.sh (srun, torchrun, rendezvous), in a folder of its own,
# OUTPUT_DIR/tp4 and OUTPUT_DIR/tp2-fsdp2, with the accumulation this script computes for its data-
# parallel ranks (chess_finetune.sh computes the same from --tp_size, and says so in its log line).
# Environment variables: as chess_finetune.sh (TOTAL_BATCH_SIZE, BATCH_SIZE_PER_DEVICE, MODEL, ...).
#
#SBATCH --job-name=lesson11-tensor-parallel
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
# --mem=0, all of the node's memory: tp 4 under DDP reads the fp32 model on every rank, 4 x 27 = 108 GB (chess_finetune.sh's header).
#SBATCH --mem=0
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

# chess_finetune.sh lies beside this script. Under sbatch "this script" is a copy in slurmd's spool
# folder, so ask SLURM for the path that was submitted (relative to the folder it was submitted from).
here=${BASH_SOURCE[0]}
[[ -z ${SLURM_JOB_ID:-} ]] || here=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
launcher=$(cd "${SLURM_SUBMIT_DIR:-.}" && cd "$(dirname "$here")" && pwd)/chess_finetune.sh || true
[[ -f $launcher ]] || { echo "error: $launcher not found: submit this script from its repository's slurm/ folder" >&2; exit 2; }
source "$(dirname "$launcher")/site_setup.sh"  # the site's set-up (module load, conda activate), once for both runs
cd "${SLURM_SUBMIT_DIR:-$PWD}"
source "$(dirname "$launcher")/allocation.sh"
read_allocation  # NNODES, GPUS_PER_NODE; or one line if this is no job
TOTAL_BATCH_SIZE=${TOTAL_BATCH_SIZE:-32} BATCH_SIZE_PER_DEVICE=${BATCH_SIZE_PER_DEVICE:-4}
whole_number 1 TOTAL_BATCH_SIZE BATCH_SIZE_PER_DEVICE
# Tensor parallelism sends activations on every block's critical path: it belongs on NVLink, inside a node.
if (( NNODES != 1 || GPUS_PER_NODE < 4 || GPUS_PER_NODE % 2 )); then
    echo "error: lesson 11 runs on one node of 4 GPUs (tp 4, then tp 2 x FSDP 2), not $NNODES node(s) x $GPUS_PER_NODE" >&2
    exit 2
fi
outputs "11-tensor-parallel-${SLURM_JOB_ID:-local}"  # OUTPUT_DIR, unless set: $SCRATCH/minidist/runs/11-tensor-parallel-<job id>
echo "lesson 11 (splitting a layer): tp $GPUS_PER_NODE, then tp 2 x FSDP $((GPUS_PER_NODE / 2)), on one node, flags: $*"
describe_nodes  # once here, not once per run: one line per node (GPUs, driver, torch, CUDA, NCCL)

accumulation() {  # TP: the micro-batches each data-parallel rank accumulates (the tp ranks share theirs)
    local data_parallel=$(( GPUS_PER_NODE / $1 )) per_step
    per_step=$(( data_parallel * BATCH_SIZE_PER_DEVICE ))
    if (( TOTAL_BATCH_SIZE % per_step )); then
        echo "error: TOTAL_BATCH_SIZE=$TOTAL_BATCH_SIZE is not divisible by $data_parallel data-parallel rank(s) x" \
             "BATCH_SIZE_PER_DEVICE=$BATCH_SIZE_PER_DEVICE" >&2
        exit 2
    fi
    echo $(( TOTAL_BATCH_SIZE / per_step ))
}

bytes_and_peaks() {  # NAME FOLDER: each step's bytes (tensor parallel apart) and peak memory, from metrics.jsonl
    python - "$1" "$2/metrics.jsonl" <<'EOF'
import json, sys
name, path = sys.argv[1], sys.argv[2]
for line in open(path):
    r = json.loads(line)
    tp = r["comm_bytes_tensor_parallel"] or 0
    peak = "not measured" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 1e9:.2f} GB"
    print(f"{name} step {r['step']}: rank 0 sent {r['comm_bytes'] / 1e9:.3f} GB, tensor parallel {tp / 1e9:.3f} GB, "
          f"data parallel {(r['comm_bytes'] - tp) / 1e9:.3f} GB | peak {peak} (the busiest GPU) | {r['step_time_s']:.2f} s")
EOF
}

# name:strategy:tp size:accumulation, every one checked before the first run starts
RUNS=("tp$GPUS_PER_NODE:ddp:$GPUS_PER_NODE" "tp2-fsdp$((GPUS_PER_NODE / 2)):fsdp:2")
for i in "${!RUNS[@]}"; do
    RUNS[i]=${RUNS[i]}:$(accumulation "${RUNS[i]##*:}")
done
for run in "${RUNS[@]}"; do
    IFS=: read -r name strategy tp steps <<<"$run"
    echo "lesson 11: minidist/$strategy --tp_size $tp: total batch $TOTAL_BATCH_SIZE = $BATCH_SIZE_PER_DEVICE x" \
         "$((GPUS_PER_NODE / tp)) data-parallel rank(s) x $steps accumulation, each micro-batch shared by $tp GPUs"
    SAVE_STEPS=0 TOTAL_BATCH_SIZE=$TOTAL_BATCH_SIZE BATCH_SIZE_PER_DEVICE=$BATCH_SIZE_PER_DEVICE \
        OUTPUT_DIR=$OUTPUT_DIR/$name bash "$launcher" --impl minidist --strategy "$strategy" --tp_size "$tp" \
        --gradient_accumulation_steps "$steps" --max_steps 20 --eval_prefixes 0 --no_save "$@"
done
for run in "${RUNS[@]}"; do
    bytes_and_peaks "${run%%:*}" "$OUTPUT_DIR/${run%%:*}"
done
