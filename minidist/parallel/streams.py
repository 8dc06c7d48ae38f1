"""Side streams: where FSDP's collectives run, apart from the compute stream, as FSDP2 runs them.

A GPU runs the work queued on one CUDA stream in order, one item after another; work on two streams
may run at the same time. So the stream a collective is queued on decides what waits for it:

- `async_op=True`: PyTorch's NCCL process group puts every collective of the group on the group's
  one internal stream, and the caller's `wait()` makes its current stream wait for it.
- `async_op=False` inside `with torch.cuda.stream(s)`: since PyTorch PR #150398 (ProcessGroupNCCL,
  2025) a synchronous collective runs on the current stream, `s`. The caller chooses the stream.

PyTorch's FSDP2 (`torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py`, `FSDPCommContext`)
makes high-priority streams of its own, `all_gather_stream` and `reduce_scatter_stream` (and
`all_reduce_stream`, default priority, for HSDP's all-reduce across copies), issues each collective
with `async_op=False` inside its stream (`_fsdp_collectives.py`), records an event there, and makes
the compute stream `wait_event` it before anything reads the result. A `SideStream` is one such
stream, for one kind of collective: `launch(collective, *tensors)` runs it there and returns a handle
whose `wait()` makes the compute stream wait for it. `fsdp.py` keeps one per kind.

**What two streams do not buy on NCCL.** In backward unit i's reduce-scatter is launched (at its
post-backward), then unit i-2's all-gather (the prefetch at unit i-1's pre-backward). On two streams
CUDA no longer orders the gather behind the reduce-scatter, but NCCL does: the collectives of one
communicator always run one after another, in the order they were launched, whatever the stream
(NCCL's `src/enqueue.cc`, `ncclLaunchPrepare` and `ncclLaunchFinish`: every user stream of a launch
waits on the communicator's own `deviceStream`, and it on them, since NCCL 2.13; "NCCL collective
operations on a given communicator are always serialized; NCCL adds CUDA events to enforce that",
NVIDIA/nccl#574, as two collectives would share its buffers). Both kinds run over the same
process group (`fsdp.group`: one communicator), so the gather still waits for the reduce-scatter
before it, and unit i-2's backward for both. FSDP2 has the same limit. A communicator of its own
for the reduce-scatters (a second process group over the same ranks) would lift it, at the risk
NCCL warns of when two communicators' kernels wait on each other across GPUs; minidist does not.
What the streams do give: the compute stream waits for a collective only where it reads the result
(the event), and the code has FSDP2's shape, memory rule included.

**Memory across streams (the lesson).** PyTorch's CUDA caching allocator hands a freed block to the
next allocation *on the stream that allocated it*, without waiting for other streams. A tensor that
a side stream still reads or writes, freed on the compute stream, can be handed out again and
overwritten while the collective runs: silent corruption. The rule this module follows:
1. allocate every tensor a side stream uses on the compute stream, outside the side stream's
   context (the unit's gather buffer, the bf16 copy it sends, the reduce-scatter's input and output:
   the caller makes them before `launch`);
2. make the side stream wait for the compute stream before the collective (`wait_stream`): what the
   compute stream wrote into those tensors (the cast, the gradient) is done before it is sent;
3. keep a Python reference to every input and output until the compute stream has waited for the
   side stream's event (the handle holds `tensors` until `wait()`). Freed after that, on the compute
   stream, a block is only reused by work queued after the collective: safe, with no
   `record_stream` (which would delay the reuse to the allocator's next look at the side stream).

**On a CPU there are no streams.** With gloo (and no `torch.cuda` stream to make) `launch` calls the
collective with `async_op=True`: gloo's worker thread runs it while the caller goes on, and the
handle's `wait()` blocks until it is over, which is today's overlap on CPU. The same FSDP code runs
on both; a test replaces `torch.cuda` with a fake (`streams=`) that records every `wait_stream`,
`record_event` and `wait_event`, so that the CUDA path's order is checked on a CPU too.
"""

import torch

HIGH_PRIORITY = -1  # FSDP2's: its copy-ins and copy-outs are not delayed behind compute kernels


class SideStream:
    """A stream for one kind of collective (all-gathers, reduce-scatters), or gloo's thread on a CPU.

    `streams`: the module that makes streams and events, `torch.cuda` on a CUDA device; None (a CPU)
    for none. A test passes a fake with the same names (`Stream`, `current_stream`, `stream`, and
    the streams' `wait_stream`, `record_event`, `wait_event`)."""

    def __init__(self, device: torch.device, priority: int = HIGH_PRIORITY, streams=None):
        self.device = device
        self.streams = streams if streams is not None else (torch.cuda if device.type == "cuda" else None)
        self.stream = None if self.streams is None else self.streams.Stream(device=device, priority=priority)

    def launch(self, collective, *tensors):
        """Run `collective(async_op)` on this stream; return a handle to `wait()` on before its result
        is read. `tensors`: every input and output of the collective, allocated by the caller on the
        compute stream, kept alive by the handle until the compute stream has waited for it."""
        if self.stream is None:  # a CPU: gloo's thread runs it; its handle's wait() blocks until done
            return collective(async_op=True)
        compute = self.streams.current_stream(self.device)
        self.stream.wait_stream(compute)  # what the compute stream wrote into the inputs comes first
        with self.streams.stream(self.stream):
            collective(async_op=False)  # runs on this stream (PyTorch PR #150398)
            done = self.stream.record_event()
        return Pending(self.streams, self.device, done, tensors)


class Pending:
    """A collective queued on a side stream: `wait()` makes the compute stream wait for its event,
    then lets go of its tensors (from then on, freeing them on the compute stream is safe)."""

    def __init__(self, streams, device: torch.device, event, tensors: tuple):
        self.streams, self.device, self.event, self.tensors = streams, device, event, tensors

    def wait(self) -> bool:
        if self.event is not None:
            self.streams.current_stream(self.device).wait_event(self.event)  # the GPU waits; the CPU goes on
            self.event = self.tensors = None
        return True
