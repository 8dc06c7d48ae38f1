"""Exercise 04: ZeRO-2's optimizer step, each rank updating its shard only (lesson 04, `lessons/04_zero.md`).

Fill in `step` below, then check it from the repository root:

    MINIDIST_EXERCISE=lessons/exercises/04_zero2_step.py python -m pytest -q tests/course/test_exercises.py

Everything else is minidist's own (`minidist/parallel/zero.py`): `ZeroDP(model, stage=2)` packs
the parameters into flat buckets (`FlatBucket`) and, during backward, reduce-scatters each full
bucket so that rank r keeps only the averaged gradient of its shard; `ShardedOptimizer.__init__`
builds the inner AdamW (`self.optimizer`) over the buckets' fp32 masters, one shard each. The
check trains a small 5-layer network with ZeRO-2 on 2 gloo ranks for 3 steps, in fp32 and in
bf16, with your `step` and with minidist's, and compares every rank's weights, masters and bytes
sent after each step (in fp32 also with plain AdamW on the averaged gradient, in one process). minidist's own answer is `ShardedOptimizer.step`: read it after.
"""

import torch

from minidist.parallel import comm, zero

EXERCISE = "04_zero2_step"  # tells the check which exercise this file answers


class ShardedOptimizer(zero.ShardedOptimizer):
    """minidist's ZeRO optimizer, with the step yours to write."""

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step of this rank's shard of every bucket, then every rank's weights made whole.

        Each bucket (`self.buckets`, `FlatBucket`s) holds:
        - `bucket.weights`: the flat weights of its parameters, in the compute dtype (fp32 or
          bf16), padded to N equal shards; the model's parameters are views of it;
        - `bucket.layout.shard_slice`: this rank's shard of it (a `slice`);
        - `bucket.master`: the fp32 master weights of that shard (an `nn.Parameter`); in fp32 it
          *is* `bucket.weights[shard_slice]` (a view), in bf16 a separate fp32 tensor;
        - `bucket.own_gradient()`: the averaged gradient of this rank's shard (ZeRO-2 kept it
          after the reduce-scatter), in the compute dtype.
        `self.optimizer` is an AdamW over the masters (all of them, one per bucket).

        What to do:
        1. Give each master the gradient of its shard, in fp32: `bucket.master.grad = ...`.
        2. Step the inner optimizer: only the masters move, each rank's own shard.
        3. For each bucket: drop the master's gradient again (set it to None: it has done its
           work), put the updated master into this rank's shard of `bucket.weights` (in bf16
           that is a copy, rounded; in fp32 it is already there), then all-gather every rank's
           shard into `bucket.weights`: `comm.all_gather(bucket.weights, my_shard.clone(),
           group=self.group)` (a clone: the input must not be a piece of the output).
        4. `closure`: if one is given, call it under `torch.enable_grad()` first and return the
           loss it gives (the `torch.optim` convention); else return None.

        Bytes: the all-gathers send (N-1)/N of every bucket, the second half of DDP's
        all-reduce done on the weights instead of the gradients (lesson 04). The usual
        mistakes, each of which the check names: no all-gather (each rank sees only its own
        shard move, and the ranks drift apart); all-gathering before the step (the weights lag
        one step behind); not copying the master into the weights (invisible in fp32, where the
        master is a view, and the weights never move in bf16).
        """
        raise NotImplementedError("ShardedOptimizer.step is yours to write (its docstring says how)")
