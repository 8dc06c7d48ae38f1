#!/bin/bash
# Fine-tune CodeLlama-7b on chess games with FSDP on one node of 4 A100-80GB GPUs. The code that
# runs is the course's own FSDP, written by hand (--impl minidist: minidist/parallel/fsdp.py,
# lesson 05); IMPL=torch runs PyTorch's FSDP2 (fully_shard) instead, as the reference.
#
#   sbatch slurm/chess_finetune.sh                                    # FSDP by hand, the default
#   IMPL=torch sbatch slurm/chess_finetune.sh                         # PyTorch's FSDP2, the reference
#   SBATCH_CONSTRAINT=gpu80 sbatch slurm/chess_finetune.sh            # only 80 GB GPUs (the name is your site's)
#   sbatch slurm/chess_finetune.sh --no_fsdp                          # plain DDP: does 7B fit?
#   BATCH_SIZE_PER_DEVICE=8 sbatch slurm/chess_finetune.sh            # same total batch, less accumulation
#   ACCUMULATE_SHARDED=0 sbatch slurm/chess_finetune.sh               # accumulate full gradients under no_sync
#   PACK=0 sbatch slurm/chess_finetune.sh                             # pad every game instead of packing rows
#   sbatch slurm/chess_finetune.sh --gradient_checkpointing           # trade compute for memory
#   sbatch slurm/chess_finetune.sh --tp_size 2                        # tp 2 x FSDP 2: lesson 11 (the batch splits over 2)
#   IMPL=torch sbatch slurm/chess_finetune.sh --pp_size 2             # pp 2 x FSDP2 2: lesson 12 (the batch splits over 2)
#   sbatch --nodes 2 slurm/chess_finetune.sh                          # 8 GPUs on 2 nodes: HSDP
#   sbatch --nodes 2 slurm/chess_finetune.sh --strategy fsdp          # 8 GPUs, flat FSDP over all 8
#
# More than one node: unless the arguments choose a strategy (--strategy, --no_fsdp), the run uses
# hybrid sharding (--strategy hsdp, lesson 10): each node's GPUs shard one copy of the model states
# (all-gathers and reduce-scatters over NVLink), and the nodes only all-reduce their gradient
# shards over the network, 2(P/4)(R-1)/R elements per GPU for R nodes of 4 GPUs, instead of flat
# FSDP's (3P - P_root)(N-1)/N on rings that cross the network. NCCL spreads its rings' crossings
# over a node's NICs (typically one per GPU), so per NIC, for CodeLlama-7b in bf16 with fp32
# reductions on 2 nodes: HSDP 6.7 GB per step, flat FSDP 11.7 GB (1.73x; 4.3x with 4 accumulated
# micro-batches, whose all-gathers HSDP keeps on NVLink; formulas in minidist/parallel/across_nodes.py,
# not measured). Memory per GPU is FSDP's on 4 GPUs (27 GB of model states).
#
# Accumulation (lesson 03): the default, 4 per GPU on 4 GPUs for a total batch of 32, runs 2
# micro-batches a step. On one node with a strategy that shards gradients (FSDP, HSDP, ZeRO-2) the
# script then passes --accumulate_sharded: every micro-batch is reduce-scattered and only the fp32
# shard of the gradient is kept, instead of the full fp32 gradient (27.0 GB) kept under no_sync.
# For CodeLlama-7b, 42.0 GB per GPU instead of 61.6 GB, for 20.2 GB more sent per GPU per step (one
# more reduce-scatter of 4P(N-1)/N bytes, over NVLink; estimates: python -m minidist.memory, below).
# On more than one node it stays off (one line says so): each extra micro-batch would also send
# HSDP's all-reduce of the shards, or flat FSDP's reduce-scatter, over the network. ACCUMULATE_SHARDED
# chooses: auto (the default, as above), 0 (no_sync everywhere) or 1 (sharded on any node count). It is
# never passed with --no_fsdp, --strategy ddp or zero1, which keep full gradients anyway.
#
# Packing (lesson 03): by default the script passes --pack: whole games are packed into rows of 512
# tokens, each attending to itself alone (a block-diagonal mask; flash-attention's variable-length
# kernel instead where the flash_attn package is installed), rather than each padded to the
# longest game of its micro-batch. With Llama 2's tokenizer, whose 32,000 entries CodeLlama's
# keeps (adding special tokens for infilling, 32,016 in all), the bundled games take 342 tokens at
# the median (394 on average; 35.4% are longer than 512 and cut); over this job's 200 steps 30.4%
# of the positions the GPUs compute are padding without packing and 8.6% with it, so where time follows positions, as on GPUs at 7B,
# --pack computes the same games up to 1.31x faster (`python -m minidist.bench packing --only
# arithmetic --tokenizer codellama/CodeLlama-7b-hf`, with the model cached; the figures here are
# from Llama 2's vocabulary as llama.cpp ships it, the hub being out of reach where they were
# counted; not yet measured on a GPU). The loss is the same up to rounding: the same games, the
# same target count. PACK=0 pads every game instead.
#
# Preemption and time limits: 300 s before the limit SLURM sends USR1 to this script; it passes the
# signal on to the training, which finishes its step, writes a checkpoint to OUTPUT_DIR and exits;
# then the script requeues the job, and the next start resumes from OUTPUT_DIR/latest (a job
# keeps its id, hence its OUTPUT_DIR, across restarts). Its output is appended to one log.
#
# Expected: FSDP fits (about 27 GB of model state per GPU plus activations); --no_fsdp runs out
# of GPU memory in its first step (16 bytes x 6.7e9 parameters = 108 GB > 80 GB). Host memory
# while loading: both FSDPs read the weights on rank 0 only, the whole fp32 model, about 27 GB
# (6.74e9 x 4 bytes); the other ranks build the model's shapes on the meta device, wait for rank
# 0's read on a CPU barrier (an hour's timeout), and receive their shards: the hand-written FSDP
# scatters them, FSDP2 (IMPL=torch) loads them from rank 0 through PyTorch's distributed
# state-dict API. So the job asks for 96 GB of the node's memory (--mem=96G: the 27 GB read, each
# rank's process, CUDA context and pinned buffers, and room to spare), not the whole node
# (--mem=0), which would keep the other GPUs of an 8-GPU node idle too. DDP (--no_fsdp), ZeRO and
# tensor parallelism under DDP load the model on every rank, 4 x 27 = 108 GB, and --cpu_offload
# keeps the fp32 weights and AdamW's moments on the host (81 GB): submit those with
# `sbatch --mem=0 ...` (all of the node's memory; the command line overrides the line below).
# The #SBATCH --gpus-per-node line needs SLURM's cons_tres plugin (`scontrol show config | grep
# SelectType`); under the older cons_res, submit with `sbatch --gres=gpu:4 ...` instead.
# The hand-written strategies have run on one GPU only (an H100, world size 1, a
# 0.8B model, on older code: lessons/reference/gpu.md); this script has not run on GPUs yet.
#
# On a real cluster (each of these is optional; the job's log shows what it got):
# - Site set-up: before anything else, the script sources SITE_SETUP (default slurm/site.sh, if
#   there is one): the `module load` and `conda activate` your site needs before `python` works.
#   For example, on a Princeton-style cluster (an example: module names and versions are your
#   site's), a file ~/minidist-site.sh holding
#       module purge; module load anaconda3/2024.6 cudatoolkit/12.4; conda activate minidist
#   submitted as `SITE_SETUP=~/minidist-site.sh sbatch slurm/chess_finetune.sh` (slurm/site_setup.sh).
# - GPU type: #SBATCH lines cannot read variables, so a GPU constraint is given at submission,
#   with SLURM's own variable SBATCH_CONSTRAINT or `sbatch --constraint=...`. Without one the job
#   may land on A100-40GB nodes, where this run does not fit (`python -m minidist.memory
#   codellama/CodeLlama-7b-hf --world_size 4 --batch_size_per_device 4 --gradient_accumulation_steps 2
#   --max_seq_length 512 --mixed_precision bf16 --accumulate_sharded` puts it at 42.0 GB a GPU for
#   either implementation, 61.6 GB without --accumulate_sharded); many sites name the 80 GB ones with a feature such as `gpu80`, but
#   the name is site-specific (`sinfo -o "%N %f"` lists the features of each node). A feature no
#   node has is refused by sbatch ("Invalid feature specification"). Either way, before anything
#   loads, the script asks every node's nvidia-smi for its GPUs' memory and holds the smallest
#   against the estimate of this very run (with a 5 GB reserve): a run that would stop, out of
#   memory, at its first step is refused in one line that names the changes of flags that fit
#   (on an A100-40GB: --gradient_checkpointing, --cpu_offload, or BATCH_SIZE_PER_DEVICE=2).
# - Model cache: HF_HOME, by default $SCRATCH/hf (SCRATCH by default /scratch/$USER), not the home
#   directory, whose quota the 13.5 GB model would fill; created if missing, one line if it cannot be.
#   It and OUTPUT_DIR (below) need a file system every node of the job sees: where /scratch is
#   each node's own disk (some sites), set SCRATCH to the shared one (`df -h`, or the site's
#   documentation, says which).
# - Outputs: OUTPUT_DIR, by default $SCRATCH/minidist/runs/chess-<job id>, not under the folder the
#   job was submitted from (usually a clone in the home directory): a sharded checkpoint of
#   CodeLlama-7b holds 80.9 GB, three are on the disk at once before the rotation removes the
#   oldest (243 GB), and the 13.5 GB model comes at the end. After its first step the run says in one
#   line how much it will write and how much the disk has free, and stops there if it does not fit
#   (minidist/checkpoint/disk_room.py; a quota may allow less than the free space: `quota -s`).
# - Two nodes: NCCL_SOCKET_IFNAME (say ib0) and NCCL_IB_HCA (say mlx5_0), when the site tells you
#   to set them, reach the ranks on every node; unset or empty, NCCL chooses.
# - At each start, one line per node: its GPUs, memory and driver (nvidia-smi), and the torch,
#   CUDA and NCCL versions the ranks import.
#
# Before the first job, on a login node with internet, cache the model once, where the job reads it:
#   HF_HOME=${SCRATCH:-/scratch/$USER}/hf python -m minidist.hf.models download codellama/CodeLlama-7b-hf
# Compute nodes then load it offline (HF_HUB_OFFLINE=1) from $HF_HOME.
#
# Environment variables (all optional): IMPL (minidist or torch), MODEL, DATA, OUTPUT_DIR, RUN_NAME,
# TOTAL_BATCH_SIZE, BATCH_SIZE_PER_DEVICE, ACCUMULATE_SHARDED, PACK, GPUS_PER_NODE, MASTER_PORT, SAVE_STEPS,
# PET_SHUTDOWN_TIMEOUT, SITE_SETUP, SCRATCH, HF_HOME, NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_DEBUG,
# TORCH_NCCL_TRACE_BUFFER_SIZE, PYTORCH_CUDA_ALLOC_CONF (the defaults below); and, read
# by sbatch itself, SBATCH_CONSTRAINT. Arguments after the script name go to minidist.finetune
# unchanged and override the defaults below (`--impl torch` as well as IMPL=torch).
#
#SBATCH --job-name=chess-finetune
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
# SLURM's warning may come at any moment, this one included: from here on it is remembered, and
# passed on to the training once that runs (the trap's full story is above the launch line).
TRAIN_PID= STOP_REQUESTED=0 MINIDIST_STOP_FILE=
ask_to_stop() {
    STOP_REQUESTED=1
    echo "USR1: the time limit is near; asking the training to save and stop"
    # srun drops a signal that comes before its tasks started; the file is seen at the next step.
    [[ -n $MINIDIST_STOP_FILE ]] && mkdir -p "$OUTPUT_DIR" && touch "$MINIDIST_STOP_FILE" || true
    [[ -n $TRAIN_PID ]] && kill -USR1 "$TRAIN_PID" || true
}
trap ask_to_stop USR1

