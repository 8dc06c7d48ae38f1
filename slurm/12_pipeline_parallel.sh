#!/bin/bash
# Lesson 12, splitting the model by depth: CodeLlama-7b fine-tuned on chess with its 32 decoder layers
# cut into 2 pipeline stages (--pp_size 2, 1F1B), each stage sharded by PyTorch's FSDP2 over the
# GPUs that hold it: on one node of 4 A100-80GB GPUs, pp 2 x FSDP 2 (GPUs 0-1 stage 0, GPUs 2-3
# stage 1); on two such nodes, pp 2 across the nodes x FSDP 4 inside each (node 0 stage 0, node 1
# stage 1: only the activations at the cut cross the network). The stages are run by PyTorch's own
# schedule (torch.distributed.pipelining, minidist/parallel/pipeline/reference.py) around the same
# stages the hand-written executor runs in notebooks/12_pipeline_parallel.ipynb (CPU ranks).
#
#   sbatch slurm/12_pipeline_parallel.sh                        # one node: pp 2 x FSDP2 2, 20 steps
#   sbatch --nodes 2 slurm/12_pipeline_parallel.sh              # two nodes: pp 2 across them x FSDP2 4
#   sbatch slurm/12_pipeline_parallel.sh --pp_schedule gpipe    # arguments go to the run and win
#
# Expected outcome (estimated, NOT run: this script has not run on GPUs yet). The total batch stays
# chess_finetune.sh's 32 sequences of at most 512 tokens, 4 per micro-batch: the 2 stages of a
# pipeline read the same micro-batches, so on one node there are 2 data-parallel ranks and 4
# micro-batches a step (the pipeline's m: its bubble, (p - 1)/(m + p - 1) = 1/5 of the step);
# on two nodes 4 data-parallel ranks and 2 micro-batches (a bubble of 1/3).
# - Memory per GPU: each stage holds half the model, so FSDP2 over 2 GPUs holds 16P/4 of model
#   states, 27.0 GB, as FSDP over all 4 does; 1F1B holds at most 2 micro-batches' activations on
#   the first stage (min(m, p - r)). `python -m minidist.memory codellama/CodeLlama-7b-hf --world_size 4
#   --pp_size 2 --pp_schedule 1f1b --gradient_accumulation_steps 4 --batch_size_per_device 4
#   --max_seq_length 512 --mixed_precision bf16` prints each stage's figures (lesson 12).
# - Bytes between the stages per step: one micro-batch's hidden states each way per cut,
#   4 x 512 x 4096 x 2 bytes (bf16) = 16.8 MB, m times: 67 MB forward and 67 MB back on one node, a
#   fraction of FSDP's gathers (lesson 12's figure 12_bytes_per_step.png).
# These short runs measure: they save no checkpoint (SAVE_STEPS=0, though PyTorch's FSDP2 under a
# pipeline saves and resumes: tests/checkpoint/test_pipeline_checkpoints.py) and no final model
# (--no_save), evaluate nothing (--eval_prefixes 0: the legal-move rate generates through the
# stages, token by token, without a cache), and are not requeued.
#
# The run is slurm/chess_finetune.sh (srun, torchrun, rendezvous) with IMPL=torch, in OUTPUT_DIR;
# chess_finetune.sh splits the total batch over the WORLD_SIZE / --pp_size data-parallel ranks, and
# says so in its log line. Environment variables: as chess_finetune.sh (TOTAL_BATCH_SIZE, ...).
#
#SBATCH --job-name=lesson12-pipeline-parallel
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --mem=96G
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

# chess_finetune.sh lies beside this script. Under sbatch "this script" is a copy in slurmd's spool
# folder, so ask SLURM for the path that was submitted (relative to the folder it was submitted from).
here=${BASH_SOURCE[0]}
[[ -z ${SLURM_JOB_ID:-} ]] || here=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
launcher=$(cd "${SLURM_SUBMIT_DIR:-.}" && cd "$(dirname "$here")" && pwd)/chess_finetune.sh || true
[[ -f $launcher ]] || { echo "error: $launcher not found: submit this script from its repository's slurm/ folder" >&2; exit 2; }
source "$(dirname "$launcher")/site_setup.sh"  # the site's set-up (module load, conda activate)
cd "${SLURM_SUBMIT_DIR:-$PWD}"
source "$(dirname "$launcher")/allocation.sh"
read_allocation  # NNODES, GPUS_PER_NODE; or one line if this is no job
# Two stages: one node's GPUs split in two, or one stage per node.
if (( NNODES > 2 || (NNODES == 1 && GPUS_PER_NODE % 2) )); then
    echo "error: lesson 12 runs 2 pipeline stages on one node (an even number of GPUs) or on 2 nodes, not" \
         "$NNODES node(s) x $GPUS_PER_NODE" >&2
    exit 2
fi
outputs "12-pipeline-parallel-${SLURM_JOB_ID:-local}"  # OUTPUT_DIR, unless set: $SCRATCH/minidist/runs/12-pipeline-parallel-<job id>
echo "lesson 12 (splitting the model by depth): pp 2 x FSDP2 $((NNODES * GPUS_PER_NODE / 2)) on $NNODES node(s)," \
     "flags: $*"

# PyTorch's schedule decides itself which backward reduce-scatters (once per step): no --accumulate_sharded.
SAVE_STEPS=0 ACCUMULATE_SHARDED=0 IMPL=torch OUTPUT_DIR=$OUTPUT_DIR bash "$launcher" --strategy fsdp --pp_size 2 \
    --max_steps 20 --eval_prefixes 0 --no_save "$@"
python - "$OUTPUT_DIR/metrics.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    peak = "not measured" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 1e9:.2f} GB"
    print(f"pp2 step {r['step']}: loss {r['loss']:.4f} | peak {peak} (the busiest GPU) | {r['step_time_s']:.2f} s")
EOF
