"""A harness that makes gloo behave like NCCL, so that the CPU parity tests see what GPUs punish.

On a GPU an asynchronous collective is queued on NCCL's own stream and runs later: until its
handle's `wait()`, its output holds whatever was there, a write into its input changes what is
sent, and a buffer freed early is handed to someone else while NCCL still reads or writes it. None
of it raises; the numbers are silently wrong. On CPU, gloo runs the collective on its worker thread
at once and keeps its own references to the tensors, so the same mistakes mostly go unnoticed.

Inside `NcclLike()` (or between `install()` and `uninstall()`), in one rank:

- **Every asynchronous collective is deferred to `wait()`.** At the call the harness keeps a copy
  of each input (the snapshot) and fills each output with NaN (the poison); it returns a handle
  that does the real gloo collective, on the snapshot, only at `wait()`. So whatever reads an
  output before `wait()` reads NaN, and the parity test fails on it.
- **At `wait()`, before the real work, it checks** that no input or output was freed (its storage
  resized to 0: "freed before the collective completed"), that every input still equals its
  snapshot and every output still holds the poison ("written before the collective completed").
- **A handle never waited for is reported** when the harness is uninstalled: on NCCL its result
  would never be known to be there.
- **Synchronous collectives run at once**, as NCCL's do on the current stream.
- **minidist is told the backend is "nccl"** (`dist.get_backend`, asked from minidist's own
  modules only: PyTorch's code keeps seeing gloo), so it takes its NCCL branches:
  `comm.reduce_scatter` calls `reduce_scatter_tensor`, which the harness does over gloo as NCCL's
  arithmetic would be (an all-reduce of a copy, shard r kept), not `comm._ShardAfter`; and
  `flat.collective_device` sends host tensors through "the GPU". No GPU here, so the harness runs
  the real `collective_device` with CUDA's current device answered as 0, keeps its answer and
  gives the rank's CPU instead. What it checks: NCCL moves only GPU memory, so every tensor a
  collective is given must be device memory, or a host tensor (placed by `offload.py`, known
  through `memory/sides.py`) that went through `collective_device` first.

`NcclLike(backend="gloo")` keeps the deferral and the checks but answers "gloo", so that gloo's own
branch (`comm._ShardAfter`, for `input_is_scratch=True`) runs under them too.

Only what minidist calls is modelled: `all_reduce`, `all_gather_into_tensor` and
`reduce_scatter_tensor` are deferred; `broadcast`, `scatter` and the list `all_gather`, which
minidist only calls synchronously, refuse `async_op=True` rather than pretend. `isend`/`irecv`
(`comm.ring_all_reduce`, waited at once) are left alone. The deferred collectives run in the
order the ranks wait for them: gloo needs the same order of collectives on every rank, which holds
because every rank of a data-parallel run waits in the same order.
"""

import sys
import weakref

import torch
import torch.distributed as dist

DEFERRED = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
SYNC_ONLY = ("broadcast", "scatter", "all_gather")


