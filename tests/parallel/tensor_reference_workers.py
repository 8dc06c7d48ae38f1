"""Worker functions for tests/parallel/test_tensor_reference.py, run in each rank by `launch`.

Every rank holds three copies of the same tiny Llama (`tensor_workers.tiny_llama`, float64): the
whole model, the hand-written tensor-parallel one (`llama.parallelize_llama`) and PyTorch's
(`reference.parallelize_llama_torch`), and trains each on the same batch."""

import contextlib
import copy

import tensor_workers
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from minidist.parallel.tensor import llama, reference
from minidist.runtime.distributed import device_mesh


def torch_loss_sum(model, b):
    """The summed next-token loss of PyTorch's tensor-parallel model on batch `b`. Call it, and the
    backward of what it returns, inside `reference.loss_parallel()`, as the loop would."""
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
    return reference.token_loss_sum(logits, b["labels"])


def _train(models: dict, b, steps: int) -> dict:
    """`steps` AdamW steps of each model on batch `b`; the losses of each, by name."""
    optimizers = {key: torch.optim.AdamW(m.parameters(), lr=1e-2) for key, m in models.items()}
    losses = {key: [] for key in models}
    for _ in range(steps):
        for key, model in models.items():
            with reference.loss_parallel() if key == "torch" else contextlib.nullcontext():
                loss = (torch_loss_sum(model, b) if key == "torch"
                        else tensor_workers.loss_sum(model, b, dist.group.WORLD if key == "hand" else None))
                loss.backward()
            optimizers[key].step()
            optimizers[key].zero_grad()
            losses[key].append(loss.item())
    return losses


def parity(sequence_parallel: bool, steps: int = 3, tie: bool = False) -> dict:
    """The losses of the whole model, the hand-written and PyTorch's tensor-parallel copies over
    `steps` AdamW steps on one batch, and the largest relative difference between each of
    PyTorch's parameters (gathered whole: `full_tensor`) and the whole model's after them."""
    whole = tensor_workers.tiny_llama(tie=tie)
    hand, torch_tp = copy.deepcopy(whole), copy.deepcopy(whole)
    llama.parallelize_llama(hand, dist.group.WORLD, sequence_parallel)
    said = reference.parallelize_llama_torch(torch_tp, device_mesh(), sequence_parallel)
    b = tensor_workers.batch(whole.config.vocab_size)
    losses = _train({"whole": whole, "hand": hand, "torch": torch_tp}, b, steps)
    expected = dict(whole.named_parameters(remove_duplicate=False))  # a tied head under both names
    worst = {}
    for name, param in torch_tp.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        worst[name] = ((full - expected[name]).abs().max() / expected[name].abs().max()).item()
    local = {name: tuple(p.to_local().shape) for name, p in torch_tp.named_parameters() if isinstance(p, DTensor)}
    return {"losses": losses, "worst": worst, "said": said, "local_shapes": local}


def _counts(mode: CommDebugMode) -> dict:
    """{"all_reduce": 3, ...}: the collectives DTensor ran under `mode`, by short name."""
    return {str(op).rpartition(".")[2].removesuffix("_into_tensor").removesuffix("_tensor"): n
            for op, n in mode.get_comm_counts().items()}


def run_all(everything: bool = False) -> dict:
    """What the tests ask of one group size, in one launch (each costs seconds of start-up): parity
    with and without sequence parallelism; with `everything`, tied embeddings and the collectives too."""
    results = {"parity": {sp: parity(sp) for sp in (False, True)}}
    if everything:
        results["tied"] = parity(True, steps=2, tie=True)
        results["collectives"] = {sp: collectives(sp) for sp in (False, True)}
    return results


def collectives(sequence_parallel: bool) -> dict:
    """The collectives of one forward, backward and AdamW step of PyTorch's tensor-parallel Llama,
    as DTensor's `CommDebugMode` counts them, and the embedding's gradient after backward."""
    model = tensor_workers.tiny_llama()
    reference.parallelize_llama_torch(model, device_mesh(), sequence_parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    b = tensor_workers.batch(model.config.vocab_size)
    with reference.loss_parallel():
        with CommDebugMode() as forward:
            loss = torch_loss_sum(model, b)
        with CommDebugMode() as backward:
            loss.backward()
    grad = model.model.embed_tokens.weight.grad
    with CommDebugMode() as step:
        optimizer.step()
    return {"forward": _counts(forward), "backward": _counts(backward), "step": _counts(step),
            "embedding_grad": (str(grad.placements[0]), tuple(grad.to_local().shape))}
