# What SLURM gave this job, read the same way by every script here. Sourced, not submitted:
# chess_finetune.sh and 01_collectives.sh call these functions before their `srun` (lesson 00
# calls model_cache before its estimate). The site's own set-up is site_setup.sh's, sourced first.
#
#   whole_number MIN NAME...  each variable must hold a whole number >= MIN, else one line and
#                             exit status 2 (`TOTAL_BATCH_SIZE=abc` is a learner's slip, not a
#                             shell error)
#   read_allocation           sets NNODES, GPUS_PER_NODE, HEAD_NODE and MASTER_PORT and exports
#                             SRUN_CPUS_PER_TASK; or one line and exit status 2
#   scratch                   exports SCRATCH, /scratch/$USER unless set (outputs and model_cache use it)
#   outputs NAME              exports OUTPUT_DIR, by default $SCRATCH/minidist/runs/NAME, off the home
#                             directory, and makes it; or one line and exit status 2
#   model_cache               exports HF_HOME, off the home directory; or one line and exit status 2
#   describe_nodes            one line per node: its GPUs and driver, torch, CUDA and NCCL, and the
#                             network variables its ranks will see; once per job start
#   rendezvous_store          starts torchrun's rendezvous store on this node (the head node) in the
#                             background, stopped when the script exits or by stop_rendezvous_store;
#                             every torchrun then joins it with --rdzv_conf is_host=0
#   node_addresses            exports NODE_ADDRS, each node's name=address (SLURM's NodeAddr), and
#                             TORCHRUN_HERE, the command an srun task runs torchrun through so
#                             that its node publishes that address (`srun ... bash -c "$TORCHRUN_HERE"
#                             torchrun ARGS...`); one line per node says what it chose
#   estimate_args ARGS        sets ESTIMATE, `python -m minidist.memory`'s flags for the run
#                             chess_finetune.sh is about to start (gpu_memory_check uses it)
#   gpu_memory_check ARGS     the smallest GPU of the job (nvidia-smi on every node) against the
#                             memory estimate of the run chess_finetune.sh is about to start: one
#                             line, or one line with what would fit and exit status 2
#   sharded_accumulation ARGS adds --accumulate_sharded to the STRATEGY array where chess_finetune.sh
#                             accumulates sharded (one node, a sharding strategy, more than one
#                             micro-batch; ACCUMULATE_SHARDED=auto|0|1), and says so in one line

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

scratch() {  # SCRATCH, the site's large file system for a job's files: /scratch/$USER unless set
export SCRATCH=${SCRATCH:-/scratch/${USER:-$(id -un)}}
}

outputs() {  # NAME: the run's output folder, off the home directory
# Checkpoints and the fine-tuned model go to OUTPUT_DIR if set (relative: to the folder the job
# was submitted from), else $SCRATCH/minidist/runs/NAME. Not under the submission folder: that is
# usually a clone in $HOME, whose quota (often 10-50 GB) a 7B run fills at its first checkpoint
# (80.9 GB; three are on the disk at once, 243 GB, before the rotation removes one). The run
# itself checks the room after its first step (minidist/checkpoint/disk_room.py).
scratch
export OUTPUT_DIR=${OUTPUT_DIR:-$SCRATCH/minidist/runs/$1}
if ! mkdir -p "$OUTPUT_DIR" 2>/dev/null; then
    echo "error: cannot create OUTPUT_DIR=$OUTPUT_DIR: set SCRATCH (then OUTPUT_DIR is \$SCRATCH/minidist/runs/$1)" \
         "or OUTPUT_DIR to a folder you can write, on a disk with room for the checkpoints" >&2
    exit 2
fi
# Once per folder: a lesson script that names the folder, then chess_finetune.sh it runs, say it once.
[[ ${MINIDIST_OUTPUTS_SAID:-} == "$OUTPUT_DIR" ]] || echo "outputs: OUTPUT_DIR=$OUTPUT_DIR"
export MINIDIST_OUTPUTS_SAID=$OUTPUT_DIR
}