# Work from where the job was submitted: relative paths (DATA, OUTPUT_DIR) are read from there.
cd "${SLURM_SUBMIT_DIR:-$PWD}"
# The repository: sbatch runs a copy of this script from slurmd's spool folder, so its own path
# says nothing; SLURM remembers the path that was submitted (relative to the submit folder).
SUBMITTED=
if [[ -n ${SLURM_JOB_ID:-} ]]; then
    SUBMITTED=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=\([^ ]*\).*/\1/p') || true
fi
SUBMITTED=${SUBMITTED:-${BASH_SOURCE[0]}}  # outside SLURM: this file itself
REPO=$(cd "$(dirname "$SUBMITTED")/.." && pwd)
[[ -f $REPO/slurm/allocation.sh ]] || { echo "error: cannot find the repository from $SUBMITTED" >&2; exit 2; }
# The site's set-up (module load, conda activate), before anything runs: SITE_SETUP, or slurm/site.sh.
source "$REPO/slurm/site_setup.sh"
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}  # so that `-m minidist.finetune` runs from anywhere

IMPL=${IMPL:-minidist}  # the hand-written FSDP; torch: PyTorch's FSDP2, the reference
MODEL=${MODEL:-codellama/CodeLlama-7b-hf}
DATA=${DATA:-$REPO/minidist/chess/data/train.jsonl}
TOTAL_BATCH_SIZE=${TOTAL_BATCH_SIZE:-32}
BATCH_SIZE_PER_DEVICE=${BATCH_SIZE_PER_DEVICE:-4}
# A sharded 7B checkpoint with AdamW holds 80.9 GB (12 bytes per parameter: fp32 weights and two
# moments), 20.2 GB per rank. Measured here (a CPU VM's local disk, DCP with fsync): 340-370 MB/s
# per rank, so about 60 s per rank, plus ~4 s of checksums (minidist/checkpoint/checksums.py). A shared file
# system giving 0.5-2 GB/s to the node in all needs 40-160 s. Hence the warning 300 s before the
# limit (--signal above) and 270 s for torchrun's workers to save (PET_SHUTDOWN_TIMEOUT below):
# enough down to 0.3 GB/s in all. With 90 s and 80 s, a slow file system would be killed mid-save
# (the previous checkpoint survives, but the steps since it are lost). 100 steps are about 2 minutes at ~1.3 s per step (32 x 512 tokens
# on 4 A100s, derived from the published ~3,700 tokens/s per GPU of lesson 09), so saves add a
# tenth to a half; raise SAVE_STEPS for long runs. Two checkpoints are kept. (Estimates: no 7B
# run of this project has been timed yet.)
SAVE_STEPS=${SAVE_STEPS:-100}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}   # compute nodes have no internet: use the cache
source "$REPO/slurm/allocation.sh"
whole_number 1 TOTAL_BATCH_SIZE BATCH_SIZE_PER_DEVICE
whole_number 0 SAVE_STEPS
if [[ $IMPL != minidist && $IMPL != torch ]]; then
    echo "error: IMPL=$IMPL must be minidist (FSDP by hand) or torch (PyTorch's FSDP2)" >&2
    exit 2