class CollectiveMisuse(RuntimeError):
    """A collective's tensors were used in a way that corrupts results under NCCL."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes, so that NaN compares equal to the same NaN."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)


def _freed(t: torch.Tensor) -> bool:
    return t.numel() > 0 and t.untyped_storage().nbytes() == 0


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class Deferred:
    """The handle of an asynchronous collective under the harness: the real one runs at `wait()`."""

    def __init__(self, harness, name: str, run, inputs: list, outputs: list):
        self.harness, self.name, self.run = harness, name, run
        self.snapshots = [t.clone() for t in inputs]  # what is sent, taken before any poison
        # An input that is an output too (an all-reduce), or a view of one (an all-gather in place),
        # is poisoned with it: the output's check covers it.
        self.inputs = [(t, snapshot) for t, snapshot in zip(inputs, self.snapshots)
                       if not any(_shares_storage(t, o) for o in outputs)]
        for t in outputs:
            _poison(t)
        self.outputs = [(t, t.clone()) for t in outputs]  # the poison, to see a write into it
        self.done = False
        harness.pending.append(self)
        harness.deferred += 1

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout=None) -> bool:
        if self.done:
            return True
        self.harness.pending.remove(self)
        for t, _ in self.inputs + self.outputs:
            if _freed(t):
                raise CollectiveMisuse(f"{self.name}: a buffer was freed before the collective completed "
                                       "(on NCCL it would still be read or written)")
        for what, pairs in (("input", self.inputs), ("output", self.outputs)):
            for t, before in pairs:
                if not torch.equal(_bits(t), _bits(before)):
                    raise CollectiveMisuse(f"{self.name}: an {what} was written before the collective completed "
                                           "(on NCCL the write races with the collective)")
        self.run(*self.snapshots)
        self.done = True
        self.inputs = self.outputs = self.snapshots = self.run = None  # let go, as NCCL does at completion
        return True


class NcclLike:
    """Install the harness in this rank for the duration of a `with` block (see the module's docstring)."""

    def __init__(self, backend: str = "nccl"):
        self.backend = backend
        self.pending = []  # handles not yet waited for
        self.deferred = 0  # how many collectives were deferred to their wait(): the harness was in the way
        self.routed = {}  # id(storage) -> weak reference: host storages that went through collective_device
        self.routed_count = 0  # how many host tensors collective_device sent through "the GPU"
        self.real = {}

    # ------------------------------------------------------------------ install and uninstall
    def install(self):
        from minidist.memory import sides  # noqa: F401 (it learns of host tensors from now on)
        from minidist.parallel import comm, flat

        self.real = {name: getattr(dist, name) for name in (*DEFERRED, *SYNC_ONLY, "get_backend")}
        self.real_collective_device = flat.collective_device
        for name in DEFERRED:
            setattr(dist, name, getattr(self, name))
        for name in SYNC_ONLY:
            setattr(dist, name, self._sync_only(name))
        dist.get_backend = self.get_backend
        flat.collective_device = comm.collective_device = self.collective_device
        return self

    def uninstall(self, raise_pending: bool = True) -> None:
        from minidist.parallel import comm, flat

        for name, fn in self.real.items():
            setattr(dist, name, fn)
        flat.collective_device = comm.collective_device = self.real_collective_device
        pending, self.pending = self.pending, []
        if pending and raise_pending:
            raise CollectiveMisuse(f"{len(pending)} collectives never waited for "
                                   f"({', '.join(h.name for h in pending)}): on NCCL their results are never sure")

    def __enter__(self):
        return self.install()

    def __exit__(self, kind, *_) -> None:
        self.uninstall(raise_pending=kind is None)  # a failure inside the block is the one to report

    # ------------------------------------------------------------------ as NCCL
    def get_backend(self, group=None):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return self.backend if caller.startswith("minidist.") else self.real["get_backend"](group)

    def collective_device(self, t: torch.Tensor, group=None) -> torch.device:
        """The real `collective_device`, asked with CUDA's current device answered as 0; the rank's
        own device stands in for the GPU it picks. A host tensor sent this way may enter collectives."""
        from minidist.memory import sides

        current = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0
        try:
            chosen = self.real_collective_device(t, group)
        finally:
            torch.cuda.current_device = current
        if chosen.type == "cuda" and sides.is_host(t):
            storage = t.untyped_storage()
            self.routed[id(storage)] = weakref.ref(storage)
            self.routed_count += 1
        return t.device if chosen.type == "cuda" else chosen

    def _check_device_memory(self, name: str, tensors) -> None:
        from minidist.memory import sides

        if self.backend != "nccl":
            return
        for t in tensors:
            storage = t.untyped_storage()
            ref = self.routed.get(id(storage))
            if sides.is_host(t) and (ref is None or ref() is not storage):
                raise CollectiveMisuse(f"{name} was given a host tensor (placed by offload.py) that did not go "
                                       "through flat.collective_device: NCCL moves only GPU memory")

    # ------------------------------------------------------------------ the collectives
    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self._check_device_memory("all_reduce", [tensor])
        real = self.real["all_reduce"]
        if not async_op:
            return real(tensor, op=op, group=group)

        def run(sent):
            real(sent, op=op, group=group)
            tensor.copy_(sent)
        return Deferred(self, "all_reduce", run, [tensor], [tensor])

    def all_gather_into_tensor(self, output, input, group=None, async_op=False):
        self._check_device_memory("all_gather_into_tensor", [output, input])
        real = self.real["all_gather_into_tensor"]
        if not async_op:
            return real(output, input, group=group)
        return Deferred(self, "all_gather_into_tensor", lambda sent: real(output, sent, group=group), [input], [output])

    def reduce_scatter_tensor(self, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        """NCCL's reduce-scatter, over gloo: the sum of a copy of `input` (an all-reduce), shard r kept."""
        self._check_device_memory("reduce_scatter_tensor", [output, input])
        n, rank = dist.get_world_size(group), dist.get_rank(group)

        def run(sent):
            self.real["all_reduce"](sent, op=op, group=group)
            output.copy_(sent.view(n, -1)[rank].view_as(output))
        if not async_op:
            run(input.clone())
            return None
        return Deferred(self, "reduce_scatter_tensor", run, [input], [output])

    def _sync_only(self, name: str):
        real = self.real[name]

        def call(*args, async_op=False, **kwargs):
            if async_op:
                raise NotImplementedError(f"the NCCL-like harness does not model an asynchronous {name}")
            self._check_device_memory(name, [a for a in args if isinstance(a, torch.Tensor)])
            return real(*args, **kwargs)
        return call


def under(enabled: bool, backend: str = "nccl"):
    """`NcclLike(backend)` when `enabled`, else a block that changes nothing: for workers that run
    the same variant plain and under the harness."""
    from contextlib import nullcontext

    return NcclLike(backend) if enabled else nullcontext()
