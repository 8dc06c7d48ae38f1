"""PyTorch's own memory tracker on one training step of the whole model, with fake tensors.

`estimator.py` adds one rank's peak up, term by term and moment by moment. PyTorch ships a tool
that measures it instead: `MemTracker` (`torch.distributed._tools.mem_tracker`), a
`TorchDispatchMode` that sees every operator, counts each new tensor storage once, subtracts it
when the storage is freed, and keeps the largest total and its split at that moment, per device.
Run under `FakeTensorMode`, the operators compute shapes and dtypes but no values and allocate
nothing, so one step of CodeLlama-7b is traced on a laptop CPU, with no GPU and no weights: the
model is built from its config alone (`AutoModelForCausalLM.from_config` inside the fake mode).

The step is the training loop's own (`step.py`): forward, `token_loss_sum`, backward,
`strategy.build_optimizer`'s AdamW step, at the setup's batch, length and precision. Before it, the
optimizer takes one step on zero gradients, so its states exist as in every step after the first
(the estimate is of such a step). That step also matters for fake tensors: traced cold, AdamW's
first step over FSDP2's DTensor shards counts 5 times the optimizer states that real tensors give
(62.3 against 12.5 MB on a 4-layer tiny Llama over 4 fake ranks, one run each; not looked into
further), while after it fake and real tensors agree to the byte. Per strategy:
- DDP (either implementation): one rank's plain step, under bf16 autocast when `--mixed_precision
  bf16` (`estimator.compute_mode`). No process group: a rank computes the same step whatever N is.
- FSDP, PyTorch's (`--impl torch`): `TorchFSDP.wrap`, the loop's `fully_shard` per decoder layer
  and the root, on a fake process group of world size N (`FakeStore` and backend "fake", as
  PyTorch's own tests of FSDP's memory use): collectives return at once, so rank 0 is traced
  alone. Its tracker is `FSDPMemTracker`, MemTracker's subclass that knows FSDP's buffers.
- ZeRO-1/2 and the hand-written FSDP are minidist's own: not traced here (None, "-" in tables).

What MemTracker counts, read in torch 2.13's `torch/distributed/_tools/mem_tracker.py`:
- what exists before the block only if it is handed to `track_external` (lines 788-820): the
  model's parameters and buffers and the optimizer's states; everything made inside the block
  through the dispatcher, sorted by when it appears (`__torch_dispatch__`, lines 941-951):
  "Optstate" during `optimizer.step()` (so AdamW's multi-tensor temporaries count as optimizer
  states), "Temp" in backward (gradients of activations), "Activation" otherwise (everything
  forward makes, kept or not); a parameter's gradient moves to "Gradient" when its hook fires;
- bytes as `storage.size() * element_size` (lines 148-158): exact on the CPU, rounded up to 512
  bytes on CUDA as the caching allocator does, but not the allocator's cache, fragmentation, the
  CUDA context or NCCL's buffers;
- a storage resized in place through `UntypedStorage.resize_` (FSDP frees units that way),
  which it patches (lines 483-497); a module run twice in one block raises NotImplementedError
  (lines 671-678): gradient accumulation cannot be traced;
- under fake tensors a storage's size is known without memory, so the figures are the same as
  with real tensors (tests/memory/test_tracker.py checks one FSDP case against a real run).
What it misses for this comparison: PyTorch's DDP allocates its gradient buckets in C++ when it
wraps the model, outside any tracker, and a plain step has none: 4 bytes per parameter that
`estimator.py` counts and the DDP trace does not. And the trace runs on the CPU device: autocast
is the CPU's (its bf16 and fp32 op lists are not CUDA's in every op) and SDPA picks its CPU
kernel, so a GPU step's activations may differ a little from the traced ones.

MemTracker also keeps every module's own peak, updated after every operator for every module
seen so far: quadratic in depth (65 s for CodeLlama-7b's DDP step here). Only the step's peak is
read, so `_update_peak_stats` is cut to its last lines, the global peak (lines 520-523).
Even so, on a 2-core CPU machine shared with other work CodeLlama-7b's DDP step took 11 to 18 s
to trace, its FSDP step on 4 fake ranks 25 to 60 s of wall time (a few runs each, batch 1 to 16),
so each (config, setup) is traced once and kept as JSON under the cache folder
(`$MINIDIST_CACHE/memtracker`, as `--model tiny`'s), and the command traces only when asked
(`--memtracker`; `--readme_table` always does).
"""

import json
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from functools import lru_cache
from types import SimpleNamespace

import torch

from minidist.memory import cache
from minidist.memory.estimator import Setup, as_dict, load_config
from minidist.memory.trace import batch_for


def applies(setup: Setup) -> bool:
    """DDP (a plain step, either implementation) and PyTorch's FSDP2; not ZeRO or FSDP by hand, nor
    tensor parallelism (one process's whole model is not a rank's slice)."""
    if setup.options.tp_size > 1:
        return False
    return setup.strategy == "ddp" or (setup.strategy == "fsdp" and setup.options.impl == "torch")