model_cache() {
# The Hugging Face cache (models downloaded once on a login node, read offline by the job):
# HF_HOME if set, else $SCRATCH/hf, else /scratch/$USER/hf. Home directories have small quotas,
# and CodeLlama-7b alone is 13.5 GB. Download into the same place the job reads:
#   HF_HOME=/scratch/$USER/hf python -m minidist.hf.models download codellama/CodeLlama-7b-hf
scratch
export HF_HOME=${HF_HOME:-$SCRATCH/hf}
if ! mkdir -p "$HF_HOME" 2>/dev/null; then
    echo "error: cannot create HF_HOME=$HF_HOME: set SCRATCH (then HF_HOME is \$SCRATCH/hf) or HF_HOME" \
         "to a folder you can write, with room for the model (13.5 GB for CodeLlama-7b)" >&2
    exit 2
fi
echo "model cache: HF_HOME=$HF_HOME"
}

describe_nodes() {
# One line per node, for the log and for a question to the site's help desk: the GPUs (name,
# memory) and driver from nvidia-smi ("no nvidia-smi" where there is none), the torch, CUDA and
# NCCL versions the ranks will import, and the network variables they will see. NCCL_SOCKET_IFNAME
# and NCCL_IB_HCA (two nodes: the interface and the InfiniBand cards NCCL should use) reach the
# ranks only when set: an empty one is removed, not passed on as "". Once per job start (lesson 10
# runs chess_finetune.sh three times in one job). A failure here is reported, not fatal.
[[ ${MINIDIST_NODES_DESCRIBED:-} == "${SLURM_JOB_ID:-}:${SLURM_RESTART_COUNT:-0}" ]] && return 0
export MINIDIST_NODES_DESCRIBED=${SLURM_JOB_ID:-}:${SLURM_RESTART_COUNT:-0}
local name node_line
for name in NCCL_SOCKET_IFNAME NCCL_IB_HCA GLOO_SOCKET_IFNAME; do
    [[ -n ${!name:-} ]] || unset "$name"
done
read -r -d '' node_line <<'EOF' || true
gpus="no nvidia-smi"
if command -v nvidia-smi >/dev/null; then
    gpus=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sort | uniq -c |
           sed 's/^ *\([0-9]*\) \(.*\), \([^,]*\)$/\1 x \2, driver \3/' | paste -sd ';' -)
fi
versions=$(python -c '
import importlib.util, pathlib, runpy
# torch/version.py names the build (its version, CUDA or ROCm) without importing torch, which takes
# seconds; only a GPU build has an NCCL (RCCL on ROCm) to ask, through torch, for the library it loads.
spec = importlib.util.find_spec("torch")
if spec is None:
    raise SystemExit("no torch in this python")
built = runpy.run_path(str(pathlib.Path(spec.origin).with_name("version.py")))
nccl = "none"
if built["cuda"] or built["hip"]:
    import torch
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        pass
version, cuda = built["__version__"], built["cuda"] or "none"
print(f"torch {version}, CUDA {cuda}, NCCL {nccl}")' 2>&1 | tail -n 1)
network=$(env | grep -E '^(NCCL_|GLOO_SOCKET_IFNAME=)' | sort | paste -sd ' ' -)
echo "node ${SLURMD_NODENAME:-$(hostname)}: ${gpus:-nvidia-smi lists no GPU} | $versions${network:+ | $network}"
EOF
srun --ntasks-per-node=1 --kill-on-bad-exit=0 bash -c "$node_line" ||
    echo "warning: could not describe the nodes (srun failed); going on"
}

