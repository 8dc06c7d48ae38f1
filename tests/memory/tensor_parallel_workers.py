"""Workers for tests/memory/test_tensor_parallel_memory.py, run in each rank by `launch`: one
training step of the tiny Llama of tests/parallel/test_tensor.py, cut over every rank, measured
as the estimator is held to account (the whole step's peak of live tensors), and what each of its
decoder layers saves for backward."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from minidist.memory import measure, trace
from minidist.parallel.options import ADAMW_OPTIONS
from minidist.parallel.tensor import llama

sys.path.insert(0, str(Path(__file__).parent.parent / "parallel"))  # the tensor tests' model and batch
import tensor_workers  # after the line above: it finds it

SIZES = {"hidden_size": 128, "num_layers": 4}  # 8 heads, 4 key/value heads, MLP 336: activations dominate
BATCH, SEQ = 4, 128


def tiny_model(vocab_multiple: int = 1):
    """The fp32 tiny Llama; with `vocab_multiple`, its vocabulary grown to a multiple of it, as
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


def saved_by_layer(model, b, group) -> dict:
    """What forward and the loss save for backward, by decoder layer and the norms' part of it (each
    storage once), from a forward whose graph is then let go."""
    with trace.SavedByLayer(model) as seen:
        loss = tensor_workers.loss_sum(model, b, group)
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
        tensor_workers.loss_sum(model, b, group).backward()
        optimizer.step()

    step()
    optimizer.zero_grad(set_to_none=True)
    peak = measure.step_peak(step, model, optimizer, torch.device("cpu"))
    states = measure.model_state_bytes(model, optimizer)  # after the step, before zero_grad: as the loop reads them
    optimizer.zero_grad(set_to_none=True)
    return {"peak": peak, **states, **saved_by_layer(model, b, group)}


def step_memories(cases: list) -> list:
    """`step_memory` of each case, (sequence_parallel, vocab_multiple), in one launch."""
    return [step_memory(*case) for case in cases]
