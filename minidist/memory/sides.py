"""Device and host: which side of the PCIe link holds each live tensor, under `--cpu_offload`.

With CPU offload (`parallel/offload.py`) a rank's memory is on two sides: the GPU's (weights in
the compute dtype, activations, buckets, gathered units) and the host's (fp32 masters, Adam's
moments, the gradients copied out, the CPU step's temporaries). On a GPU each tensor's `device`
says which side holds it. On a CPU-only machine, where the tests run, both sides are the same
memory, so `SplitLiveTensors` tells them apart by the rules a GPU would impose:

- a tensor that `offload.py` placed on the host side is host memory: it tells this module of each
  one it places (`offload.on_host_placement`), and this module records its storage (`is_host`);
- an operator with a host tensor among its inputs runs on the CPU, so what it allocates is host
  memory too (AdamW's moments, made `zeros_like` the host master; the step's temporaries);
- the optimizer's state of a host parameter is host memory (made so on the first step; marked
  when a later step starts, whether the first was watched or not);
- everything else is device memory.

It is `measure.LiveTensors` (the whole step's live tensors, each storage once) with the bytes
kept per side: `device_peak` and `host_peak` are each side's own highest point in the block (they
need not fall at the same moment), `peak` their sum's. `estimator.py`'s device and host columns
(`offload_split`) are held to them in tests/parallel/test_offload.py.

Import this module before the model is wrapped: it subscribes when imported, and a host tensor
placed before then (an offloaded master) is not known to be one.
"""

import torch

import weakref

import torch

from minidist.memory.measure import LiveTensors
from minidist.parallel import offload

_HOST = {}  # id(storage) -> a weak reference to it: the storages on the host side
_watching = []  # the `SplitLiveTensors` blocks running now


def register_host(t: torch.Tensor) -> torch.Tensor:
    """Record `t`'s storage as host memory (until the storage is freed); return `t`."""
    storage = t.untyped_storage()
    key = id(storage)
    if key not in _HOST:
        _HOST[key] = weakref.ref(storage, lambda _, key=key: _HOST.pop(key, None))
    return t


def is_host(t: torch.Tensor) -> bool:
    """Whether `t` lives on the host side (placed there by `offload.py`, or marked by `register_host`)."""
    ref = _HOST.get(id(t.untyped_storage()))
    return ref is not None and ref() is not None


def _placed_on_host(t: torch.Tensor) -> None:
    register_host(t)
    for live in _watching:
        live.placed_on_host(t)


offload.on_host_placement(_placed_on_host)


def mark_optimizer_states(*roots) -> None:
    """The states of every host parameter of the optimizers among `roots`: host memory."""
    for root in roots:
        if isinstance(root, torch.optim.Optimizer):
            for param, state in root.state.items():
                if is_host(param):
                    for t in state.values():
                        if isinstance(t, torch.Tensor):
                            register_host(t)


class SplitLiveTensors(LiveTensors):
    """`with SplitLiveTensors(device, model, optimizer) as live:` `live.device_peak`, `live.host_peak`."""

    def __init__(self, device: torch.device, *roots):
        super().__init__(device, *roots)
        self.host_keys = set()  # id(storage) of the host side's storages
        self.host_current = self.host_peak = self.device_peak = 0
        self._inputs_on_host = False
        self._newest = (None, 0)  # the storage tracked last, and the device peak before it came

    def _note(self) -> None:
        self.host_peak = max(self.host_peak, self.host_current)
        self.device_peak = max(self.device_peak, self.current - self.host_current)

    def _track(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device != self.device:
            return super()._track(t)
        key = id(t.untyped_storage())
        new = key not in self._refs
        super()._track(t)
        if new and key in self._refs:
            self._newest = (key, self.device_peak)
            if self._inputs_on_host or is_host(t):
                register_host(t)  # what the CPU made from host tensors: host memory, from now on
                self._count_on_host(key)
        self._note()

    def placed_on_host(self, t) -> None:
        """`offload.py` has just allocated `t` on the host side. Its allocation was the last one
        tracked, as device memory: count it on the host, and take back the device peak it raised."""
        key = id(t.untyped_storage())
        if key not in self._refs or key in self.host_keys:
            return
        if key == self._newest[0]:
            self.device_peak = self._newest[1]
        self._count_on_host(key)
        self._note()

    def _count_on_host(self, key) -> None:
        self.host_keys.add(key)
        self.host_current += self._sizes[key]

    def _follow(self, storage) -> None:
        key = id(storage)
        before = self._sizes.get(key, 0)
        super()._follow(storage)
        if key in self.host_keys:
            self.host_current += self._sizes.get(key, 0) - before
        self._note()

    def _free(self, key) -> None:
        if key in self.host_keys:
            self.host_keys.discard(key)
            self.host_current -= self._sizes.get(key, 0)
        super()._free(key)

    def __enter__(self):
        mark_optimizer_states(*self.roots)
        out = super().__enter__()
        self.device_peak, self.host_peak = self.current - self.host_current, self.host_current
        _watching.append(self)
        return out

    def __exit__(self, *exc):
        _watching.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs or {})) if isinstance(a, torch.Tensor)]
        self._inputs_on_host = any(is_host(t) for t in inputs)
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._inputs_on_host = False