node_addresses() {
# torchrun's agents meet at the rendezvous (HEAD_NODE:MASTER_PORT); then the workers of every node
# connect to a store that the agent of rendezvous rank 0 opens, at the address that agent
# publishes: by default its own socket.getfqdn() (torch/distributed/elastic/rendezvous/api.py),
# a name the other nodes may not resolve, or resolve to another interface (pytorch/pytorch#150532,
# #73656). init_process_group then waits out its timeout (600 s) with nothing said. torchrun's
# --local-addr (PET_LOCAL_ADDR) publishes the address given instead: here each node's NodeAddr,
# the address slurmctld itself reaches the node at (its name where SLURM has no other).
# gloo (the CPU barrier while rank 0 loads, the stop vote) picks its interface from the
# hostname's address, which on many nodes is 127.0.1.1 (Debian's /etc/hosts): unless
# GLOO_SOCKET_IFNAME is set, each node's gloo uses the interface that holds its NodeAddr.
local node addr pairs=()
for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
    addr=$(scontrol show node "$node" 2>/dev/null | sed -n 's/.* NodeAddr=\([^ ]*\).*/\1/p' | head -n 1)
    pairs+=("$node=${addr:-$node}")
done
export NODE_ADDRS="${pairs[*]}"
# Run by srun on each node, with torchrun's arguments: the address, the interface, then torchrun.
read -r -d '' TORCHRUN_HERE <<'EOF' || true
addr=$SLURMD_NODENAME
for pair in $NODE_ADDRS; do
    [[ ${pair%%=*} == "$SLURMD_NODENAME" ]] && addr=${pair#*=}
done
export PET_LOCAL_ADDR=${PET_LOCAL_ADDR:-$addr}
if [[ -z ${GLOO_SOCKET_IFNAME:-} ]] && command -v ip >/dev/null; then
    ipv4=$(getent ahostsv4 "$PET_LOCAL_ADDR" | awk 'NR == 1 {print $1}')
    iface=$(ip -o -4 addr show | awk -v ip="$ipv4" '{split($4, a, "/")} a[1] == ip {print $2; exit}')
    [[ -n $iface ]] && export GLOO_SOCKET_IFNAME=$iface
fi
echo "node $SLURMD_NODENAME: torchrun --local-addr $PET_LOCAL_ADDR, gloo on ${GLOO_SOCKET_IFNAME:-the interface of the host name}"
exec torchrun "$@"
EOF
export TORCHRUN_HERE
}

rendezvous_store() {
# torchrun's c10d rendezvous is a key-value store. Left to itself, the agent on the head node hosts
# it and takes it along when it leaves: an agent of another node still at the exit barrier then
# logs "Error waiting on exit barrier" and a traceback at the end of a job that finished
# (pytorch/pytorch#69520; minidist/runtime/rendezvous_store.py tells the story). So the store
# runs in a process of its own, here: the batch script runs on the first node of the job (man
# sbatch), HEAD_NODE, at the port torchrun's --rdzv_endpoint names, and lives until every agent
# has left. A rendezvous, once closed, stays closed in its store: a launch with the same --rdzv_id
# needs a fresh store (lesson 10 runs chess_finetune.sh three times: three stores, one after another).
local ready deadline=$((SECONDS + 300))
ready=$(mktemp)
python -m minidist.runtime.rendezvous_store "$MASTER_PORT" --ready "$ready" &
RENDEZVOUS_STORE_PID=$!
trap stop_rendezvous_store EXIT
until [[ -s $ready ]]; do  # importing torch takes seconds: the agents start once the port is bound
    if ! kill -0 "$RENDEZVOUS_STORE_PID" 2>/dev/null || (( SECONDS > deadline )); then
        # It said why in one line (a port already taken), or it never came up.
        echo "error: the rendezvous store did not start on port $MASTER_PORT (set MASTER_PORT to a free port)" >&2
        rm -f "$ready"
        exit 2
    fi
    sleep 0.2
done
cat "$ready"
rm -f "$ready"
}

stop_rendezvous_store() {  # once every torchrun has left; again (the EXIT trap) does nothing
[[ -n ${RENDEZVOUS_STORE_PID:-} ]] || return 0
kill "$RENDEZVOUS_STORE_PID" 2>/dev/null || true
wait "$RENDEZVOUS_STORE_PID" 2>/dev/null || true
RENDEZVOUS_STORE_PID=
}

sharded_accumulation() {  # "$@": the run's arguments; adds the flag to STRATEGY, or says why not
# More than one micro-batch and a strategy that shards gradients (fsdp, the default; hsdp, zero2):
# sharded accumulation on one node, where it wins (chess_finetune.sh's header, lesson 03). Reads
# NNODES, GRADIENT_ACCUMULATION_STEPS, ACCUMULATE_SHARDED and the STRATEGY array the script has set.
    local strategy=fsdp accumulation=$GRADIENT_ACCUMULATION_STEPS previous= arg
    for arg in "${STRATEGY[@]}" "$@"; do  # the last value given wins, as in argparse
        case $previous in
            --strategy) strategy=$arg ;;
            --gradient_accumulation_steps) accumulation=$arg ;;
        esac
        case $arg in
            --strategy=*) strategy=${arg#*=} ;;
            --gradient_accumulation_steps=*) accumulation=${arg#*=} ;;
            --no_fsdp) strategy=ddp ;;
            --accumulate_sharded) return 0 ;;  # asked for on the command line already
        esac
        previous=$arg
    done
    # DDP and ZeRO-1 keep full gradients anyway (finetune refuses the flag there); one micro-batch has nothing to keep.
    [[ $accumulation != 1 && $strategy =~ ^(zero2|fsdp|hsdp)$ && $ACCUMULATE_SHARDED != 0 ]] || return 0
    if [[ $ACCUMULATE_SHARDED == auto ]] && (( NNODES > 1 )); then
        echo "$accumulation micro-batches on $NNODES nodes: no_sync (ACCUMULATE_SHARDED=1: reduce-scatter every micro-batch)"
        return 0
    fi
    STRATEGY+=(--accumulate_sharded)
    echo "$accumulation micro-batches: sharded accumulation (--accumulate_sharded; ACCUMULATE_SHARDED=0: no_sync)"
}

