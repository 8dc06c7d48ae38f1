"""Exercise 03: gradient accumulation, one all-reduce per step (lesson 03, `lessons/03_accumulation.md`).

Fill in `train_step` below, then check it from the repository root:

    MINIDIST_EXERCISE=lessons/exercises/03_accumulation.py python -m pytest -q tests/course/test_exercises.py

This is the training loop's own `train_step` (`minidist/finetune.py`), the one that trains the
7B model. The check runs yours on 2 gloo ranks, each with 3 micro-batches of 2 sequences of
different lengths (padding labelled -100), through minidist's bucketed DDP strategy, and
compares every gradient with a single process on the whole global batch. It also counts the
bytes sent (one all-reduce of the gradients per step, whatever the number of micro-batches) and
the backward passes (one per micro-batch). minidist's own answer is `step.train_step`: read
it after.
"""

from contextlib import nullcontext  # noqa: F401 (you may want it)

from minidist.step import token_loss_sum

EXERCISE = "03_accumulation"  # tells the check which exercise this file answers


def train_step(model, strategy, micro_batches, num_targets: int, world_size: int):
    """Forward and backward over this rank's micro-batches of one optimizer step; return the
    sum of their token losses.

    - `model`: the wrapped model (here minidist's `BucketedDDP`), which all-reduces and
      *averages* the gradients over the ranks in the backward of every micro-batch, unless that
      backward runs inside `strategy.no_sync(model)`.
    - `micro_batches`: this rank's micro-batches, dicts of `input_ids`, `attention_mask`,
      `labels` (padding labelled -100). `token_loss_sum(model, batch, strategy)` returns a
      micro-batch's *summed* next-token cross-entropy (not the mean).
    - `num_targets`: how many target tokens the whole global batch holds, over every rank and
      micro-batch. `world_size`: the number of ranks.

    What the gradients must be, once the last backward is over: the gradient of the mean token
    loss of the whole global batch, on every rank, exactly as one process would compute it.

    Hints:
    - Normalise by the global batch: each token's loss must weigh 1/num_targets. The mean per
      micro-batch (and then the mean of those) weighs a token of a short micro-batch more.
    - The wrapper averages over ranks, dividing by world_size: scale each loss so that the
      average of the ranks' gradients is the global batch's: `loss * world_size / num_targets`.
    - Communicate once per step: every micro-batch but the last runs forward and backward
      inside `with strategy.no_sync(model):`; the last one's backward all-reduces the sum.
    - One backward per micro-batch (each frees that micro-batch's activations): summing the
      losses and calling backward once would keep every micro-batch's activations alive at once.
    - Return the sum of the unscaled summed losses, detached (the loop logs it as the loss).
    """
    raise NotImplementedError("train_step is yours to write (its docstring says how)")
