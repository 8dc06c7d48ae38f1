"""Divergence: a run whose loss has stopped meaning anything, caught whatever its form.

A learning rate that is too high does not always end in nan. Three forms are seen on the tiny
Llama alone, and each is caught after the step that shows it:

- **Not finite.** The loss or the gradient norm is nan or infinite (`--learning_rate 1e30`: step 1's
  update puts every weight near 1e30, still finite; step 2's loss is nan).
- **Stuck at guessing.** The loss sits at ln(vocabulary size), the loss of the uniform distribution,
  with a gradient norm of 0, for `STUCK_STEPS` steps in a row (`--learning_rate 1e6`: the weights
  saturate every normalisation and softmax, the model outputs the same flat distribution whatever
  it reads, and no gradient flows back; nothing is ever nan, so a run that watched for nan alone would save
  that state as its fine-tuned model). An untrained model starts near ln(vocabulary size) too, but with a gradient.
- **Far above its running level.** After warm-up, a loss more than `SPIKE_FACTOR` times its running
  level, and more than `SPIKE_NATS` above it, where the running level is an exponential moving
  average of the losses before (`LEVEL_WEIGHT` for the newest). A healthy run's loss falls steeply
  from ln(vocabulary size) and then wobbles by some 10-30% from batch to batch (a few chess games
  a step); the average lags above a falling loss, so only a jump to twice the recent level, and by
  a whole nat, counts. During warm-up the rate is still rising and a bump is expected: only the
  first two forms are judged there.

`Watch.see` reads only the loss and gradient norm the loop has already read to the host for its
record: it adds no wait for the device (`runtime/host_syncs.HOST_SYNCS_PER_STEP`). The ranks vote on what
their watches saw in the stop vote (`checkpoint/preemption.py`), and the session then keeps the
last checkpoint saved before the divergence (`checkpoint/session.py`).
"""

import math

STUCK_TOLERANCE = 1e-3  # nats from ln(vocabulary size): the uniform distribution's loss, to float rounding
ZERO_GRADIENT = 1e-6  # a gradient norm below this is nothing flowing back (a healthy step's is 0.1 to 10)
STUCK_STEPS = 3  # steps in a row: one flat step could be chance, three are a model that outputs nothing
SPIKE_FACTOR = 2.0  # a loss above twice its running level...
SPIKE_NATS = 1.0  # ...and a whole nat above it (a low level's noise is not a spike)
LEVEL_WEIGHT = 0.1  # the running level's weight for the newest loss: about the last 10 steps


class Watch:
    """Follows one run's losses and gradient norms, step by step, and says when it has diverged."""

    def __init__(self, vocab_size: int, warmup_steps: int, losses: list[float] = ()):
        self.vocab_size, self.uniform = vocab_size, math.log(vocab_size)
        self.warmup_steps = warmup_steps
        self.level = None  # the running level of the loss (None: no step yet)
        self.stuck_since = None  # the first step of the current run of stuck steps
        for loss in losses:  # a resumed run: the steps before it give the running level back
            self._follow(loss)

    def see(self, step: int, loss: float, grad_norm: float) -> tuple[int, str] | None:
        """After step `step` (counted from 1): None while the run is healthy; else the first step that
        showed the divergence and what was seen, in words. The weights the checkpoint of the step
        before that first one holds are the ones that gave it."""
        for name, value in (("loss", loss), ("gradient norm", grad_norm)):
            if not math.isfinite(value):
                return step, f"the {name} was {value} at step {step}"
        stuck = abs(loss - self.uniform) < STUCK_TOLERANCE and grad_norm < ZERO_GRADIENT
        self.stuck_since = (self.stuck_since or step) if stuck else None
        if stuck and step - self.stuck_since + 1 >= STUCK_STEPS:
            return self.stuck_since, (f"the loss sat at ln(vocabulary size {self.vocab_size}) = {self.uniform:.4f} "
                                      f"with a gradient norm below {ZERO_GRADIENT:g} from step {self.stuck_since} "
                                      f"to step {step}")
        if (step > self.warmup_steps and self.level is not None
                and loss > max(SPIKE_FACTOR * self.level, self.level + SPIKE_NATS)):
            return step, (f"the loss was {loss:.4f} at step {step}, far above its running level {self.level:.4f} "
                          f"(more than {SPIKE_FACTOR:g} times it, and {SPIKE_NATS:g} nat above)")
        self._follow(loss)
        return None

    def _follow(self, loss: float) -> None:
        self.level = loss if self.level is None else (1 - LEVEL_WEIGHT) * self.level + LEVEL_WEIGHT * loss