fi
if [[ ! ${ACCUMULATE_SHARDED:=auto} =~ ^(auto|0|1)$ ]]; then
    echo "error: ACCUMULATE_SHARDED=$ACCUMULATE_SHARDED must be auto, 1 (sharded accumulation) or 0 (no_sync)" >&2
    exit 2
fi
if [[ ! ${PACK:=1} =~ ^(0|1)$ ]]; then
    echo "error: PACK=$PACK must be 1 (whole games packed into rows) or 0 (every game padded)" >&2
    exit 2
fi
PACKING=()
(( PACK )) && PACKING=(--pack)
read_allocation  # NNODES, GPUS_PER_NODE, HEAD_NODE, MASTER_PORT; or one line if this is no job
model_cache      # HF_HOME, off the home directory; or one line
# OUTPUT_DIR, by default $SCRATCH/minidist/runs/chess-<job id> (a lesson script names its own run:
# RUN_NAME), off the home directory's quota; or one line.
outputs "${RUN_NAME:-chess}-$SLURM_JOB_ID"
# The stop file stands in for a warning that srun dropped (minidist/checkpoint/preemption.py); each start
# begins without one. Removed before it is named, so a warning now cannot be lost to the `rm`.
rm -f "$OUTPUT_DIR/stop-requested"
export MINIDIST_STOP_FILE=$OUTPUT_DIR/stop-requested
# What a GPU job should leave behind when it goes wrong, unless the site or the learner chose
# otherwise (each is only read by a GPU build of torch; the CPU ranks of the tests ignore them):
# - NCCL's warnings (NCCL_DEBUG=WARN): a connection that fails names itself, where NCCL says nothing
#   by default; INFO adds the rings and channels it built (lesson 10).
# - PyTorch's flight recorder: each rank keeps its last 2,000 collectives, and when one times out
#   writes them to OUTPUT_DIR/nccl-trace/rank-<rank> (TORCH_NCCL_TRACE_BUFFER_SIZE,
#   TORCH_NCCL_DUMP_ON_TIMEOUT, TORCH_NCCL_DEBUG_INFO_TEMP_FILE: the names every torch from 2.6 on
#   reads), which `python -m torch.distributed.flight_recorder.fr_trace OUTPUT_DIR/nccl-trace` reads
#   back: which rank stopped at which collective, the question a hang asks.
# - The caching allocator's expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True):
#   a segment grows by mapping more memory instead of new blocks of fixed sizes, so fragmentation
#   does not turn a run that fits into one that runs out of memory.
mkdir -p "$OUTPUT_DIR/nccl-trace"
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000} TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-$OUTPUT_DIR/nccl-trace/rank-}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

