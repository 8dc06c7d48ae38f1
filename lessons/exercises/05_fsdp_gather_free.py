"""Exercise 05: FSDP's gather and free (lesson 05, `lessons/05_fsdp.md`).

Fill in `gather` and `free` below, then check them from the repository root:

    MINIDIST_EXERCISE=lessons/exercises/05_fsdp_gather_free.py python -m pytest -q tests/course/test_exercises.py

Everything else is minidist's own `fsdp.Unit` and `FullyShardedDataParallel`
(`minidist/parallel/unit.py` and `fsdp.py`): the hooks that call `gather` before a unit's forward and
backward (and one unit ahead, the prefetch) and `free` after them, `wait`, the reduce-scatter of
the gradients. The check wraps a small network of 3 `Block` units plus the root in FSDP on 2 gloo
ranks, with your `Unit` and with minidist's, trains both for 2 steps and compares the losses,
each unit's gradient shard, the bytes sent, and how much gathered memory is alive: after each
forward none but the root's (it stays gathered for the backward, which starts with it, as in
PyTorch's FSDP2), after each backward none, at any moment at most the root, the running unit and
the next one.
minidist's own answer is `Unit.gather` and `Unit.free`: read them after.
"""

from minidist.parallel import comm, fsdp

EXERCISE = "05_fsdp_gather_free"  # tells the check which exercise this file answers


class Unit(fsdp.Unit):
    """One FSDP unit (a decoder layer, or the root), with its gather and free yours to write.

    What a unit holds:
    - `self.flat_param`: this rank's fp32 shard of the unit's flat parameters (what the optimizer
      steps), `self.layout.shard_numel` elements;
    - `self._data`: the full flat buffer (`self.layout.padded_numel` elements, in the compute
      dtype `self.fsdp.mp.param_dtype`) whose views are the module's weights while gathered. Its
      *storage* is resized to 0 bytes when the unit is sharded: the tensor object and the views
      autograd saved stay, but hold no memory until the next gather refills the same storage;
    - `self.state`: "sharded", "gathering" (an all-gather in flight) or "gathered";
    - `self.handle`: the all-gather's handle while in flight; `self.wait()` (given) waits for it
      and sets the state to "gathered";
    - `self.fsdp._count_unsharded(+1 or -1)`: tell the wrapper that one unit more (or less) is
      unsharded; it keeps the peak in `model.max_unsharded`, which lesson 05 reports.
    """

    def gather(self) -> None:
        """Start the all-gather of this unit's shards into its full buffer; do not wait for it.

        1. Only a sharded unit is gathered: if it is already gathering or gathered (the
           prefetch may have started it), do nothing. A second all-gather would send the unit's
           bytes again.
        2. Give the full buffer its memory back: `self._data.untyped_storage().resize_(nbytes)`,
           with nbytes the padded flat size in bytes (`self._data.element_size()` per element).
        3. What this rank sends: its shard in the compute dtype (`self.flat_param.detach()` cast
           to `self.fsdp.mp.param_dtype`: in bf16 half the bytes). Keep it in `self._send`
           until the collective is done (`wait` lets it go).
        4. Launch `comm.all_gather(self._data, self._send, group=self.fsdp.group,
           async_op=True)`, keep its handle in `self.handle`, set `self.state = "gathering"`,
           and count one more unsharded unit. (minidist's own `gather` launches the same call
           through the wrapper's all-gather stream, `self.fsdp.all_gather_stream.launch`, so that
           on a GPU it does not queue behind a reduce-scatter: `streams.py`. On a CPU that is
           exactly this call.)
        """
        raise NotImplementedError("Unit.gather is yours to write (its docstring says how)")

    def free(self) -> None:
        """Give the gathered weights' memory back; the unit is sharded again.

        A sharded unit has nothing to free. Otherwise: wait for an all-gather still in flight
        first (a prefetched unit may be freed before it ran: freeing memory the collective is
        writing into would be a bug no error message shows), resize the full buffer's storage to
        0 bytes, set the state back to "sharded", and count one unsharded unit less. The usual
        mistake: changing the state but keeping the storage, so that every unit stays gathered
        and FSDP holds the whole model like DDP.
        """
        raise NotImplementedError("Unit.free is yours to write (its docstring says how)")
