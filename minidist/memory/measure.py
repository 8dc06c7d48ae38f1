"""Measure what one rank holds, term by term, to hold `estimator.py`'s estimate to account.

On a GPU the truth is the caching allocator's counter, `torch.cuda.max_memory_allocated`: every
byte PyTorch handed out, at its highest. The CPU has no such counter (the process's resident
size mixes in the interpreter, libraries and freed-but-kept pages), so there we count tensors:

- *model states*: the parameters, their gradients and the optimizer's state tensors this rank
  holds after the optimizer step (for FSDP2 the local shards of its DTensors), each storage once;
- *activations*: the tensors autograd saves for backward, seen through
  `torch.autograd.graph.saved_tensors_hooks`. Each saved tensor is wrapped in a small holder
  whose lifetime is the saved tensor's: we add its storage's bytes the first time a storage is
  saved (views share one) and subtract them when the last holder goes, which autograd does as
  backward consumes the graph. The highest total is the activation peak. Parameters (and views of
  them, such as the transposed weight a linear layer saves) are model states, not activations.

The CPU peak is model states + activation peak. It leaves out what the hooks cannot see: the
gradient buckets of DDP, FSDP's gathered units (freed after each use), a checkpointed layer
recomputed inside backward, and short-lived temporaries. The estimate lists those separately.
"""

import warnings
from contextlib import contextmanager

import torch
import torch.distributed as dist

from minidist.parallel.wrapper import DataParallelWrapper

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
    # ZeRO-2 keeps its gradient shards outside any .grad, and says where.
    shards = model.gradient_shards() if isinstance(model, DataParallelWrapper) else []
    counted = set()
    return {"parameters": storage_bytes(params, counted),
            "gradients": storage_bytes([p.grad for p in params + extra] + shards, counted),
            "optimizer_states": storage_bytes(states + extra, counted)}


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
        if base.is_leaf and base.requires_grad:
            return tensor  # a parameter, or a view of one: a model state
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

    def __init__(self, device: torch.device):
        self.device = device
        self.saved = SavedActivations()

    @contextmanager
    def step(self):
        """Around one step's forward and backward passes: start a fresh peak, watch saved tensors."""
        self.saved.reset_peak()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        with self.saved:
            yield

    def read(self, model, optimizer) -> dict:
        """Call after the optimizer step, before zero_grad: the gradients are still there."""
        memory = {**model_state_bytes(model, optimizer), "activations": self.saved.peak}
        if self.device.type == "cuda":  # the optimizer step may be this step's peak: it is in the counter
            memory["peak"] = torch.cuda.max_memory_allocated(self.device)
        else:
            memory["peak"] = sum(memory.values())
        return memory


def step_peak(run_step, model, optimizer, device: torch.device) -> int:
    """The most bytes of live tensors at any moment of one call of `run_step` (a whole training
    step: forward, backward, optimizer step), on this rank, counted as a GPU allocator counts
    them: every tensor, whatever it is for, temporaries and retained buffers included.

    On a GPU that is the caching allocator's own counter. On the CPU it is PyTorch's `MemTracker`
    (`torch.distributed._tools.mem_tracker`), which watches every allocation and free through a
    dispatch mode, storage resizes included (FSDP frees a unit by shrinking its storage); it
    slows the step down, so a step it watches is not a step to time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run_step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with warnings.catch_warnings():  # it names every None it is handed (a gradient not yet made)
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
        tracker.track_external(model, optimizer)  # what exists before the step: weights, states
        with tracker:
            run_step()
    return tracker.get_tracker_snapshot("peak")[device]["Total"]


def gather(memory: dict, device: torch.device) -> dict:
    """Every rank's figures, as lists by rank, on every rank (one small all-gather)."""
    mine = torch.tensor([float(memory[k]) for k in TERMS], dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    table = torch.stack(everyone).cpu()
    return {k: [int(v) for v in table[:, i]] for i, k in enumerate(TERMS)}