# The total batch stays fixed; whatever one device cannot hold at once is accumulated. With
# --tp_size T among the arguments (lesson 11), T GPUs share each micro-batch; with --pp_size P
# (lesson 12), the P stages of a pipeline do: the batch is split over the WORLD_SIZE / (T x P)
# data-parallel ranks only (and a pipeline's micro-batches are the accumulation steps).
WORLD_SIZE=$((NNODES * GPUS_PER_NODE))
TP_SIZE=1 PP_SIZE=1 ARGS=("$@")
for i in "${!ARGS[@]}"; do
    case ${ARGS[i]} in
        --tp_size=*) TP_SIZE=${ARGS[i]#--tp_size=} ;;
        --tp_size) TP_SIZE=${ARGS[i + 1]:-} ;;
        --pp_size=*) PP_SIZE=${ARGS[i]#--pp_size=} ;;
        --pp_size) PP_SIZE=${ARGS[i + 1]:-} ;;
    esac
done
for size in "--tp_size $TP_SIZE" "--pp_size $PP_SIZE"; do
    if [[ ! ${size#* } =~ ^[1-9][0-9]*$ ]] || (( WORLD_SIZE % ${size#* } != 0 )); then
        echo "error: $size must be a whole number that divides the $WORLD_SIZE GPUs of the job" >&2
        exit 2
    fi
done
# A tensor-parallel group is TP_SIZE consecutive ranks (minidist/parallel/mesh.py), and a node's ranks
# are consecutive: the group stays inside a node when TP_SIZE divides the GPUs of one. Across nodes
# its all-reduces (2 per layer per micro-batch forward, 2 backward, each of a whole activation, on
# the critical path) would go over the network at a tenth of NVLink's speed or less: refused.
if (( TP_SIZE > 1 && GPUS_PER_NODE % TP_SIZE != 0 )); then
    echo "error: --tp_size $TP_SIZE does not divide the $GPUS_PER_NODE GPUs of a node: its groups would span nodes and send" \
         "every layer's activations over the network; pick a --tp_size that divides $GPUS_PER_NODE, and use more nodes" \
         "through data parallelism (--strategy hsdp) or a pipeline (--pp_size)" >&2
    exit 2
fi
DATA_PARALLEL=$((WORLD_SIZE / TP_SIZE / PP_SIZE)) SPLIT="$WORLD_SIZE GPUs" CUTS=""
(( TP_SIZE > 1 )) && CUTS+=" / --tp_size $TP_SIZE"
(( PP_SIZE > 1 )) && CUTS+=" / --pp_size $PP_SIZE"
[[ -n $CUTS ]] && SPLIT="$DATA_PARALLEL data-parallel rank(s) ($WORLD_SIZE GPUs$CUTS)"
PER_STEP=$((DATA_PARALLEL * BATCH_SIZE_PER_DEVICE))
if (( TOTAL_BATCH_SIZE % PER_STEP != 0 )); then
    echo "error: TOTAL_BATCH_SIZE=$TOTAL_BATCH_SIZE is not divisible by $SPLIT x BATCH_SIZE_PER_DEVICE=$BATCH_SIZE_PER_DEVICE; pick sizes whose product divides it" >&2
    exit 2
fi
GRADIENT_ACCUMULATION_STEPS=$((TOTAL_BATCH_SIZE / PER_STEP))

echo "job ${SLURM_JOB_ID:-?} (start $((${SLURM_RESTART_COUNT:-0} + 1))): $NNODES node(s) x $GPUS_PER_NODE GPUs, rendezvous $HEAD_NODE:$MASTER_PORT," \
     "total batch $TOTAL_BATCH_SIZE = $BATCH_SIZE_PER_DEVICE x $DATA_PARALLEL x $GRADIENT_ACCUMULATION_STEPS accumulation$( \
     [[ -n $CUTS ]] && echo " over $SPLIT")"
describe_nodes  # one line per node: GPUs, driver, torch, CUDA, NCCL, network variables
CONSTRAINT=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/.* Features=\([^ ]*\).*/\1/p') || true
echo "GPU constraint: $( [[ -n $CONSTRAINT && $CONSTRAINT != "(null)" ]] && echo "$CONSTRAINT" ||
     echo "none (any GPU type: SBATCH_CONSTRAINT=... sbatch asks for one, see the header)")"

# More than one node and no strategy chosen: hybrid sharding, shard within a node (see the header).
STRATEGY=() CHOSEN=0
for arg in "$@"; do
    case $arg in --strategy|--strategy=*|--no_fsdp) CHOSEN=1 ;; esac
done
if (( NNODES > 1 && ! CHOSEN )); then
    STRATEGY=(--strategy hsdp)
    echo "$NNODES nodes: hybrid sharding (--strategy hsdp): $GPUS_PER_NODE GPUs shard each copy, the nodes replicate"
fi

# More than one micro-batch and a strategy that shards gradients: --accumulate_sharded on one node,
# where it wins (see the header; the rule is allocation.sh's sharded_accumulation, lesson 00's estimate reads it too).
sharded_accumulation "$@"

# A checkpoint from an earlier start of this job (or an earlier job with this OUTPUT_DIR): go on from it.
# A start killed just after publishing its first checkpoint leaves no `latest` yet: --resume finds
# the checkpoint all the same (the newest complete one, and says so).
RESUME=()
if [[ -f "$OUTPUT_DIR/latest" || -n $(find "$OUTPUT_DIR" -maxdepth 1 -regex '.*/checkpoint-[0-9]+' -print -quit 2>/dev/null) ]]; then
    RESUME=(--resume)
    echo "resuming from $( [[ -f $OUTPUT_DIR/latest ]] && echo "$OUTPUT_DIR/$(cat "$OUTPUT_DIR/latest")" || echo "the newest complete checkpoint in $OUTPUT_DIR")"
fi

# The warning signal's path: this shell -> srun, which forwards USR1 to its task on every node
# (SIGTERM it would turn into SIGKILL) -> torchrun, which forwards the signals listed in
# PET_SIGNALS_TO_HANDLE to its workers (torch >= 2.9; an older torchrun dies of USR1, but its
# ranks get USR1 from srun too, and see at the next step boundary that their launcher is gone: they
# save all the same, minidist/checkpoint/preemption.py; not tried under SLURM with an old torchrun,
# where the step's leftover processes may be ended first, and then the next start resumes from the
# last SAVE_STEPS checkpoint) and gives them PET_SHUTDOWN_TIMEOUT
# seconds to save and exit before it kills them (raise it with a longer `--signal` warning).
# torchrun then logs a SignalException traceback for USR1: that is its way of saying it was
# signalled, not an error in the training. srun passes a signal to every process of its step,
# so the ranks get USR1 from srun and again from torchrun: one flag, one checkpoint.
#
# A warning that comes before the ranks installed their handler (while torchrun and Python start,
# the first seconds of a start) kills them, with no new checkpoint; as no step has run since the
# last one, nothing is lost: the job requeues below and resumes from OUTPUT_DIR/latest (the last
# SAVE_STEPS checkpoint, or the one a previous start saved when it stopped). One that comes
# before the training started at all requeues at once, without starting it. One that comes in
# the second between srun's start and its tasks' start, srun drops: the stop file stands in, and
# the ranks stop after their first step, with a checkpoint (a CI run saw this happen).
export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 PET_SHUTDOWN_TIMEOUT=${PET_SHUTDOWN_TIMEOUT:-270}
# Whether this site's torchrun can do either is read from its own flags, not assumed from a version:
# one line for each it cannot do, and what then happens at the time limit.
TORCHRUN_FLAGS=$(torchrun --help 2>/dev/null) || true
if [[ $TORCHRUN_FLAGS != *--signals-to-handle* ]]; then
    echo "warning: this torchrun cannot pass SLURM's warning (USR1) on to its workers (--signals-to-handle, torch" \
         ">= 2.9): at the time limit it dies of the signal, and the ranks save only if they outlive it; else" \
         "the next start resumes from the last SAVE_STEPS checkpoint (lower SAVE_STEPS to lose less)"
elif [[ $TORCHRUN_FLAGS != *--shutdown-timeout* ]]; then
    echo "warning: this torchrun gives its workers 30 s after SLURM's warning, not PET_SHUTDOWN_TIMEOUT=$PET_SHUTDOWN_TIMEOUT" \
         "(--shutdown-timeout, a newer torch): a save that takes longer is cut, and the next start resumes from" \
         "the checkpoint before it"
fi

# The smallest GPU of the job against this run's memory estimate: refused in one line, with what
# would fit, where it would run out of memory at its first step (allocation.sh, minidist/memory/fit.py).
gpu_memory_check "$@"

requeue() {  # last: the real `scontrol requeue` ends this job at once and queues it again
    # Where the next start goes on from, decided as it will decide on --resume (above): `latest`, or a
    # checkpoint-<step> without it (--resume then finds the newest complete one), or nothing.
    local from="the beginning (no checkpoint yet)"
    if [[ -f $OUTPUT_DIR/latest ]]; then
        from="$OUTPUT_DIR/$(cat "$OUTPUT_DIR/latest")"
    elif [[ -n $(find "$OUTPUT_DIR" -maxdepth 1 -regex '.*/checkpoint-[0-9]+' -print -quit 2>/dev/null) ]]; then
        from="the newest complete checkpoint in $OUTPUT_DIR"
    fi
    echo "requeueing job $SLURM_JOB_ID; the next start resumes from $from"
    scontrol requeue "$SLURM_JOB_ID"
}
if (( STOP_REQUESTED )); then
    requeue
    exit 0
fi

# The rendezvous store in a process of its own, so that it outlives every node's torchrun (is_host=0:
# none hosts it), else a finished 2-node job can end in an exit-barrier traceback (allocation.sh).
rendezvous_store
node_addresses  # each node's torchrun publishes its NodeAddr, and gloo uses that interface (allocation.sh)
# In the background, so that this shell can run its trap while the training runs.
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
    bash -c "$TORCHRUN_HERE" torchrun \
    --nnodes "$NNODES" \
    --nproc_per_node "$GPUS_PER_NODE" \
    --rdzv_id "${SLURM_JOB_ID:-0}" \
    --rdzv_backend c10d \
    --rdzv_endpoint "$HEAD_NODE:$MASTER_PORT" \
    --rdzv_conf is_host=0 \
    -m minidist.finetune \
    --impl "$IMPL" \
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
    --save_steps "$SAVE_STEPS" \
    "${STRATEGY[@]}" \
    "${PACKING[@]}" \
    "${RESUME[@]}" \
    "$@" &
TRAIN_PID=$!
(( STOP_REQUESTED )) && kill -USR1 "$TRAIN_PID" || true  # the warning came while srun was being started
while :; do  # a trapped signal ends `wait` early, with the training still running: wait again
    STATUS=0
    wait "$TRAIN_PID" || STATUS=$?
    kill -0 "$TRAIN_PID" 2>/dev/null || break
done
stop_rendezvous_store  # every torchrun has left; before a requeue, which ends this script at once
if (( STOP_REQUESTED && STATUS != 0 )); then
    requeue
fi
exit "$STATUS"
