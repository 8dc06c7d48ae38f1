#!/bin/bash
# Lesson 10, more than one node: CodeLlama-7b fine-tuned on chess on 2 nodes of 4 A100-80GB GPUs,
# first with flat FSDP over all 8 GPUs, then with hybrid sharding (HSDP: each node's 4 GPUs shard
# one copy, the 2 nodes replicate it), then HSDP with LoRA (--lora_rank 16: the base frozen, only
# the adapters trained and reduced), all by hand (minidist/parallel/fsdp.py, mesh.py, frozen.py),
# so that the bytes each GPU sends are counted (minidist/parallel/comm.py) and printed per step,
# within its node and across nodes. The same code as notebooks/10_multinode.ipynb (2 simulated
# nodes x 2 CPU ranks), at 7B.
#
#   sbatch slurm/10_multinode.sh                      # 20 steps of each, then the bytes per step
#   sbatch slurm/10_multinode.sh --max_steps 50       # arguments go to all three runs and win
#
# Expected outcome (estimated, NOT run: this script has not run on GPUs yet). Per GPU per step,
# P = 6.74e9, bf16 all-gathers, fp32 reduce-scatter and all-reduce, N = 8 GPUs, S = 4 per node, R = 2:
# - flat FSDP: the layers all-gathered twice and the root (P_root = 262M) once, 23.1 GB, + 23.6 GB
#   reduce-scattered = (2 (2P - P_root) + 4P) x 7/8 = 46.7 GB per GPU. NCCL builds several rings from
#   the topology, each through a node's GPUs over NVLink and out through a NIC, so with one NIC per
#   GPU the 46.7 GB that leave each node are shared by its 4 NICs: 11.68 GB per NIC, 0.47-0.93 s at
#   25-12.5 GB/s, against ~0.27 s of compute at the A100's bf16 peak (~0.53 s at 50% of it);
# - HSDP: within each node (2 (2P - P_root) + 4P) x 3/4 = 40.0 GB per GPU over NVLink, and across
#   nodes only the all-reduce of each GPU's fp32 gradient shard, 2 x (P/4) x 1/2 x 4 bytes = 6.74 GB
#   per NIC (0.27-0.54 s at 25-12.5 GB/s), overlapped with the backward: 1.73x fewer bytes over the
#   network than flat FSDP (8P(N-1)/N against 8P(R-1)/R, less the root's term), 4.3x with 4
#   accumulated micro-batches (BATCH_SIZE_PER_DEVICE=1), whose gathers HSDP keeps on NVLink;
# - memory per GPU (python -m minidist.memory codellama/CodeLlama-7b-hf --impl minidist --strategy
#   hsdp --hsdp_shard_size 4 --world_size 8 --batch_size_per_device 4 --max_seq_length 512
#   --gpu_memory 80GB; and --strategy fsdp): flat FSDP 13.5 GB of model states, peak ~25.0 GB;
#   HSDP FSDP's on 4 GPUs, 27.0 GB, peak ~35.5 GB (0.26 GB of it the all-reduce's shard). Both fit.
# Whether HSDP steps faster than flat FSDP here depends on the NICs and the overlap: compare
# `step_time_s` in the two metrics.jsonl. The two runs' losses agree to rounding: the same data, the
# same average gradient. The printed bytes across nodes by rank are minidist's counter's model (one
# ring in rank order: GPUs 3 and 7 carry flat FSDP's crossing), not what NCCL's rings send per NIC.
# - HSDP + LoRA (rank 16 on q, k, v, o: P_lora = 16,777,216): within a node both flats are still
#   gathered twice (bf16; the root once) and only the adapters reduce-scattered; across nodes only the all-reduce
#   of the adapters' shard, 2 x (P_lora/4) x 1/2 x 4 bytes = 16.8 MB per GPU. Model states per GPU
#   (the same memory command with --lora_rank 16): 3.4 GB instead of 27.0 GB, peak ~14.0 GB.
#
# Each run is slurm/chess_finetune.sh (srun, torchrun, rendezvous, batch sizes), in a folder of its
# own, OUTPUT_DIR/fsdp, OUTPUT_DIR/hsdp and OUTPUT_DIR/hsdp-lora; no time-limit warning and no
# requeue here: the runs are short. Environment variables: as chess_finetune.sh.
#
#SBATCH --job-name=lesson10-multinode
#SBATCH --nodes=2
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
source "$(dirname "$launcher")/site_setup.sh"  # the site's set-up (module load, conda activate), once for the three runs
cd "${SLURM_SUBMIT_DIR:-$PWD}"
source "$(dirname "$launcher")/allocation.sh"
outputs "10-multinode-${SLURM_JOB_ID:-local}"  # OUTPUT_DIR, unless set: $SCRATCH/minidist/runs/10-multinode-<job id>
echo "lesson 10 (more than one node): flat FSDP, then HSDP, then HSDP with LoRA, on ${SLURM_JOB_NUM_NODES:-?} node(s), flags: $*"
describe_nodes  # once here, not once per run: one line per node (GPUs, driver, torch, CUDA, NCCL)

bytes_per_step() {  # NAME FOLDER: what metrics.jsonl says each step sent, in GB
    python - "$1" "$2/metrics.jsonl" <<'EOF'
import json, sys
name, path = sys.argv[1], sys.argv[2]
for line in open(path):
    r = json.loads(line)
    across = r["comm_bytes_across_nodes_by_rank"]
    print(f"{name} step {r['step']}: rank 0 sent {r['comm_bytes_within_node'] / 1e9:.3f} GB within its node, "
          f"{r['comm_bytes_across_nodes'] / 1e9:.3f} GB across nodes (rank-order ring model); the busiest rank "
          f"{max(across) / 1e9:.3f} GB, all ranks {sum(across) / 1e9:.3f} GB | {r['step_time_s']:.2f} s")
EOF
}

for strategy in fsdp hsdp; do
    echo "lesson 10: minidist/$strategy"
    OUTPUT_DIR=$OUTPUT_DIR/$strategy bash "$launcher" --impl minidist --strategy "$strategy" --max_steps 20 "$@"
done
echo "lesson 10: minidist/hsdp with LoRA (rank 16)"
OUTPUT_DIR=$OUTPUT_DIR/hsdp-lora bash "$launcher" --impl minidist --strategy hsdp --lora_rank 16 --max_steps 20 "$@"
for run in fsdp hsdp hsdp-lora; do
    bytes_per_step "$run" "$OUTPUT_DIR/$run"
done
