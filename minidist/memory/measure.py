"""Measure what one rank holds, to hold `estimator.py`'s estimate to account.

On a GPU the truth is the caching allocator's counter, `torch.cuda.max_memory_allocated`: every
byte PyTorch handed out, at its highest. The CPU has no such counter (the process's resident
size mixes in the interpreter, libraries and freed-but-kept pages), so there we count tensors:

- *the whole step's peak*: every tensor alive at once, whatever it is for (`LiveTensors`, the
  idea of PyTorch's `MemTracker`). Every operator then passes through Python, which slows a step
  of the course's tiny models up to about three times, so the loop traces the
  first step and every `--trace_memory_every`-th; the others log no CPU peak;
- the breakdown, every step: *model states*, the parameters, their gradients and the
  optimizer's state tensors this rank holds after the optimizer step (for FSDP2 the local shards
  of its DTensors), each storage once; and *activations*, the tensors autograd saves for
  backward, seen through `torch.autograd.graph.saved_tensors_hooks`. Each saved tensor is
  wrapped in a small holder whose lifetime is the saved tensor's: we add its storage's bytes the
  first time a storage is saved (views share one) and subtract them when the last holder goes,
  which autograd does as backward consumes the graph. The highest total is the activation peak.
  Parameters (and views of them, such as the transposed weight a linear layer saves) are model
  states, not activations.
"""

import gc
import types
import weakref
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from minidist.parallel.zero import ZeroDP

TERMS = ("parameters", "gradients", "optimizer_states", "activations", "peak")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (FSDP2); any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors, counted: set | None = None) -> int:
    """Bytes of the distinct storages behind `tensors`: views and repeats count once, and so
    does a storage already in `counted` (which this call adds to)."""
    counted = set() if counted is None else counted
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = _local(t).untyped_storage()
            if storage._cdata not in counted:
                counted.add(storage._cdata)
                total += storage.nbytes()
    return total


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Parameters, gradients and optimizer states held by this rank, in bytes, each storage once."""
    params = list(model.parameters())
    # A sharding optimizer may keep parameters of its own (fp32 masters of a flat shard): count them as its
    # states, unless they are views of the model's own parameters (ZeRO in fp32), already counted.
    extra = [p for group in optimizer.param_groups for p in group["params"] if all(p is not q for q in params)]
    states = [t for state in optimizer.state.values() for t in state.values()]
    shards = gradient_shards(model)
    # FSDP by hand holds frozen weights (LoRA's base) as shards outside any parameter (parallel/frozen.py).
    frozen = [flat.shard for flat in model.frozen_flats()] if hasattr(model, "frozen_flats") else []
    counted = set()
    return {"parameters": storage_bytes(params + frozen, counted),
            "gradients": storage_bytes([p.grad for p in params + extra] + shards, counted),
            "optimizer_states": storage_bytes(states + extra, counted)}


def gradient_shards(model) -> list[torch.Tensor]:
    """Gradients kept outside any `param.grad`: ZeRO-2's, the reduced shard of each bucket
    (`zero.FlatBucket.grad_shard`, from its reduce-scatter to `zero_grad`)."""
    if not isinstance(model, ZeroDP):
        return []
    return [b.grad_shard for b in model.buckets if b.grad_shard is not None]


class _Saved:
    """Holds one saved tensor for autograd; tells the tracker when autograd lets it go."""

    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor, key, tracker):
        self.tensor, self.key, self.tracker = tensor, key, tracker

    def __del__(self):
        self.tracker._release(self.key)


class SavedActivations:
    """`with tracker:` counts the bytes autograd saves for backward; `.peak` is the most held at once."""

    def __init__(self):
        self.live = {}  # storage -> [holders, bytes]
        self.current = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def reset_peak(self) -> None:
        self.peak = self.current

    def _pack(self, tensor):
        base = tensor._base if tensor._base is not None else tensor
        if base.is_leaf and base.requires_grad or isinstance(base, torch.nn.Parameter):
            return tensor  # a parameter (LoRA's frozen ones too), or a view of one: a model state
        storage = tensor.untyped_storage()
        key = storage._cdata
        entry = self.live.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return _Saved(tensor, key, self)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key):
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]


class MemoryMeter:
    """What the training loop records each step, on every rank (see the module docstring)."""

    def __init__(self, device: torch.device, trace_every: int = 0):
        self.device, self.trace_every = device, trace_every
        self.saved = SavedActivations()
        self.steps = 0
        self.tracker = None  # on CPU, the LiveTensors of a traced step

    @contextmanager
    def step(self, model, optimizer):
        """Around one whole step (forward, backward, clipping, the optimizer step): watch what
        forward saves for backward, and start a fresh whole-step peak. On a GPU the allocator's
        counter costs nothing. On the CPU the peak needs `LiveTensors`, which slows a step up to
        about three times, so only the first step and every `trace_every`-th after it are traced (0: the
        first only; a loop that times its steps leaves the first out anyway, as warm-up)."""
        self.saved.reset_peak()
        trace = self.device.type == "cpu" and (self.steps == 0 or self.trace_every and self.steps % self.trace_every == 0)
        self.steps += 1
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        with self.saved, (LiveTensors(self.device, model, optimizer) if trace else nullcontext()) as tracker:
            self.tracker = tracker
            yield

    def read(self, model, optimizer) -> dict:
        """Call after the optimizer step, before zero_grad: the gradients are still there. `peak`
        is the whole step's (None on a CPU step that was not traced)."""
        memory = {**model_state_bytes(model, optimizer), "activations": self.saved.peak, "peak": None}
        if self.device.type == "cuda":
            memory["peak"] = torch.cuda.max_memory_allocated(self.device)
        elif self.tracker is not None:
            memory["peak"] = self.tracker.peak
        return memory


