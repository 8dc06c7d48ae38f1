"""Worker for tests/parallel/test_loading.py, run in each rank by `launch`: load a model through a
strategy's `load_model` and `wrap`, counting (and on rank 0 optionally slowing) every weights file read."""

import time
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist

from minidist.runtime.distributed import get_env


def load_and_report(model_dir, impl, strategy_name, slow_s=0.0):
    """`strategy.wrap(strategy.load_model(model_dir))` on this rank, with every safetensors file
    that transformers opens counted, and rank 0's reads each slowed by `slow_s` seconds (a 7B model
    on a network filesystem, in miniature). Returns what the test checks: the files read, the whole
    weights gathered on rank 0 (`full_state_dict`), this rank's buffers, whether the output layer
    is still the embedding (PyTorch's FSDP2, where the parameters stay attributes), and the logits
    of a fixed sequence."""
    import transformers.modeling_utils as hf_modeling  # before the first collective: see below
    from minidist.strategy.options import ParallelOptions
    from minidist.strategy import get_strategy

    env = get_env()
    reads, real_open = [], hf_modeling.safe_open

    def counting_open(path, *args, **kwargs):
        reads.append(str(path))
        if env.rank == 0:
            time.sleep(slow_s)
        return real_open(path, *args, **kwargs)

    name, *offload = strategy_name.split("+")  # "fsdp+offload": with --cpu_offload
    strategy = get_strategy(ParallelOptions(name, impl, cpu_offload=bool(offload)), env)
    _ = strategy.mesh  # its process groups, made by every rank before the clock starts
    # The ranks imported transformers at different speeds; under the test's short process-group
    # timeout they start together here, on a barrier with a timeout of its own (gloo only).
    dist.monitored_barrier(timeout=timedelta(minutes=5))
    with mock.patch.object(hf_modeling, "safe_open", counting_open):
        model = strategy.wrap(strategy.load_model(model_dir))
    inner = strategy.unwrap(model)
    tied = None
    if impl == "torch":
        tied = inner.get_output_embeddings().weight is inner.get_input_embeddings().weight
    buffers = {name: b.detach().cpu().clone() for name, b in inner.named_buffers()}
    with torch.no_grad():
        logits = model(torch.arange(1, 17).unsqueeze(0)).logits.cpu()
    return {"reads": reads, "full": strategy.full_state_dict(model), "buffers": buffers, "tied": tied,
            "logits": logits}
