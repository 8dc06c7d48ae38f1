"""How many times does my step wait for the GPU? Host synchronisations, counted op by op.

A GPU runs its kernels in the order the CPU queued them, while the CPU goes on ahead: a good
step keeps the CPU queueing forward, backward, collectives and the optimizer step well before
the GPU gets to them, which is also what lets communication overlap computation. Any line that
needs a tensor's *value* on the host stops that: the CPU waits until the GPU has finished
everything queued before it, and the GPU then idles while the CPU queues the next kernels.
These waits hide in innocent Python:

    loss.item(), float(norm), int(count)   aten._local_scalar_dense
    if flag:  /  bool(tensor)              aten.is_nonzero (then _local_scalar_dense)
    torch.nonzero(t), t[mask], t.unique()  the output's shape depends on the values
    torch.equal(a, b)                      a yes or no on the host
    t.cpu(), t.tolist(), t.numpy()         a copy to the host that the CPU reads at once

On a CPU run they cost nothing, so nobody notices them; on a GPU each one ends the CPU's lead.
`HostSyncs` counts them: a `TorchDispatchMode` sees every aten op the step runs (backward's too),
and a `TorchFunctionMode` sees `Tensor.tolist` and `Tensor.numpy`, which on a CPU tensor read its
memory without any aten op. Each sync is recorded with where it comes from (`Sync`): the line
that asked for the value, and the first line of `minidist/` on the way there, so that a budget
that fails names the line to change. A library's syncs (torch's optimizers, the model's forward in
transformers) are told apart from our code's: a budget holds ours (`HostSyncs.ours`).

Which tensors count: those on the step's device. On a GPU run a read of a tensor that lives on
the host anyway is free, and is not counted. On a CPU run the host *is* the device, so every read
counts: the CPU count is what the same code would wait for if its tensors were on a GPU (read a
host copy once, with `tolist()`, rather than element by element).

What it does not see: waits that are no aten op, such as `torch.cuda.synchronize()` and
`Event.synchronize()` (the loop's timing and offload's copies call them on purpose), and
`torch._assert_async`, which is the asynchronous assertion (on a GPU it checks on the device and
never waits), so it is not counted. A copy to the host with `non_blocking=True` does not wait
either, and is not counted; the event that later waits for it is one of those explicit waits.

    syncs = HostSyncs(device)
    with syncs.step():
        ...                     # one optimizer step
    print(syncs.report())       # how many, and from which lines
"""

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# The times one optimizer step of the loop may make the host wait for the device in our code, whatever
# the number of micro-batches: each is a value the CPU needs now (this module counts them,
# tests/loop/test_host_syncs.py holds the loop to this). Everything else stays on the device, each
# micro-batch's loss too (step.train_step adds them there), and the gradient norm, which clipping
# needs only on the device. All come after the device has finished the step (on a GPU the loop waits
# for it there, to time it: torch.cuda.synchronize, no aten op, not counted): none in the middle.
HOST_SYNCS_PER_STEP = {
    # the global batch's loss, summed over ranks, for the log line, and the gradient norm clipping
    # scaled by on the device, for the record: read together, after the step
    "loss and gradient norm": 1,
    "memory by rank": 1,  # every rank's figures for the record, in one read (memory/measure.gather)
    "bytes across nodes by rank": 1,  # every rank's, in one read (parallel/across_nodes.take_split)
    "stop vote": 1,  # did any rank get a stop signal, or diverge? (checkpoint/preemption.StopSignals.agreed)
}


aten = torch.ops.aten
# Ops whose result the CPU needs at once: a number, a yes or no, or a shape that depends on the values.
READS_A_VALUE = {aten._local_scalar_dense, aten.is_nonzero, aten.equal, aten.nonzero, aten.masked_select,
                 aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.bincount}
# Indexing with a boolean mask (t[mask] = ...) needs the number of True elements: a nonzero inside.
MASK_INDEXED = {aten.index, aten.index_put, aten.index_put_}
# Copies that can take a tensor from the device to the host.
COPIES = {aten._to_copy, aten.copy_}
# Tensor methods that read a CPU tensor's memory without an aten op (on a GPU tensor they copy first).
HOST_READS = {torch.Tensor.tolist, torch.Tensor.numpy}

PACKAGE = Path(__file__).resolve().parent.parent  # minidist/: where a sync is attributed
TORCH = Path(torch.__file__).resolve().parent
TORCH_PLUMBING = {"_ops.py", "_compile.py", "overrides.py", "_python_dispatch.py", "_tensor.py"}


@dataclass(frozen=True)
class Sync:
    """One wait of the host: the op that needed the value, the line that asked for it (`origin`,
    torch's dispatch machinery left out), and the line of minidist that led there (`where`).

    `library`: the line that asked is a library's, not ours: torch's own Python (AdamW reads its
    step counter, a host tensor on a GPU too) or the model's (transformers checks the attention
    mask). Everything else is our code, minidist's or a test's or notebook's code in the step:
    what a budget holds (`ours`)."""

    op: str
    origin: str  # `transformers/masking_utils.py:292 (_ignore_causal_mask_sdpa)`
    where: str  # `minidist/parallel/ddp.py:64 (forward)`; "" when no frame of minidist is on the stack
    library: bool

    def __str__(self) -> str:
        if self.origin == self.where or not self.where:
            return f"{self.op} at {self.origin}"
        return f"{self.op} at {self.origin}, called from {self.where}"


