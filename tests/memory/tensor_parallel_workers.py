"""Workers for tests/memory/test_tensor_parallel_memory.py, run in each rank by `launch`: one
training step of the tiny Llama of tests/parallel/test_tensor.py, cut over every rank, measured
as the estimator is held to account (the whole step's peak of live tensors), and what each of its
decoder layers saves for backward."""

import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from minidist import finetune
from minidist import step as loop_step
from minidist.memory import measure, trace
from minidist.strategy.options import ADAMW_OPTIONS
from minidist.parallel.tensor import llama, vocab

sys.path.insert(0, str(Path(__file__).parent.parent / "parallel"))  # the tensor tests' model and batch
import tensor_workers  # after the line above: it finds it

SIZES = {"hidden_size": 128, "num_layers": 4}  # 8 heads, 4 key/value heads, MLP 336: activations dominate
BATCH, SEQ = 4, 128


def tiny_model(vocab_multiple: int = 1):
    """The fp32 tiny Llama of tests/parallel/tensor_workers.py; with `vocab_multiple`, its vocabulary grown to a multiple of it, as
    Hugging Face's `resize_token_embeddings(pad_to_multiple_of=...)` does: the cut then needs no
    padding."""
    model = tensor_workers.tiny_llama(**SIZES).float()
    if vocab_multiple > 1:
        model.resize_token_embeddings(pad_to_multiple_of=vocab_multiple, mean_resizing=False)
    return model


def model_and_batch(sequence_parallel: bool, vocab_multiple: int = 1):
    """The tiny Llama cut over every rank (whole on one), and a batch of full sequences."""
    model = tiny_model(vocab_multiple)
    group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None  # None: one process
    if group is not None:
        llama.parallelize_llama(model, group, sequence_parallel)
    b = tensor_workers.batch(model.config.vocab_size, lengths=(SEQ,) * BATCH)
    return model, b, group


class LoopLoss:
    """What the loop's loss (`step.token_loss_sum`) asks of a strategy, for a bare step: fp32, so
    no autocast; under tensor parallelism the loss from the vocabulary's slices, as
    `Strategy.cross_entropy_sum` computes it. The loop's own code, so that the logits live as long
    as they do in the loop."""

    def __init__(self, model, group):
        self.model, self.group = model, group

    def autocast(self):
        return nullcontext()

    def cross_entropy_sum(self, logits, targets):
        if self.group is None:
            return loop_step.cross_entropy_sum(logits, targets)
        return vocab.vocab_parallel_cross_entropy(logits, targets, self.model.lm_head.start,
                                                  self.model.config.vocab_size, self.group).sum()


def loss_sum(model, b, group):
    return loop_step.token_loss_sum(model, b, LoopLoss(model, group))


def saved_by_layer(model, b, group) -> dict:
    """What forward and the loss save for backward, by decoder layer and the norms' part of it (each
    storage once), from a forward whose graph is then let go."""
    with trace.SavedByLayer(model) as seen:
        loss = loss_sum(model, b, group)
    del loss
    result = seen.result()
    return {"layers": result.layers, "layer_norms": result.layer_norms, "outside": result.outside,
            "outside_norms": result.outside_norms, "shared": result.shared}


def step_memory(sequence_parallel: bool = False, vocab_multiple: int = 1) -> dict:
    """The whole step's peak of live tensors on this rank (forward, backward, AdamW's step; the
    second step, once AdamW's states exist), and what each layer saves."""
    model, b, group = model_and_batch(sequence_parallel, vocab_multiple)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **ADAMW_OPTIONS)

    def step():
        loss_sum(model, b, group).backward()
        optimizer.step()

    step()
    optimizer.zero_grad(set_to_none=True)
    peak = measure.step_peak(step, model, optimizer, torch.device("cpu"))
    states = measure.model_state_bytes(model, optimizer)  # after the step, before zero_grad: as the loop reads them
    optimizer.zero_grad(set_to_none=True)
    return {"peak": peak, **states, **saved_by_layer(model, b, group)}


def step_memories(cases: list, loop_argv: list | None = None) -> list:
    """`step_memory` of each case, (sequence_parallel, vocab_multiple), in one launch; then, given
    its arguments, one run of the training loop in the same ranks (it writes its metrics.jsonl)."""
    results = [step_memory(*case) for case in cases]
    if loop_argv:
        finetune.train(finetune.parse_args(loop_argv))
    return results
