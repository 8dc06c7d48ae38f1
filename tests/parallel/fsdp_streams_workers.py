"""Worker functions for tests/parallel/test_fsdp_streams.py, run in each rank by `launch`.

A toy model of plain torch modules (an embedding, three `Block`s, an output layer) keeps each launch
to the cost of starting the processes: FSDP wraps it with one unit per `Block` and the root. Each
worker records what the hand-written FSDP does (which collective, on which stream, when it is
waited for) and returns it as plain tuples for the test to read.
"""

from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, LAYERS, TOKENS = 50, 16, 3, 12


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.linear(self.norm(x)))


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def wrap(param_dtype=torch.float32, group=None, frozen_root=False):
    from minidist.parallel.fsdp import FullyShardedDataParallel
    from minidist.parallel.precision import MixedPrecision

    torch.manual_seed(0)
    toy = Toy()
    if frozen_root:  # LoRA's shape: a root with nothing to train (`frozen.py`)
        for p in (*toy.embed.parameters(), *toy.head.parameters()):
            p.requires_grad_(False)
    return FullyShardedDataParallel(toy, unit_classes=("Block",), mixed_precision=MixedPrecision(param_dtype),
                                    process_group=group)


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(seed))


def loss_of(model, ids) -> torch.Tensor:
    logits = model(ids[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def step(model, seeds, log=None) -> None:
    """One optimizer step's backward passes: every micro-batch but the last under `no_sync`. With a
    `log`, the root's state as each forward ends, ("forward over", state)."""
    for j, seed in enumerate(seeds):
        with model.no_sync() if j < len(seeds) - 1 else nullcontext():
            loss = loss_of(model, batch(seed))
            if log is not None:
                log.append(("forward over", model.root.state))
            loss.backward()


def unit_names(model) -> dict:
    """{unit: "root" or "layer i"}, i counting the layer units in their order."""
    return {unit: "root" if unit is model.root else f"layer {i}" for i, unit in enumerate(model.units)}


def names(model) -> dict:
    """Each unit's name by the id of every buffer it gathers into (the trainable and the frozen flat)."""
    out = {}
    for unit, name in unit_names(model).items():
        out[id(unit._data)] = name
        if unit.frozen is not None:
            out[id(unit.frozen.full)] = name
    return out


class Logged:
    """A collective's handle that notes when it is waited for."""

    def __init__(self, handle, log, entry):
        self.handle, self.log, self.entry = handle, log, entry

    def wait(self):
        self.log.append(("wait", *self.entry))
        return self.handle.wait() if self.handle is not None else True


@contextmanager
def gathers_logged(model, log):
    """Note every all-gather a unit launches, ("gather", unit), and its wait, ("wait", "gather", unit)."""
    from minidist.parallel import comm

    real, by_buffer = comm.all_gather, names(model)

    def all_gather(output, shard, group=None, async_op=False):
        entry = ("gather", by_buffer[id(output)])
        log.append(entry)
        return Logged(real(output, shard, group=group, async_op=async_op), log, entry)

    comm.all_gather = all_gather
    try:
        yield
    finally:
        comm.all_gather = real


def root_once_per_micro_batch(frozen_root: bool, accumulation: int = 2) -> dict:
    """One fp32 step of `accumulation` micro-batches on 2 ranks: the gathers and their waits in order,
    the root's state as each forward ends and as the last layer's backward ends, the bytes counted, the
    root's state after a forward without grad, and the elements each unit gathers and reduces."""
    from minidist.parallel import comm
    from minidist.parallel.fsdp import Unit

    log, seen = [], {}
    real_post_backward = Unit._post_backward

    def noting(unit, full):  # is the root still gathered when the last layer's backward is over?
        if unit is seen["model"].layer_units[-1]:
            log.append(("last layer's backward over", seen["model"].root.state))
        real_post_backward(unit, full)

    Unit._post_backward = noting  # before wrapping: the units' hooks bind it then
    try:
        model = seen["model"] = wrap(frozen_root=frozen_root)
    finally:
        Unit._post_backward = real_post_backward
    comm.counter.reset()
    with gathers_logged(model, log):
        step(model, [10 * dist.get_rank() + j for j in range(accumulation)], log)
        sent = comm.counter.take()
        after_step = [u.state for u in model.units]
        log.append(("step over",))  # then a forward without grad
        with torch.no_grad():
            loss_of(model, batch(0))
    # The padded elements each unit gathers (trainable and frozen flats) and reduce-scatters (trainable).
    sizes = {name: (u.layout.padded_numel + (u.frozen.layout.padded_numel if u.frozen else 0), u.layout.padded_numel)
             for u, name in unit_names(model).items()}
    return {"log": log, "bytes": sent, "after_no_grad": model.root.state, "after_step": after_step, "sizes": sizes,
            "max_unsharded": model.max_unsharded}


def accumulates_in_fp32(micro_batches: int = 3) -> dict:
    """bf16 weights, on a process group of this rank alone (so nothing else is summed in): each
    micro-batch's own gradient (one synchronised backward each, from the same weights), and the
    gradient the same micro-batches accumulate under no_sync. Per unit, fp32 shards."""
    group = dist.new_group([dist.get_rank()])
    for other in range(dist.get_world_size()):  # every rank takes part in making every group
        if other != dist.get_rank():
            dist.new_group([other])
    model = wrap(torch.bfloat16, group=group)
    seeds = [100 + j for j in range(micro_batches)]
    each = []
    for seed in seeds:
        step(model, [seed])
        each.append([u.flat_param.grad.clone() for u in model.units])
        for u in model.units:
            u.flat_param.grad = None
    kept = []
    for seed in seeds[:-1]:
        with model.no_sync():
            loss_of(model, batch(seed)).backward()
        kept.append([(getattr(getattr(u, "accumulated", None), "dtype", None), u.full.grad is None) for u in model.units])
    loss_of(model, batch(seeds[-1])).backward()
    accumulated = [u.flat_param.grad.clone() for u in model.units]
    return {"each": each, "accumulated": accumulated, "kept": kept,
            "dtypes": [u.full.dtype for u in model.units]}


class FakeStreams:
    """A stand-in for `torch.cuda` that makes no stream but records what would be queued on which:
    each stream's `wait_stream`, `record_event` and `wait_event`, in one log shared with the test's
    other notes. The compute stream is the one current outside any `stream(...)` context."""

    def __init__(self, log):
        self.log, self.made = log, 0
        self.compute = self.current = FakeStream(self, "compute")

    def Stream(self, device=None, priority=0):  # torch.cuda's name
        self.made += 1
        return FakeStream(self, f"side {self.made}")

    def current_stream(self, device=None):
        return self.current

    @contextmanager
    def stream(self, stream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before


class FakeStream:
    def __init__(self, streams, name):
        self.streams, self.name, self.events = streams, name, 0

    def wait_stream(self, other):
        self.streams.log.append(("wait_stream", self.name, other.name))

    def record_event(self):
        self.events += 1
        event = f"{self.name} event {self.events}"
        self.streams.log.append(("record_event", self.name, event))
        return event

    def wait_event(self, event):
        self.streams.log.append(("wait_event", self.name, event))


def on_fake_streams(accumulation: int = 2) -> dict:
    """One fp32 step on 2 ranks with FSDP's side streams made by `FakeStreams`: the log of every
    collective (with the stream current when it ran, and its unit), every stream call, every use of
    a unit's gathered weights (`use_views`) and every reduced shard added into a gradient
    (`accumulate`), each with the stream current then."""
    from minidist.parallel import comm, streams
    from minidist.parallel.fsdp import Unit

    log, backward_of = [], []
    fake = FakeStreams(log)
    real = comm.all_gather, comm.reduce_scatter, Unit.use_views, Unit.accumulate, Unit._post_backward

    def post_backward(unit, full):  # the reduce-scatter it launches is this unit's
        backward_of.append(unit)
        return real[4](unit, full)

    Unit._post_backward = post_backward  # before wrapping: the units' hooks bind it then
    try:
        model = wrap()
    finally:
        Unit._post_backward = real[4]
    model.all_gather_stream = streams.SideStream(torch.device("cpu"), streams=fake)
    model.reduce_scatter_stream = streams.SideStream(torch.device("cpu"), streams=fake)
    by_buffer, name = names(model), unit_names(model)

    def all_gather(output, shard, group=None, async_op=False):
        log.append(("all_gather", fake.current.name, by_buffer[id(output)]))
        return real[0](output, shard, group=group, async_op=async_op)

    def reduce_scatter(output, input, group=None, async_op=False, input_is_scratch=False):
        log.append(("reduce_scatter", fake.current.name, name[backward_of[-1]]))
        return real[1](output, input, group=group, async_op=async_op, input_is_scratch=input_is_scratch)

    def use_views(unit):
        log.append(("use", fake.current.name, name[unit]))
        return real[2](unit)

    def accumulate(unit, out):
        log.append(("accumulate", fake.current.name, name[unit]))
        return real[3](unit, out)

    comm.all_gather, comm.reduce_scatter, Unit.use_views, Unit.accumulate = all_gather, reduce_scatter, use_views, accumulate
    try:
        step(model, [dist.get_rank() + 10 * j for j in range(accumulation)])
    finally:
        comm.all_gather, comm.reduce_scatter, Unit.use_views, Unit.accumulate = real[:4]
    return {"log": log, "layers": [n for u, n in name.items() if u is not model.root]}
