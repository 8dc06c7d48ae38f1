"""The tensor axis (`--tp_size T`, lesson 11): where cutting each layer's matrices over T ranks
shows in a run, and nothing else.

The mechanism is `parallel/tensor/`: `llama.py` cuts a Hugging Face Llama in place (by hand), and
`reference.py` is PyTorch's own `parallelize_module` on the same model. A run applies it to the
loaded model before the data-parallel wrapper goes around it (`Strategy.wrap`), over the mesh's
tensor-parallel group, and then the cut shows in five places, each a method here:

1. **The model** must be cuttable: heads, key/value heads, the MLP (`check_model`).
2. **The batch** is padded to a multiple of T tokens under sequence parallelism, which cuts the
   sequence into T chunks (`sequence_multiple`).
3. **The loss** comes from the vocabulary's slices (`tensor/vocab.py`: each rank holds a slice of
   the logits, and no rank gathers them), the same on every tensor-parallel rank.
4. **Clipping** sums the squares of the slices over the group, and counts the parameters every
   rank holds alike (the norms) once (`clip.py`).
5. **The whole model** is the slices joined (`join_weights`: the final model), and a checkpoint's
   link of the chain (`form`: `state/tensor.py`).
"""

import torch
import torch.nn.functional as F

from minidist.strategy.axis import Axis
from minidist.strategy.state.tensor import TensorParallelForm, whole_weights


class _Tensor(Axis):
    """What both cuts share: the tensor-parallel group, the padding for sequence parallelism, the
    model's check, and clipping's group, over which the copied parameters would count T times."""

    name = "tensor"

    def __init__(self, options, env, mesh):
        super().__init__(options, env, mesh)
        self.size, self.group = mesh.tp_size, mesh.tp_group

    def describe(self) -> str:
        return f" x tensor-parallel {self.size}{' + SP' if self.options.sequence_parallel else ''}"

    @staticmethod
    def check_model(options, meta_model) -> None:
        from minidist.parallel.tensor.llama import check_splittable

        check_splittable(meta_model, options.tp_size)

    @property
    def sequence_multiple(self) -> int:
        return self.size if self.options.sequence_parallel else 1

    def norm_groups(self) -> list:
        return [self.group]

    @property
    def alike_copies(self) -> int:
        return self.size


class TensorAxis(_Tensor):
    """The hand-written cut (`tensor/llama.py`). What it learns when it cuts (`split`: the sliced
    parameters, with their dimension; `vocabulary`: this rank's first token id and the real
    vocabulary size) it keeps, for the loss, clipping and saving."""

    def __init__(self, options, env, mesh):
        super().__init__(options, env, mesh)
        self.split: dict = {}  # parameter name -> (dim, real size or None), filled by `cut`
        self.vocabulary: tuple[int, int] | None = None
        self.form = TensorParallelForm(self.split)  # the same dict: filled in place by `cut`

    def cut(self, model, strategy=None):
        from minidist.parallel.tensor.llama import parallelize_llama, split_parameters

        for line in parallelize_llama(model, self.group, self.options.sequence_parallel):
            self.say(line)
        self.split.update(split_parameters(model))  # names of the sliced parameters: saving, clipping
        if hasattr(model, "lm_head"):  # the whole model: the slices are cut before a pipeline's stage
            self.vocabulary = model.lm_head.start, model.lm_head.vocab_size
        return model

    def cross_entropy_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from minidist.parallel.tensor.vocab import vocab_parallel_cross_entropy

        start, vocab_size = self.vocabulary
        return vocab_parallel_cross_entropy(logits, targets, start, vocab_size, self.group).sum()

    def alike(self, name: str, grad=None) -> bool:
        """Every tensor-parallel rank holds this parameter whole (a norm's weight): not cut."""
        return name not in self.split

    def join_weights(self, weights: dict | None) -> dict | None:
        if weights is None:
            return None
        return whole_weights(weights, self.split, self.group)


class TorchTensorAxis(_Tensor):
    """PyTorch's own cut (`tensor/reference.py`): `parallelize_module` on the tensor-parallel
    dimension of the device mesh, then the data-parallel wrapper (FSDP2) on the other, as
    torchtitan composes them. Its weights are DTensors, so the data-parallel form saves and joins
    them as they are: no link of its own in the checkpoint chain."""

    def cut(self, model, strategy=None):
        from minidist.parallel.tensor.reference import parallelize_llama_torch

        for line in parallelize_llama_torch(model, self.mesh.tp_device_mesh(), self.options.sequence_parallel):
            self.say(line)
        if hasattr(model, "lm_head"):  # under a pipeline, the last stage's
            model.lm_head.register_forward_hook(_whole_logits_in_eval)
        return model

    def cross_entropy_sum(self, logits, targets):
        # inside loss_context: PyTorch's loss_parallel takes the DTensor logits cut by vocabulary. The local
        # tensor is a view: under --pp_size it is the output of the stage FSDP2 wraps, which warns of views
        # (an in-place op on one would skip its pre-backward hook), so a copy of it, one number.
        return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum").to_local().clone()

    def loss_context(self):
        from minidist.parallel.tensor.reference import loss_parallel

        return loss_parallel()

    def alike(self, name: str, grad=None) -> bool:
        """A gradient on the data-parallel mesh alone (a norm's weight) is the same on every
        tensor-parallel rank; a cut matrix's lies on the (dp, tp) mesh."""
        mesh = getattr(grad, "device_mesh", None)
        return mesh is None or "tp" not in (mesh.mesh_dim_names or ())


def _whole_logits_in_eval(head, inputs, logits):
    """In eval mode (generation) the whole vocabulary's logits, a plain tensor on every rank, as
    the hand-written head gives them (`tensor/vocab.py`); in training the DTensor stays cut."""
    return logits if head.training else logits.full_tensor()
