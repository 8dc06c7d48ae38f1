"""Start N CPU ranks from a notebook or a test, and get each rank's result back.

On a cluster, ``torchrun`` or ``srun`` starts the processes. On a laptop we want the same
thing from Python: ``launch(worker, 4)`` starts four processes, each one joins a gloo process
group on the CPU, even on a node with GPUs (through
``minidist.runtime.distributed.init_distributed``, exactly as under torchrun), runs ``worker()``,
and hands its return value back to us, ordered by rank.

Three details make this reliable:

- *a fork server, not a fork of the caller.* A child forked from the caller inherits a copy of
  the caller's threads' locks (torch's thread pools, a notebook's kernel threads) in whatever
  state they were, and can deadlock. So on Linux the ranks come from multiprocessing's
  ``forkserver``: a clean, single-threaded process, started once (per notebook kernel, per test
  session), that has imported torch and the libraries a run needs (``_PRELOAD``, not minidist)
  and run nothing else, and forks a child per rank. (macOS and
  Windows keep ``spawn``, a fresh interpreter per rank: see ``_START_METHOD``.) Either way the
  child *imports* the worker function by name, which is why the function must live in an
  importable ``.py`` module, not a notebook cell. Why not a fresh interpreter per rank on Linux
  too? Each would import torch again: 3 to 3.5 s of CPU per rank; on a shared 2-core
  machine a 2-rank launch of a worker that does nothing took 21 to 24 s that way, 0.9 s from the
  server. The child takes the caller's environment as it is at ``launch`` (the server's is from
  when it started), so a variable set in a notebook cell reaches the ranks as it would reach a fresh
  interpreter; a variable a preloaded library reads when imported (``HF_HOME``) restarts the server.
- *one pipe per rank, watched together with the processes.* The parent waits on all pipes at
  once (``multiprocessing.connection.wait``), reading each message as soon as it arrives, so a
  child sending a large result never blocks on a full pipe; a child that dies without a word
  shows up as end-of-file on its pipe, with its exit code.
- *fail fast, leave nothing behind.* When one rank raises, the others are usually stuck in a
  collective waiting for it. We do not wait for the collective timeout: we terminate them,
  kill what survives, join everything, and raise ``RankFailed`` with the failing rank's
  traceback.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import signal
import sys
import time
import traceback
from multiprocessing import forkserver
from multiprocessing.connection import wait

from minidist.runtime.allocator import tunables_for_new_processes
from minidist.runtime.distributed import cleanup, find_free_port, init_distributed

# What the fork server imports once for every rank: the libraries a training run needs, never
# minidist itself (a learner who edits minidist/ between two launches must see the edit, so each rank
# imports minidist afresh). On 2 cores, a 2-rank launch of one short fine-tune took 6.0 s with torch
# alone preloaded (one measurement) and 1.5 to 2.1 s with these (three), transformers' Llama and
# PyTorch's sharding and checkpoint modules no longer imported by every rank. Importing them starts no thread, so forking after is safe.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.tensor",
            "torch.distributed.fsdp", "transformers", "transformers.models.llama.modeling_llama"]
# Hugging Face's libraries read these when imported (huggingface_hub: HF_HOME, HF_HUB_OFFLINE, ...),
# so the server must be started again when the caller has changed one since it started (a notebook
# cell that sets HF_HUB_OFFLINE): else every later rank would see the old values.
_READ_AT_IMPORT = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "XDG_CACHE_HOME")
# Linux only: Windows has no fork, and on macOS forking a process that loaded Apple's frameworks
# (torch does) is unsafe, which is why Python spawns there by default. Those keep spawn.
_START_METHOD = "forkserver" if sys.platform == "linux" else "spawn"
_GRACE_S = 5.0  # how long a terminated (or finished) rank gets before we kill it
_server_started_with: tuple | None = None  # (GLIBC_TUNABLES, _READ_AT_IMPORT's variables) of the fork server; None: not yet


class RankFailed(RuntimeError):
    """One rank raised or died; ``.rank`` says which, ``.traceback`` holds its report."""

    def __init__(self, rank: int, traceback: str, exitcode: int | None = None):
        self.rank, self.traceback, self.exitcode = rank, traceback, exitcode
        super().__init__(f"rank {rank} failed:\n{traceback}")


def _worker(rank, world_size, port, environ, conn, fn, args, kwargs, nodes=1):
    """Body of each child: become rank `rank` the way torchrun would, run fn, report."""
    # The caller's environment at launch(), not the fork server's (from when the server started).
    os.environ.clear()
    os.environ.update(environ)
    # Everything the server preloaded lives as long as the rank does: set it aside from the cycle
    # collector, whose full passes (the loop's memory trace and `cleanup` run one) would otherwise
    # walk all of transformers' and torch's objects each time, 0.15 s a pass on 2 cores.
    gc.freeze()
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        # OpenMP read the variable when the server loaded torch; a value set since must be applied.
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # Override rather than inherit: a notebook inside a SLURM allocation may carry
    # MASTER_ADDR etc. pointing at another node.
    per_node = world_size // nodes  # simulated nodes: consecutive ranks, as torchrun numbers them
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % per_node),
        LOCAL_WORLD_SIZE=str(per_node),
        GROUP_RANK=str(rank // per_node),  # torchrun's name for the node's index
        NNODES=str(nodes),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        init_distributed(device_type="cpu")  # CPU ranks on gloo, even on a node with GPUs
        # Pickle here, not in the pipe: an unpicklable result becomes a readable error.
        message = pickle.dumps(("ok", fn(*args, **kwargs), time.time()))
    except BaseException:  # SystemExit and KeyboardInterrupt are failures of the rank too
        message = pickle.dumps(("error", traceback.format_exc(), time.time()))
    # send_bytes writes in this thread (multiprocessing.Queue would use a background one), so
    # the report is in the pipe before we tear down the group, which is what wakes the
    # other ranks with errors of their own.
    conn.send_bytes(message)
    conn.close()
    try:
        cleanup()
    except Exception:
        pass  # the result is delivered; a peer that already left is not our failure


def _exit_report(rank: int, exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        how = f"was killed by signal {signal.Signals(-exitcode).name}"
    else:
        how = f"exited with code {exitcode}"
    return f"rank {rank} {how} without reporting a result (os._exit, a signal or a crash)"


def _stop(procs: list, grace_s: float = _GRACE_S) -> None:
    """Terminate (SIGTERM) every live process, kill (SIGKILL) what survives, join all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def launch(fn, world_size: int, *args, timeout_s: float | None = None, nodes: int = 1, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` CPU ranks; return the results by rank.

    ``nodes`` > 1 pretends the ranks run on that many machines, ``world_size / nodes`` each: every
    rank gets the LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK torchrun would set on node
    ``rank // (world_size / nodes)``, so hybrid sharding (`--strategy hsdp`) finds its shard
    groups within a "node" and the byte counter (`parallel/comm.py`) tells what crosses nodes.
    They still all run on this machine and talk over its loopback.

    Each rank is a fresh process (forked from the fork server, with the caller's environment)
    in a gloo process group (``init_distributed`` is called for you, ``cleanup`` after). If a
    rank raises or dies, ``RankFailed`` is raised with its traceback and every other rank is
    stopped. ``timeout_s`` bounds the whole launch (``TimeoutError``). No child outlives this
    call, whatever happens.
    """
    _check_launchable(fn, world_size, nodes)
    ctx = multiprocessing.get_context(_START_METHOD)
    if _START_METHOD == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts, at the first launch
        _fork_server_with(tunables_for_new_processes(os.environ), _read_at_import(os.environ))
    port = find_free_port()
    procs, readers = [], {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker,
                args=(rank, world_size, port, dict(os.environ), writer, fn, args, kwargs, nodes),
                name=f"minidist-rank{rank}",
            )
            p.start()
            # Drop our copy of the write end: then the child's death reads as EOF.
            writer.close()
            procs.append(p)
            readers[reader] = rank
        results = _collect(procs, readers, deadline, timeout_s)

        # Everyone reported; give them a moment to leave the group and exit on their own.
        deadline = time.monotonic() + _GRACE_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        return [results[rank] for rank in range(world_size)]
    finally:
        _stop(procs)  # a no-op when all exited; otherwise terminate, kill, join
        for reader in readers:
            reader.close()


def _read_at_import(environ) -> tuple:
    """The variables of `environ` that the preloaded libraries read when imported, sorted."""
    return tuple(sorted((k, v) for k, v in environ.items() if k.startswith(_READ_AT_IMPORT)))


def _fork_server_with(tunables: str | None, read_at_import: tuple) -> None:
    """Start the fork server with `tunables` as its GLIBC_TUNABLES (the tcache off: `allocator.py`), or
    restart it if it runs with others (MINIDIST_GLIBC_DEFAULTS changed since it started) or imported
    its libraries under other `read_at_import` variables (`_READ_AT_IMPORT`). glibc reads the variable
    when a program starts, and the ranks are forked from the server: so it is the server's. The
    caller's own environment is left as it was."""
    global _server_started_with
    if _server_started_with == (tunables, read_at_import):
        return
    forkserver._forkserver._stop()  # a private method (CPython's own tests use it); no-op if none runs
    before = os.environ.pop("GLIBC_TUNABLES", None)
    if tunables is not None:
        os.environ["GLIBC_TUNABLES"] = tunables
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop("GLIBC_TUNABLES", None)
        if before is not None:
            os.environ["GLIBC_TUNABLES"] = before
    _server_started_with = (tunables, read_at_import)


def _check_launchable(fn, world_size: int, nodes: int) -> None:
    """Raise ValueError, before any process starts, for a launch that cannot work."""
    if world_size < 1:
        raise ValueError(f"launch() needs world_size >= 1 ranks, got {world_size}.")
    if nodes < 1 or world_size % nodes:
        raise ValueError(f"launch() needs nodes that divide the {world_size} ranks equally, got nodes={nodes}.")
    if getattr(fn, "__module__", None) == "__main__":
        raise ValueError(
            f"launch() starts fresh processes that import {fn.__name__!r} by name, which is "
            "impossible for a function defined in a notebook or __main__: move it into a .py "
            "module and import it from there."
        )
    try:
        pickle.dumps(fn)
    except Exception as e:
        raise ValueError(
            f"launch() cannot send {fn!r} to other processes ({e}): use a module-level "
            "function (not a lambda or a nested function) defined in an importable .py file."
        ) from e


def _collect(procs: list, readers: dict, deadline: float | None, timeout_s: float | None) -> dict:
    """Read every rank's report as it arrives: {rank: result}. Each pipe read is taken out of
    `readers` (and closed); a rank that raised or died raises ``RankFailed``, a launch past its
    `deadline` ``TimeoutError``."""
    results = {}
    while readers:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            running = sorted(readers.values())
            raise TimeoutError(
                f"launch() timed out after {timeout_s} s with ranks {running} still "
                "running: raise timeout_s, or look for a rank stuck in a collective."
            )
        failures = []
        for reader in wait(list(readers), timeout=left):
            rank = readers.pop(reader)
            try:
                status, payload, sent_at = pickle.loads(reader.recv_bytes())
            except EOFError:  # the child is gone and said nothing
                procs[rank].join(_GRACE_S)
                code = procs[rank].exitcode
                raise RankFailed(rank, _exit_report(rank, code), code) from None
            finally:
                reader.close()
            if status == "ok":
                results[rank] = payload
            else:
                failures.append((sent_at, rank, payload))
        if failures:
            # When one rank fails, its peers soon fail too ("connection closed"); the
            # root cause is the report sent first.
            _, rank, report = min(failures)
            raise RankFailed(rank, report)
    return results
