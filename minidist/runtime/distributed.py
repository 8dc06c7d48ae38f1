"""Process groups: how N copies of one script find each other.

Distributed training runs the *same* script in N processes, one per GPU (or, on a laptop,
one per few CPU cores). Each process needs to know four numbers:

- ``rank``: who am I among all processes, ``0 .. world_size - 1``. Rank 0 is the "main"
  rank by convention: it logs, saves checkpoints and hosts the rendezvous.
- ``world_size``: how many processes take part in total (4 GPUs on 1 node: 4; 2 nodes of
  4 GPUs: 8).
- ``local_rank``: who am I *on this machine*, ``0 .. local_world_size - 1``. It picks the
  GPU: local rank 2 drives ``cuda:2``. On node 1 of the example above, ranks 4..7 have local
  ranks 0..3.
- ``local_world_size``: how many processes share this machine (its GPUs, or its CPU cores).

Nobody computes these by hand. A launcher starts the processes and writes the numbers into
each one's environment:

- ``torchrun --nproc_per_node=4 train.py`` sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
  MASTER_ADDR and MASTER_PORT.
- ``srun`` (SLURM, one task per GPU) sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and
  SLURM_NTASKS_PER_NODE; the rendezvous address is the first host of the job's node list.
- ``minidist.runtime.launch`` (notebooks, tests) sets the torchrun variables itself.
- Nothing at all: a plain ``python train.py`` is a world of one process.

``MASTER_ADDR:MASTER_PORT`` is where rank 0 runs a small key-value store (a ``TCPStore``);
every rank connects to it once to exchange addresses, then the backend talks peer to peer:
NCCL between GPUs (NVLink, InfiniBand), gloo between CPU processes over TCP.

Why a timeout: a collective such as ``all_reduce`` returns only when *every* rank has joined
it. If one rank crashes or takes another branch, the others wait. Without a timeout they wait
forever and burn a GPU allocation; with one they fail with an error that names the
collective. (For NCCL the timeout is enforced by PyTorch's watchdog thread, on by default.)
A rank that waits for a peer that is slow but well (rank 0 reading a 7B model alone) waits
elsewhere, on a barrier with a long timeout: `wait_for_rank0`.

**Leaving cleanly.** A gloo process group runs its collectives on worker threads of its own.
A worker that finishes a collective lets go of the work's tensors a moment later, and if it
drops the last reference to a tensor Python still knew, it must take the GIL to free it. If the
interpreter is already shutting down by then, Python ends that thread from inside a C++
destructor and the process dies of SIGABRT ("terminate called without an active exception"),
after the run has finished and logged. `cleanup` therefore destroys the group *for real* while
the interpreter is alive: destroying it joins the worker threads, which first finish letting go.
Two things in PyTorch kept the group alive past `destroy_process_group`, so that its threads ran
on into shutdown (found with a core dump of an abort; `python tests/checkpoint/exit_loop.py`
counts aborts over many short runs):

- `torch.distributed.nn` captures the world group in default arguments (`group=group.WORLD`)
  when it is first imported. transformers imports it (through `torch.distributed._shard`) when
  it first loads a tokenizer or a model, after our group exists. Imported at the top of this
  module, before any group exists, it captures `None`.
- FSDP2's and DCP's `DeviceMesh` keeps its groups in a registry, and DTensor's sharding caches
  keep the meshes. So every mesh here comes from `device_mesh()`, and `cleanup` empties the
  registry of each before it destroys the group.

And a wrapped model left in a reference cycle holds the group until the cycle collector runs, so
`cleanup` runs it first. A cycle through a tensor hook the collector cannot break at all (PyTorch
keeps the hook in C++), so the hand-written wrappers hook their parameters only weakly
(`parallel/wrapper.py`, `weak_hook`). `tests/loop/test_finetune.py` checks that no gloo thread is
left after every strategy has trained.

(The same abort is analysed in PyTorch pull request 179291, "Register atexit handler to destroy
process groups before interpreter finalization", 2026, abandoned upstream as more complicated than
it looked.)
"""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping

import torch
import torch.distributed as dist
# Imported before any process group exists, on purpose: see "Leaving cleanly" above.
import torch.distributed.nn  # noqa: F401