def peak(source: str, setup: Setup) -> dict | None:
    """MemTracker's peak of one step, {"peak": bytes, category: bytes, ...}; None where it does not
    apply; {"error": why} for a model it cannot trace (one that `AutoModelForCausalLM` cannot build,
    T5 for one), so that the estimate is still printed.

    Traced once per config and setup, then read back from the cache folder."""
    if not applies(setup):
        return None
    if setup.strategy == "ddp":
        setup = replace(setup, world_size=1)  # the plain step is the same on every N
    try:
        return dict(_cached(source, setup))
    except Exception as err:  # a third-party tool over any model: say why, in one line, and go on
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return {"error": f"{type(err).__name__}: {first[:200]}"}


@lru_cache(maxsize=None)
def _cached(source: str, setup: Setup) -> tuple:
    key = {"config": load_config(source).to_dict(), "setup": as_dict(setup), "format": 1}
    return tuple(cache.cached("memtracker", key, lambda: trace(source, setup)).items())


def trace(source: str, setup: Setup, fake: bool = True) -> dict:
    """Run one step of the model `source` names under FakeTensorMode and MemTracker; return its peak
    and the split at that moment, in bytes, with PyTorch's category names. `fake=False` runs it with
    real tensors (random weights): the same figures, at the cost of the memory (a test's check)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from minidist.step import token_loss_sum
    from minidist.strategy import get_strategy

    if not applies(setup):
        raise ValueError(f"MemTracker traces DDP and PyTorch's FSDP here, not {setup.options.impl}/{setup.strategy}")
    config = load_config(source)
    fake_mode = FakeTensorMode() if fake else nullcontext()
    with warnings.catch_warnings(), _fake_world(setup.world_size if setup.strategy == "fsdp" else None) as mesh, fake_mode:
        warnings.filterwarnings("ignore", "`gradient_checkpointing_enable` is deprecated", FutureWarning)  # the loop's call
        # This process is rank 0 of the fake world (`mesh`); every fake rank builds the same model
        # from its config, so there is nothing to load from rank 0 (world_size 1: `TorchFSDP.wrap`
        # skips its broadcast of rank 0's weights, which would need a real process group).
        process = SimpleNamespace(device=torch.device("cpu"), rank=0, is_main=True, world_size=1)
        strategy = get_strategy(setup.options, process, mesh)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # fp32 masters, as the loop loads
        model.train()
        if setup.options.gradient_checkpointing:
            strategy.checkpoint_activations(model)
        if setup.strategy == "fsdp":
            model = strategy.wrap(model)
        optimizer = strategy.build_optimizer(model, lr=1e-5)
        for p in model.parameters():  # one step on zero gradients: AdamW's states exist, as after step 1
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # The loop's batch shape (`trace.batch_for`): the last sequence right-padded from half its length.
        batch = batch_for(setup.batch_size_per_device, setup.max_seq_length, setup.padded, vocab_size=100)
        tracker = _tracker(model, optimizer, fsdp=setup.strategy == "fsdp")
        with tracker:
            token_loss_sum(model, batch, strategy).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    (snapshot,) = tracker.get_tracker_snapshot("peak").values()  # one device: the CPU
    split = {getattr(k, "value", k): int(v) for k, v in snapshot.items()}
    return {"peak": split.pop("Total"), **split}


def _tracker(model, optimizer, fsdp: bool):
    """MemTracker (FSDPMemTracker for FSDP2) that keeps only the global peak (module docstring)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    class GlobalPeakOnly(FSDPMemTracker if fsdp else MemTracker):
        def _update_peak_stats(self, peak_state) -> None:
            for device, snap in self._curr_mem_snap.items():  # mem_tracker.py lines 520-523
                if self._peak_mem.get(device, 0) < snap["Total"]:
                    self._peak_mem[device] = snap["Total"]
                    self._peak_mem_snap[device] = dict(snap)

    if fsdp:
        tracker = GlobalPeakOnly(model, optimizer)  # it finds the shards, gathered units and states itself
    else:
        tracker = GlobalPeakOnly()
        tracker.track_external(model, optimizer)
    return tracker


class _FakeMesh:
    """What `TorchFSDP.wrap` asks of a mesh: the shard dimension as a DeviceMesh."""

    def __init__(self, device_mesh):
        self.device_mesh = device_mesh

    def shard_device_mesh(self):
        return self.device_mesh


@contextmanager
def _fake_world(world_size: int | None):
    """A fake process group of `world_size` ranks, this process rank 0 (None: no group at all)."""
    if world_size is None:
        yield None
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("MemTracker's FSDP trace needs a process of its own: a process group already exists here")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield _FakeMesh(init_device_mesh("cpu", (world_size,)))
    finally:
        dist.destroy_process_group()
