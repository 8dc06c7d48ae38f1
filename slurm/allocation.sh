# What SLURM gave this job, read the same way by every script here. Sourced, not submitted:
# chess_finetune.sh and 01_collectives.sh call its two functions before their `srun`.
#
#   whole_number MIN NAME...  each variable must hold a whole number >= MIN, else one line and
#                             exit status 2 (`TOTAL_BATCH_SIZE=abc` is a learner's slip, not a
#                             shell error)
#   read_allocation           sets NNODES, GPUS_PER_NODE, HEAD_NODE and MASTER_PORT and exports
#                             SRUN_CPUS_PER_TASK; or one line and exit status 2

whole_number() {  # MIN NAME...: each variable must hold a whole number >= MIN
    local min=$1 name
    shift
    for name; do
        if ! [[ ${!name} =~ ^[0-9]+$ ]] || (( 10#${!name} < min )); then
            echo "error: $name=${!name} must be a whole number of at least $min" >&2
            exit 2
        fi
        printf -v "$name" %d "$((10#${!name}))"  # "08" is 8 to what follows, not a bad octal
    done
}

read_allocation() {
# Outside a job none of SLURM's variables exist: say so once, instead of an unbound variable.
if [[ -z ${SLURM_JOB_ID:-} ]]; then
    echo "error: this is a SLURM batch script and SLURM_JOB_ID is not set: submit it with sbatch" \
         "(on one machine, run torchrun -m minidist.finetune directly: see README.md)" >&2
    exit 2
fi
NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}

# GPUs per node: SLURM_GPUS_ON_NODE (set from SLURM 19.05 on, for --gpus-per-node, --gpus and
# --gres alike), else the GPU indices it handed this node (SLURM_JOB_GPUS, or the
# CUDA_VISIBLE_DEVICES it set), else the request itself (SLURM_GPUS_PER_NODE, maybe "a100:4").
# A job without GPUs (--gpus-per-node=0, or none asked for) would start ranks for GPUs it does
# not have: stop instead. GPUS_PER_NODE set by hand wins (CPU ranks, for a test).
if [[ -z ${GPUS_PER_NODE:-} ]]; then
    if [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then
        GPUS_PER_NODE=$SLURM_GPUS_ON_NODE
    elif [[ -n ${SLURM_JOB_GPUS:-${CUDA_VISIBLE_DEVICES:-}} ]]; then
        gpu_ids=${SLURM_JOB_GPUS:-$CUDA_VISIBLE_DEVICES}
        gpu_ids=(${gpu_ids//,/ })
        GPUS_PER_NODE=${#gpu_ids[@]}
    else
        GPUS_PER_NODE=${SLURM_GPUS_PER_NODE:-}
        GPUS_PER_NODE=${GPUS_PER_NODE##*:}
    fi
    if ! [[ $GPUS_PER_NODE =~ ^[1-9][0-9]*$ ]]; then
        echo "error: job $SLURM_JOB_ID has no GPUs (SLURM set neither SLURM_GPUS_ON_NODE nor SLURM_JOB_GPUS):" \
             "submit it with --gpus-per-node=N, or set GPUS_PER_NODE=N to start N ranks per node" >&2
        exit 2
    fi
fi
whole_number 1 GPUS_PER_NODE

# Every node runs one torchrun; they meet at a c10d rendezvous on the first node of the job.
# `scontrol show hostnames` expands SLURM's compressed node lists ("gpu[01-04,07]").
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)

# The rendezvous port, from the job id: two jobs sharing a head node then differ (a fixed 29500
# made the second one fail or, worse, join the first one's store). 20000-29999 lies below
# Linux's ephemeral ports (32768-60999), which outgoing connections take; two jobs collide only
# if their ids differ by a multiple of 10,000 and they share the first node.
MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 10000))}
whole_number 1 MASTER_PORT

# From SLURM 22.05 on, srun no longer inherits --cpus-per-task from sbatch: its one task per node
# would get one CPU, and on a site that binds tasks to cores every rank would share it.
# SRUN_CPUS_PER_TASK is the variable srun reads for its own --cpus-per-task.
if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
    export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
fi
}