class LiveTensors(TorchDispatchMode):
    """`with LiveTensors(device, model, optimizer) as live:` the most bytes of tensors alive at
    once during the block, as an allocator would count them, on a device that has no allocator
    counter (the CPU).

    The idea of PyTorch's `MemTracker` (`torch.distributed._tools.mem_tracker`), written out:
    - at the start, every tensor the model and the optimizer hold is counted, each storage once,
      as the allocator holds each block once: not only parameters, gradients and optimizer
      states, but whatever else the wrapper keeps (communication buckets, gradient shards, FSDP's
      gathered buffers), found by following the objects they reference (`reachable_tensors`);
    - in the block, every operator goes through `__torch_dispatch__`, and each new storage its
      outputs hold is counted, with a weak reference whose callback subtracts it when the storage
      is freed (autograd dropping a saved tensor, a gradient set to None);
    - `UntypedStorage.resize_` does not go through the dispatcher, and FSDP frees a gathered unit
      by shrinking its storage to 0 bytes, so it is wrapped to follow the size;
    - the peak is read after every operator.
    Unlike `MemTracker` it keeps no per-module statistics, so a module may run several times in
    the block (gradient accumulation) and the step slows down less. A dispatch mode belongs to
    one thread: what a library allocates in threads of its own is seen only once this thread's
    operators touch it. PyTorch's gloo backend copies the input of a reduce-scatter in its worker
    thread; the copy shows from the `wait()` on, until the work is let go (`moments.py` counts it
    so). NCCL, on a GPU, makes no such copy, nor does `comm.reduce_scatter` with a scratch input."""

    def __init__(self, device: torch.device, *roots):
        super().__init__()
        self.device, self.roots = device, roots
        self.current = self.peak = 0
        self._sizes = {}  # id(storage) -> bytes counted for it
        self._refs = {}  # id(storage) -> weak reference (keeps the callback alive)
        self._resize = None

    def _track(self, t) -> None:
        if not isinstance(t, torch.Tensor) or isinstance(t, (DTensor, FakeTensor)) or t.device != self.device:
            # A DTensor (FSDP2) only wraps its local shard, which is counted itself; DTensor works out
            # output shapes on fake tensors, which hold no memory.
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._refs:
            self._follow(storage)
            return
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
        self._sizes[key] = storage.nbytes()
        self.current += storage.nbytes()

    def _follow(self, storage) -> None:
        """A known storage changed size (FSDP gathering into it, or freeing it)."""
        key = id(storage)
        if key in self._sizes and self._sizes[key] != storage.nbytes():
            self.current += storage.nbytes() - self._sizes[key]
            self._sizes[key] = storage.nbytes()
            self.peak = max(self.peak, self.current)

    def _free(self, key) -> None:
        self.current -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def __enter__(self):
        gc.collect()  # what is only waiting for the collector is not alive
        for t in reachable_tensors(*self.roots):
            self._track(t)
        self.peak = self.current
        self._resize = torch.UntypedStorage.resize_
        original, follow = self._resize, self._follow

        def resize_(storage, size):
            original(storage, size)
            follow(storage)

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented  # FSDP2: let DTensor turn the op into ops on its local shards first
        out = func(*args, **(kwargs or {}))
        self._track_outputs(out)
        self.peak = max(self.peak, self.current)
        return out

    def _track_outputs(self, out) -> None:
        """Every tensor an operator returned. An ATen operator returns a tensor, a tuple or list of
        them (`split`, `native_layer_norm`), or no tensor at all: walked here directly, since a
        traced step makes thousands of calls and a general pytree walk costs several times this."""
        if isinstance(out, torch.Tensor):
            self._track(out)
        elif isinstance(out, (tuple, list)):
            for item in out:
                self._track_outputs(item)


_NOT_STATE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType, types.FrameType)


def reachable_tensors(*roots) -> list[torch.Tensor]:
    """Every tensor the objects `roots` reference, directly or through their attributes, lists,
    dicts and other objects (each tensor's `.grad` too), but not through classes, functions or
    modules, which would lead to everything the program has loaded."""
    seen, stack, found = set(), list(roots), []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _NOT_STATE):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            if obj.is_leaf and obj.grad is not None:
                stack.append(obj.grad)
        stack.extend(gc.get_referents(obj))
    return found


def step_peak(run_step, model, optimizer, device: torch.device) -> int:
    """The most bytes of live tensors at any moment of one call of `run_step` (a whole training
    step: forward, backward, optimizer step), on this rank, counted as a GPU allocator counts
    them: every tensor, whatever it is for, temporaries and retained buffers included.

    On a GPU that is the caching allocator's own counter. On the CPU it is `LiveTensors`, which
    slows the step down: a step it watches is not a step to time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run_step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    with LiveTensors(device, model, optimizer) as live:
        run_step()
    return live.peak


def gather(memory: dict, device: torch.device) -> dict:
    """Every rank's figures, as lists by rank, on every rank (one small all-gather)."""
    mine = torch.tensor([-1.0 if memory[k] is None else float(memory[k]) for k in TERMS], dtype=torch.float64,
                        device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    table = torch.stack(everyone).tolist()  # read once: one wait for the device (runtime/host_syncs.py)
    return {k: [None if row[i] < 0 else int(row[i]) for row in table] for i, k in enumerate(TERMS)}
