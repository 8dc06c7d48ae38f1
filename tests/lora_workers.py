"""Worker functions for tests/test_lora.py, run in each rank by `launch`.

`run_lora_finetunes` trains as `torchrun -m minidist.finetune` would, and also returns, on every
rank, the frozen weights this rank holds at the end: a replicated strategy (DDP, ZeRO) holds them
whole on every rank, and each rank's copy must be the pretrained base, bit for bit. (FSDP's frozen
shards come back through rank 0's gathered `parameters`, every rank's shard in it.)
"""

import torch

from minidist import finetune
from minidist.parallel import strategy as strategies


def run_lora_finetunes(argvs):
    held = {}
    original = strategies.Strategy.unwrap

    def unwrap_and_hold(self, model):  # the loop unwraps the model to save it, once training is over
        held["model"] = original(self, model)
        return held["model"]

    strategies.Strategy.unwrap = unwrap_and_hold
    results = []
    try:
        for argv in argvs:
            result = finetune.train(finetune.parse_args(argv))
            model = held.pop("model", None)  # None: PyTorch's FSDP, which has no wrapper to unwrap
            result["frozen"] = {} if model is None else {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()
                                if not p.requires_grad and not p.is_meta and type(p) is torch.nn.Parameter}
            results.append(result)
    finally:
        strategies.Strategy.unwrap = original
    return results
