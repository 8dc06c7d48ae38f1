#!/bin/bash
# Lesson 01, collectives: measure this node's all-reduce bus bandwidth on 4 A100-80GB GPUs with
# minidist's own benchmark (`python -m minidist.bench allreduce`: minidist.parallel.comm.all_reduce
# over nccl, timed as NVIDIA's nccl-tests time it), then the same for reduce-scatter and all-gather.
#
#   sbatch slurm/01_collectives.sh                                    # 1 MiB .. 4 GiB, factor 4
#   sbatch slurm/01_collectives.sh --min_bytes 8 --max_bytes 1G       # any `minidist.bench allreduce` flag
#   OPS=all_reduce sbatch slurm/01_collectives.sh                     # the all-reduce only
#   sbatch --nodes 2 slurm/01_collectives.sh                          # 8 GPUs on 2 nodes: the network joins in
#
# Expected outcome (NOT run: this script has not run on GPUs yet). For each collective a table of
# size, time, algbw = S/t and busbw = algbw x 2(N-1)/N (all-reduce) or x (N-1)/N (reduce-scatter,
# all-gather), the definitions of nccl-tests' doc/PERFORMANCE.md. Small messages are latency-bound
# (tens of microseconds, busbw near 0); busbw rises with the size and levels off from a few
# hundred MB. On A100-SXM4 GPUs joined by NVLink 3 (12 links of 25 GB/s per direction: 300 GB/s
# per GPU and direction) the plateau of the all-reduce busbw is expected around 200-230 GB/s:
# reported with nccl-tests on 8 A100-SXM4-80GB (~200 GB/s at 1 GB, NVIDIA/nccl-tests issue #149)
# and on two NV12-linked A100s (208 GB/s, NVIDIA/nccl-tests issue #178); NCCL's own topology
# model counts 20 GB/s per NVLink 3 link, 240 GB/s per GPU, about 80% of the links' peak
# (NVIDIA/nccl issue #1054). A 4-GPU node whose GPUs are linked by PCIe only would show a few
# tens of GB/s instead. `sent/rank` must read 2(N-1)/N x S = 1.5 S for the all-reduce on 4 GPUs,
# 0.75 S for the others. What it means for training: a DDP step of CodeLlama-7b all-reduces
# 4 x 6.74e9 bytes of fp32 gradients, about 27 GB / (busbw / 1.5), roughly 0.2 s at 200 GB/s.
#
# Why not chess_finetune.sh's launch: that one runs minidist.finetune with a training's flags;
# this job runs another module with no model, data or checkpoints, so its one srun + torchrun
# line is written out below (same rendezvous as there: both read the allocation with
# slurm/allocation.sh).
#
#SBATCH --job-name=01-collectives
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=16
#SBATCH --mem=64G
#SBATCH --time=00:20:00
#SBATCH --output=%x-%j.out
set -euo pipefail

# allocation.sh lies beside this script. Under sbatch "this script" is a copy in slurmd's spool
# folder, so ask SLURM for the path that was submitted (relative to the folder it was submitted from).
here=${BASH_SOURCE[0]}
[[ -z ${SLURM_JOB_ID:-} ]] || here=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
SLURM_DIR=$(cd "${SLURM_SUBMIT_DIR:-.}" && cd "$(dirname "$here")" && pwd) || true
[[ -f $SLURM_DIR/allocation.sh ]] || { echo "error: $SLURM_DIR/allocation.sh not found: submit this script from its repository's slurm/ folder" >&2; exit 2; }
source "$SLURM_DIR/site_setup.sh"  # the site's set-up (module load, conda activate), before anything runs
export PYTHONPATH=$(dirname "$SLURM_DIR")${PYTHONPATH:+:$PYTHONPATH}  # minidist, from anywhere
cd "${SLURM_SUBMIT_DIR:-$PWD}"
OPS=${OPS:-all_reduce reduce_scatter all_gather}
source "$SLURM_DIR/allocation.sh"
read_allocation  # NNODES, GPUS_PER_NODE, HEAD_NODE, MASTER_PORT, srun's CPUs; or one line
echo "lesson 01: collective bandwidth on $NNODES node(s) x $GPUS_PER_NODE GPUs, rendezvous $HEAD_NODE:$MASTER_PORT"
describe_nodes  # one line per node: GPUs, driver, torch, CUDA, NCCL, network variables
command -v nvidia-smi >/dev/null && nvidia-smi topo -m || true  # NV# = NVLink between two GPUs, PIX/SYS = PCIe

# One rendezvous store for every collective's run (each its own --rdzv_id), in a process of its own so that it
# outlives every node's torchrun (is_host=0): else a 2-node job can end in an exit-barrier traceback.
rendezvous_store
node_addresses  # each node's torchrun publishes its NodeAddr, and gloo uses that interface (allocation.sh)
for op in $OPS; do
    # One torchrun per node; every rank times the same calls, rank 0 prints the table.
    srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
        bash -c "$TORCHRUN_HERE" torchrun --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE" \
        --rdzv_id "${SLURM_JOB_ID:-0}-$op" --rdzv_backend c10d --rdzv_endpoint "$HEAD_NODE:$MASTER_PORT" \
        --rdzv_conf is_host=0 \
        -m minidist.bench allreduce --op "$op" --min_bytes 1M --max_bytes 4G --factor 4 "$@"
done