from minidist.runtime.allocator import keep_freed_blocks
from minidist.runtime.errors import UsageError
from minidist.runtime.roll_call import EVERY_S, RollCall, ranks_named
from minidist.parallel import mesh

DEFAULT_TIMEOUT_S = 600.0
STOP_WAIT_S = 5.0  # how long a failed rendezvous waits for the roll call's thread (RollCall.stop)
# How long the other ranks wait while rank 0 alone reads the weights (`wait_for_rank0`). The
# process group's 600 s are meant to catch a hung collective, not a slow disk: CodeLlama-7b is
# 13.5 GB of files, read and cast to fp32 on one rank, which from a network filesystem or a cold
# cache can take many minutes. An hour covers that, and still ends a job whose rank 0 died.
LOAD_TIMEOUT_S = 3600.0
DEFAULT_MASTER_PORT = 29500  # torchrun's default, so both launchers behave alike


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands in the job; see the module docstring for the terms."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_env: DistEnv | None = None  # set by init_distributed, read by get_env


def find_free_port() -> int:
    """Ask the OS for a TCP port nobody listens on (bind to port 0, read it back, let go).

    Another program could grab it between now and the rendezvous; on one machine that
    window is short enough in practice.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_slurm_host(nodelist: str) -> str:
    """``node[03-05]`` -> ``node03``: SLURM's compressed node list, expanded by scontrol."""
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True, text=True
    ).stdout
    return out.split()[0]


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """SLURM writes tasks per node compressed: ``"4"``, ``"4(x2)"`` or ``"2(x3),1"``."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        n, _, rep = part.partition("(x")
        counts += [int(n)] * (int(rep.rstrip(")")) if rep else 1)
    return counts[min(node_id, len(counts) - 1)]


def _whole(environ: Mapping[str, str], name: str, default=None) -> int:
    """The launch variable `name` as a whole number 0 or more (`default` when unset), or one line."""
    text = environ.get(name)
    if text is None and default is not None:
        return default
    if text is None or not text.strip().isdigit():
        raise UsageError(f"{name}={text!r} in the environment is not a whole number 0 or more: "
                         f"a launcher (torchrun, srun) sets it, or leave it unset for one process")
    return int(text)


def _check_launch(where: dict, pairs=(("rank", "world_size"), ("local_rank", "local_world_size"))) -> dict:
    """Numbers no launcher writes: refused in one line before any rendezvous, which would wait for
    a rank that cannot exist (RANK=2 of WORLD_SIZE=2) until the timeout. (Under SLURM the local
    figures are read from a compressed per-node list, and only the global pair is checked.)"""
    for rank, size in pairs:
        if where[size] < 1:
            raise UsageError(f"{size.upper()}={where[size]} in the environment: a world has at least 1 process")
        if where[rank] >= where[size]:
            raise UsageError(f"{rank.upper()}={where[rank]} in the environment must be less than "
                             f"{size.upper()}={where[size]} (ranks count from 0): start the ranks with torchrun")
    return where


def read_launch_env(
    environ: Mapping[str, str], resolve_host: Callable[[str], str] = _first_slurm_host
) -> dict:
    """Who launched us, and with which numbers? A pure function of the environment.

    Returns a dict with ``source`` ("torchrun", "slurm" or "single"), ``rank``,
    ``world_size``, ``local_rank``, ``local_world_size``, ``master_addr`` and ``master_port``
    (``None`` for "single": the caller picks a free port).
    ``resolve_host`` turns SLURM's node list into the rendezvous host; tests pass a stub.
    Numbers that no launcher writes (not a number, a rank past the world, a WORLD_SIZE above 1
    without a RANK) are a UsageError: one line, before anyone waits for a peer.
    """
    if "RANK" in environ and "WORLD_SIZE" in environ:
        # torchrun (or minidist.runtime.launch). Defaults cover a hand-made single-node launch.
        rank, world_size = _whole(environ, "RANK"), _whole(environ, "WORLD_SIZE")
        return _check_launch(dict(
            source="torchrun",
            rank=rank,
            world_size=world_size,
            local_rank=_whole(environ, "LOCAL_RANK", rank),
            local_world_size=_whole(environ, "LOCAL_WORLD_SIZE", world_size),
            master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_whole(environ, "MASTER_PORT", DEFAULT_MASTER_PORT),
        ))
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        # srun with one task per GPU: SLURM plays torchrun's role.
        per_node = environ.get("SLURM_NTASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
        node_id = _whole(environ, "SLURM_NODEID", 0)
        addr = environ.get("MASTER_ADDR") or resolve_host(environ["SLURM_JOB_NODELIST"])
        # Every task must agree on the port without talking to each other: derive it from
        # the job id they share, so two jobs on one node do not collide.
        port = _whole(environ, "MASTER_PORT", DEFAULT_MASTER_PORT + _whole(environ, "SLURM_JOB_ID", 0) % 1000)
        return _check_launch(dict(
            source="slurm",
            rank=_whole(environ, "SLURM_PROCID"),
            world_size=_whole(environ, "SLURM_NTASKS"),
            local_rank=_whole(environ, "SLURM_LOCALID", 0),
            local_world_size=_tasks_on_node(per_node, node_id) if per_node else 1,
            master_addr=addr,
            master_port=port,
        ), pairs=(("rank", "world_size"),))
    if environ.get("WORLD_SIZE", "1").strip() != "1" or environ.get("RANK", "0").strip() != "0":
        # Half a launch: a world of one would train alone what the user meant for several.
        given = " ".join(f"{k}={environ[k]}" for k in ("RANK", "WORLD_SIZE") if k in environ)
        raise UsageError(f"{given} in the environment without {'WORLD_SIZE' if 'RANK' in environ else 'RANK'}: "
                         f"start the ranks with torchrun (which sets both), or unset it for one process")
    # A world of one talks only to itself: this machine, any free port (a MASTER_ADDR left
    # over from a batch script could name another node).
    return dict(source="single", rank=0, world_size=1, local_rank=0, local_world_size=1,
                master_addr="127.0.0.1", master_port=None)


def usable_cores() -> int:
    """The cores this process may run on: under SLURM or taskset, fewer than the machine has."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def offload_threads(environ: Mapping[str, str], cores_here: int) -> tuple[int, str]:
    """The CPU threads for a GPU rank's `--cpu_offload` step, and where the figure comes from: a
    pure function of the environment and of the cores this process may run on (`cores_here`, what
    `usable_cores()` says).

    torchrun sets OMP_NUM_THREADS=1 in its workers when the variable is unset, so that N ranks of
    CPU work do not crowd one node. Left so, ZeRO-Offload's AdamW runs on one thread (about 1.5 s
    per 200M parameters: some 13 s per step and rank for CodeLlama-7b on 4 GPUs) while the cores
    the job asked SLURM for idle. So an OMP_NUM_THREADS above 1 is someone's choice, kept; else
    the task's cores (SLURM_CPUS_PER_TASK, no more than this process may use; without SLURM, the
    cores it may use) are shared among the ranks torchrun started from that task on this node
    (LOCAL_WORLD_SIZE). srun with one task per rank sets no LOCAL_WORLD_SIZE: each task's cores
    are its own."""
    chosen = environ.get("OMP_NUM_THREADS", "")
    if chosen.isdigit() and int(chosen) > 1:
        return int(chosen), f"OMP_NUM_THREADS={chosen}"
    cores, source = cores_here, f"{cores_here} usable cores"
    if environ.get("SLURM_CPUS_PER_TASK", "").isdigit() and int(environ["SLURM_CPUS_PER_TASK"]) <= cores_here:
        cores, source = int(environ["SLURM_CPUS_PER_TASK"]), f"SLURM_CPUS_PER_TASK={environ['SLURM_CPUS_PER_TASK']}"
    ranks = int(environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, cores // ranks), f"{source} shared by {ranks} rank{'s' * (ranks > 1)} on this node"


def use_cores_for_offload(env: DistEnv, environ: Mapping[str, str] = os.environ) -> str:
    """`--cpu_offload`: run the optimizer step on this rank's share of the CPU cores
    (`offload_threads`), and say so in one line for the start of the log. On a GPU rank only: a
    CPU rank computes everything on the CPU, and `init_distributed` has shared the cores already."""
    if env.device.type == "cpu":
        return f"--cpu_offload: the optimizer step on {torch.get_num_threads()} CPU threads per rank (CPU ranks)"
    threads, source = offload_threads(environ, usable_cores())
    torch.set_num_threads(threads)
    return f"--cpu_offload: the optimizer step on {threads} CPU threads per rank ({source})"


def device_and_backend(local_rank: int, device_type: str | None = None) -> tuple[torch.device, str]:
    """Where this rank computes and how it talks: a GPU and NCCL wherever CUDA is visible, else
    the CPU and gloo; `device_type="cpu"` keeps a rank on the CPU even on a GPU node (what
    `launch.py`'s CPU ranks ask for).

    The GPU is `local_rank % device_count()`: torchrun shows each process every GPU of the node
    (rank 3 takes cuda:3), but SLURM with `--gpus-per-task=1` shows each task only its own,
    which is then cuda:0 for every task."""
    if device_type not in (None, "cpu", "cuda"):
        raise ValueError(f"device_type must be None, 'cpu' or 'cuda', got {device_type!r}")
    if device_type != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count()), "nccl"
    if device_type == "cuda":
        raise RuntimeError("device_type='cuda' asked for, but this process sees no GPU")
    return torch.device("cpu"), "gloo"


