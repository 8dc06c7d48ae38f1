"""Worker for tests/parallel/test_tensor_bytes.py, run in each rank by `launch`: the bytes
`comm.counter` counts for one step (forward and backward of each micro-batch) of the float64 tiny
Llama of `tensor_workers`, cut over every rank."""

import tensor_workers
import torch
import torch.distributed as dist

from minidist.parallel import comm
from minidist.parallel.tensor import llama


def _model(bias: bool):
    """`tensor_workers.tiny_llama`, or the same with biases in attention and the MLP (under sequence
    parallelism a row-parallel linear's bias passes through f, and its gradient is summed)."""
    model = tensor_workers.tiny_llama()
    if not bias:
        return model
    from transformers import LlamaForCausalLM

    model.config.attention_bias = model.config.mlp_bias = True
    torch.manual_seed(0)
    return LlamaForCausalLM(model.config).double()


def counted(cases: dict) -> dict:
    """For each case (`sequence_parallel`, `bias`, `lengths`: one tuple of sequence lengths per
    micro-batch), the bytes this rank counted for the step, the micro-batches' (b, s) as the model
    saw them, and the model's config."""
    group = dist.group.WORLD
    results = {}
    for name, case in cases.items():
        model = _model(case.get("bias", False))
        llama.parallelize_llama(model, group, case["sequence_parallel"])
        model.train()  # a training step's traffic: the formula's
        batches = [tensor_workers.batch(model.config.vocab_size, lengths) for lengths in case["lengths"]]
        comm.counter.reset()
        for b in batches:
            tensor_workers.loss_sum(model, b, group).backward()
        results[name] = {"bytes": comm.counter.take(), "shapes": [tuple(b["input_ids"].shape) for b in batches],
                         "config": model.config}
    return results