def _tensors(value):
    """The tensors among an op's arguments (lists of tensors too: index takes a list of indices)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _in_library(path: Path) -> bool:
    return PACKAGE not in path.parents and (TORCH in path.parents or "site-packages" in path.parts)


def _line(frame) -> str:
    """`package/module.py:LINE (function)`: the path from the package's folder on."""
    path = Path(frame.f_code.co_filename)
    if PACKAGE in path.parents:
        path = path.relative_to(PACKAGE.parent)
    elif "site-packages" in path.parts:
        path = Path(*path.parts[path.parts.index("site-packages") + 1:])
    else:
        path = Path(path.name)
    return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"


def _passes_on(frame) -> bool:
    """Is this frame plumbing between the line that asked for a value and the op? This module, a
    mode's `__torch_dispatch__` or `__torch_function__` (this one's, or `memory/measure.py`'s
    tracker: they pass ops on), and torch's own dispatch machinery and Tensor methods written in
    Python (`_tensor.py`: `f"{loss:.4f}"` is the caller's read, not torch's)."""
    path = Path(frame.f_code.co_filename)
    if path == Path(__file__) or frame.f_code.co_name in ("__torch_dispatch__", "__torch_function__"):
        return True
    return TORCH in path.parents and (path.name in TORCH_PLUMBING or "_dynamo" in path.parts)


def _sync(op: str) -> Sync:
    """The `Sync` of `op`, from the stack of the code that ran it, plumbing left out (`_passes_on`)."""
    frame, origin, where, library = sys._getframe(1), "", "", False
    while frame is not None and not where:
        if not _passes_on(frame):
            path = Path(frame.f_code.co_filename)
            if not origin:
                origin, library = _line(frame), _in_library(path)
            if PACKAGE in path.parents:
                where = _line(frame)
        frame = frame.f_back
    return Sync(op, origin, where, library)


class _DispatchCounter(TorchDispatchMode):
    """Sees every aten op; hands the ones that wait to `count`."""

    def __init__(self, syncs: "HostSyncs"):
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented  # FSDP2: let DTensor turn the op into ops on its local shards first
        kwargs = kwargs or {}
        if self.syncs.waits(func, args, kwargs):
            self.syncs.count(str(func))
        return func(*args, **kwargs)


class _FunctionCounter(TorchFunctionMode):
    """Sees `Tensor.tolist` and `Tensor.numpy`, which read a CPU tensor without an aten op."""

    def __init__(self, syncs: "HostSyncs"):
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS and args and args[0].device.type == "cpu" == self.syncs.device.type:
            self.syncs.count(f"Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


class HostSyncs:
    """Count the host synchronisations of each step run under `step()` (module doc): `per_step`
    holds, for every step, the list of its `Sync`s."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.per_step: list[list[Sync]] = []

    def _on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.device.type

    def waits(self, func, args, kwargs) -> bool:
        """Does this aten op make the host wait for the device?"""
        packet = func.overloadpacket
        if packet in READS_A_VALUE:
            return any(self._on_device(t) for t in _tensors(args))
        if packet in MASK_INDEXED:  # t[mask]: the indices are the second argument
            masks = [t for t in _tensors(args[1]) if t.dtype in (torch.bool, torch.uint8)]
            return any(self._on_device(t) for t in masks)
        if packet in COPIES and not kwargs.get("non_blocking", len(args) > 2 and args[2]):
            return self._copies_to_host(packet, args, kwargs)
        return False

    def _copies_to_host(self, packet, args, kwargs) -> bool:
        """A copy from a device tensor into host memory (never on a CPU run: there is no other side)."""
        if packet is aten._to_copy:
            source, target = args[0], kwargs.get("device")
            return source.device.type != "cpu" and target is not None and torch.device(target).type == "cpu"
        target, source = args[0], args[1]  # copy_(self, src): into self
        return source.device.type != "cpu" and target.device.type == "cpu"

    def count(self, op: str) -> None:
        self.per_step[-1].append(_sync(op))

    def ours(self, step: int) -> list[Sync]:
        """Step `step`'s syncs (from 1) that our code asked for, not a library (`Sync.library`)."""
        return [sync for sync in self.per_step[step - 1] if not sync.library]

    @contextmanager
    def step(self):
        """Count the syncs of the code run inside, as one more step of `per_step`."""
        self.per_step.append([])
        with _FunctionCounter(self), _DispatchCounter(self):
            yield

    def report(self) -> str:
        """Each step's count, ours and the libraries', and where each sync comes from."""
        lines = []
        for number, syncs in enumerate(self.per_step, 1):
            ours = len(self.ours(number))
            lines.append(f"step {number}: {ours} host syncs in our code, {len(syncs) - ours} in libraries")
            for sync in sorted(set(syncs), key=lambda s: (s.library, -syncs.count(s), str(s))):
                lines.append(f"  {syncs.count(sync)} x {sync}{'  [library]' if sync.library else ''}")
        return "\n".join(lines)