def init_distributed(timeout_s: float | None = None, device_type: str | None = None,
                     wait_line_every_s: float = EVERY_S) -> DistEnv:
    """Join the process group described by the environment, once; return our DistEnv.

    Calling it again returns the existing group's DistEnv, so library code may call it
    without asking whether the script already did. ``timeout_s`` (else the environment
    variable MINIDIST_TIMEOUT_S, else 600 s) bounds how long a collective may wait, and how long
    the ranks wait for each other here, saying every ``wait_line_every_s`` who is missing
    (`roll_call.py`). ``device_type`` is ``device_and_backend``'s: None picks the GPU where there is one.
    """
    global _env
    if dist.is_initialized():
        return get_env()
    where = read_launch_env(os.environ)
    port = where["master_port"] or find_free_port()
    if timeout_s is None:
        timeout_s = _timeout_from_env(os.environ.get("MINIDIST_TIMEOUT_S"))

    device, backend = device_and_backend(where["local_rank"], device_type)
    if device.type == "cuda":
        # One process per GPU: bind before any CUDA work, or every rank piles onto cuda:0.
        torch.cuda.set_device(device)
    else:
        if "OMP_NUM_THREADS" not in os.environ:
            # N ranks on one laptop each default to all cores: share them out instead.
            torch.set_num_threads(max(1, usable_cores() // where["local_world_size"]))
        # Before the group starts gloo's threads and the model its large buffers (allocator.py).
        line = keep_freed_blocks(device)
        if line and where["rank"] == 0:
            print(line, flush=True)

    if where["source"] == "torchrun":
        # torchrun's agent already runs the store the ranks should meet at; env:// uses it.
        init_method = "env://"
    else:
        addr = where["master_addr"]
        host = f"[{addr}]" if ":" in addr else addr  # IPv6 literals need brackets in a URL
        init_method = f"tcp://{host}:{port}"
    _rendezvous(backend, init_method, where, port, timeout_s, wait_line_every_s, device)
    ranks = {k: where[k] for k in ("rank", "world_size", "local_rank", "local_world_size")}
    _env = DistEnv(**ranks, device=device, backend=backend)
    return _env


def _timeout_from_env(text: str | None) -> float:
    """MINIDIST_TIMEOUT_S as seconds (DEFAULT_TIMEOUT_S when unset): a number above 0, or one line."""
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise UsageError(f"MINIDIST_TIMEOUT_S={text!r} in the environment is not a number of seconds above 0; "
                         f"unset it (600 s) or give one, as MINIDIST_TIMEOUT_S=1800")
    return seconds


def group_device(device: torch.device) -> dict:
    """`init_process_group`'s `device_id` on a GPU: the group is bound to this rank's GPU, and NCCL's
    communicator is made at once, inside `init_process_group`, where a peer that never comes is
    caught by the rendezvous and its timeout. Without it the communicator is made lazily, by the
    first collective: that first step is slow, and a missing peer hangs there instead. Nothing on
    the CPU (gloo has no communicator to bind)."""
    return {"device_id": device} if device.type == "cuda" else {}


def _rendezvous(backend: str, init_method: str, where: dict, port: int, timeout_s: float, every_s: float,
                device: torch.device) -> None:
    """`init_process_group`, with the roll taken while the ranks wait for each other (`roll_call.py`),
    and a rendezvous that times out told in one line naming the ranks that never came."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent gathered the ranks
    roll = None if agent or where["world_size"] == 1 else RollCall(where["master_addr"], port, where["rank"],
                                                                    where["world_size"], every_s)
    if roll:
        roll.start()
    start, failed = time.monotonic(), True
    try:
        dist.init_process_group(backend=backend, init_method=init_method, rank=where["rank"],
                                world_size=where["world_size"], timeout=timedelta(seconds=timeout_s),
                                **group_device(device))
        failed = False
    except RuntimeError as err:  # torch's DistStoreError is one; a timeout is told as such, anything else raised
        if "EADDRINUSE" in str(err):  # rank 0 could not host the store: another program listens there
            raise UsageError(f"MASTER_PORT {port} at {where['master_addr']} is taken by another program (EADDRINUSE: "
                             f"address already in use), so rank 0 cannot host the rendezvous there; start every "
                             f"rank with another MASTER_PORT, the same on each") from None
        if roll is None or time.monotonic() - start < 0.9 * timeout_s:
            raise
        missing = f"{ranks_named(roll.missing)} never joined" if roll.missing else "the other ranks never joined"
        raise UsageError(f"{missing} in {timeout_s:.0f} s (rank {where['rank']} of WORLD_SIZE={where['world_size']} "
                         f"at {where['master_addr']}:{port}): start every rank, with the same MASTER_ADDR, "
                         f"MASTER_PORT and WORLD_SIZE (torchrun does)") from err
    finally:
        if roll:  # after a failure, not forever: its store client may be stuck on whatever holds the port
            roll.stop(wait_s=None if not failed else STOP_WAIT_S)


def get_env() -> DistEnv:
    """The DistEnv of the current process group (init_distributed must have run)."""
    if not dist.is_initialized():
        raise RuntimeError("No process group yet: call minidist.runtime.distributed.init_distributed() first.")
    if _env is not None:
        return _env
    # The group was built by someone else (dist.init_process_group by hand): describe it.
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device, _ = device_and_backend(local_rank, None if dist.get_backend() == "nccl" else "cpu")
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank,
                   int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())), device, dist.get_backend())


def wait_for_rank0(timeout_s: float = LOAD_TIMEOUT_S) -> None:
    """Wait on every rank until rank 0 gets here too: a barrier on the CPU, with its own timeout.

    FSDP reads the weights on rank 0 alone (`strategy/data.py`, `load_on_rank0`), and the other
    ranks, which only built shapes, would wait for them inside the first collective that sends
    them, under the process group's timeout. So every rank calls this first. The barrier runs on a
    gloo group made for it with a timeout of `timeout_s` (an hour) and destroyed after: gloo,
    whatever the training backend, because waiting needs no GPU (a NCCL group would set up a
    communicator on every GPU for one call). Making the group is itself a rendezvous, and it too
    waits under the new group's timeout. A world of one has nobody to wait for."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    dist.barrier(group=group)
    dist.destroy_process_group(group)


def device_mesh(shape: tuple[int, ...] | None = None, names: tuple[str, ...] | None = None):
    """`parallel/mesh.device_mesh` on this rank's device type: a ``DeviceMesh`` of all ranks for
    FSDP2 and DCP, 1-D by default, made once per shape and released by ``cleanup``."""
    return mesh.device_mesh(get_env().device.type, shape, names)


def cleanup() -> None:
    """Leave the process group, if any, and destroy it for real (see "Leaving cleanly").

    No barrier: a rank that fails must not wait here. After a run that finished, no collective is
    outstanding: the strategies wait for every handle before a step ends."""
    global _env
    mesh.release_device_meshes()  # and the groups each DeviceMesh holds
    # A wrapped model that is garbage but sits in a reference cycle (hooks refer back to their
    # module) still holds the group until the cycle collector runs: run it now, not at shutdown.
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    _env = None
