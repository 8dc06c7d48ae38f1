"""An axis: one way of cutting the model besides data parallelism, applied by the strategy in order.

A run is one data-parallel choice (`data.py`) plus zero or more axes (`tensor.py`, `pipeline.py`).
Each axis is built with the run's options and mesh, cuts the model once (`cut`, before the
data-parallel wrapper goes around it), keeps what it learned there, and answers the few questions
through which a cut shows in the rest of a run. `Axis` answers each of them as an axis that changes
nothing there would: an axis overrides only where its cut shows.

A new axis (context parallelism, experts) is its mechanisms in `parallel/<axis>/`, one subclass
here, and one checkpoint link in `state/` (`form`); the strategy lists it in `axes`.
"""

from contextlib import nullcontext


class Axis:
    name = ""
    holds_parts = False  # True: its ranks hold different parts of the model (a pipeline's stages)
    form = None  # its link in the checkpoint chain (`state/__init__.py`), or None: nothing to join or note

    def __init__(self, options, env, mesh):
        self.options, self.env, self.mesh = options, env, mesh

    def describe(self) -> str:
        """The run's first log line's words for this cut (" x tensor-parallel 2")."""
        return ""

    def say(self, line: str) -> None:
        if self.env.is_main:
            print(line)

    @staticmethod
    def check_model(options, meta_model) -> None:
        """Raise ValueError, in one sentence, if `meta_model` (built on the meta device: shapes, no
        memory) cannot be cut this way with `options`, before anything is loaded: from the options
        alone, before the process groups exist (a model that cannot be cut is told first)."""

    def check_packing(self, varlen: bool) -> None:
        """Raise ValueError, in one sentence, if this cut cannot take `--pack`'s micro-batches: rows
        with a block-diagonal mask, or (`varlen`) flash-attention's rows flattened into one."""

    def cut(self, model, strategy=None):
        """This rank's part of `model`, cut in place or new."""
        return model

    sequence_multiple = 1  # batches are padded to a multiple of this many tokens
    alike_copies = 1  # how many ranks of `norm_groups` hold a parameter that `alike` names

    cross_entropy_sum = None  # an axis that holds the logits cut computes the loss from the pieces

    def loss_context(self):
        """The context a micro-batch's forward, loss and backward run in."""
        return nullcontext()

    def norm_groups(self) -> list:
        """The groups over which the squares of a clipped gradient add up: their ranks hold different pieces."""
        return []

    def alike(self, name: str, grad=None) -> bool:
        """Whether every rank of `norm_groups` holds parameter `name` alike (then counted once, not per rank)."""
        return False

    def join_weights(self, weights: dict | None) -> dict | None:
        """The whole model's weights from this axis's pieces (`weights` on the ranks that hold a
        piece whole over the data-parallel ranks, None elsewhere); None where they are not kept."""
        return weights