estimate_args() {  # "$@": the run's arguments. Sets ESTIMATE, `python -m minidist.memory`'s flags for it
# The run chess_finetune.sh is about to start (IMPL, WORLD_SIZE, BATCH_SIZE_PER_DEVICE,
# GRADIENT_ACCUMULATION_STEPS, PACK and the STRATEGY array it has set), then the arguments given to
# it that the estimator takes too (later ones win, as in argparse).
ESTIMATE=(--impl "$IMPL" --world_size "$WORLD_SIZE" --batch_size_per_device "$BATCH_SIZE_PER_DEVICE"
          --gradient_accumulation_steps "$GRADIENT_ACCUMULATION_STEPS" --max_seq_length 512 --mixed_precision bf16
          "${STRATEGY[@]}")
(( PACK )) && ESTIMATE+=(--pack)
local args=() arg i
for arg in "$@"; do  # --name=value as two words, as argparse reads it
    if [[ $arg == --*=* ]]; then args+=("${arg%%=*}" "${arg#*=}"); else args+=("$arg"); fi
done
for ((i = 0; i < ${#args[@]}; i++)); do
    case ${args[i]} in
        --strategy|--impl|--max_seq_length|--mixed_precision|--batch_size_per_device|--gradient_accumulation_steps|\
        --reduce_dtype|--bucket_cap_mb|--ddp_variant|--hsdp_shard_size|--tp_size|--pp_size|--pp_schedule|--lora_rank|\
        --lora_target_modules|--lora_dropout)
            ESTIMATE+=("${args[i]}" "${args[i + 1]:-}")
            i=$((i + 1)) ;;
        --gradient_checkpointing|--no_layer_wrap_policy|--accumulate_sharded|--cpu_offload|--sequence_parallel)
            ESTIMATE+=("${args[i]}") ;;
        --no_fsdp) ESTIMATE+=(--strategy ddp) ;;
    esac
done
}

gpu_memory_check() {  # "$@": the run's arguments
# A partition that mixes GPUs of 40 and 80 GB gives a job without a constraint either kind, and a
# run too big for its GPUs stops, out of memory, at its first step, after minutes of loading. So,
# before anything loads: every node's nvidia-smi says its GPUs' memory, and the smallest is held
# against the estimate of this very run (minidist/memory/fit.py: the estimate and a 5 GB reserve;
# the refusal names each change of flags under which the estimate fits). Where there is no
# nvidia-smi, or the estimator cannot say (a pipeline's estimate is per stage), one line says so
# and the run goes on.
local smallest out status=0
smallest=$(srun --ntasks-per-node=1 --kill-on-bad-exit=0 bash -c \
    'command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits' \
    2>/dev/null | sort -n | head -n 1) || true
if ! [[ $smallest =~ ^[0-9]+$ ]]; then
    echo "GPU memory: not checked (no nvidia-smi on the nodes)"
    return 0
fi
estimate_args "$@"
out=$(python -m minidist.memory "$MODEL" "${ESTIMATE[@]}" --gpu_memory "${smallest}MiB" --must_fit 2>&1) || status=$?
out=$(tail -n 1 <<< "$out")
out=${out#minidist.memory: error: }
if (( status == 0 )); then
    echo "GPU memory: $out (python -m minidist.memory $MODEL ${ESTIMATE[*]} --gpu_memory ${smallest}MiB --must_fit)"
elif [[ $out == "the estimated peak"* ]]; then
    echo "error: $out (flags go after the script's name; BATCH_SIZE_PER_DEVICE=N as a variable keeps the total" \
         "batch; or ask for larger GPUs: SBATCH_CONSTRAINT, the header)" >&2
    exit 2
else
    echo "GPU memory: not checked ($out)"
fi
}
