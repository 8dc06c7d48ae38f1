"""Worker functions for tests/parallel/test_lora.py, run in each rank by `launch`.

`run_lora_finetunes` trains as `torchrun -m minidist.finetune` would, and also returns, on every
rank, the frozen weights this rank holds at the end: a replicated strategy (DDP, ZeRO) holds them
whole on every rank, and each rank's copy must be the pretrained base, bit for bit. (FSDP's frozen
shards come back through rank 0's gathered `parameters`, every rank's shard in it.)
"""

import torch

from minidist import finetune
from minidist.parallel import strategy as strategies


def run_lora_finetunes(argvs, nccl_like=()):
    """Each run as the training script; those whose index is in `nccl_like` under the NCCL-like
    harness (`tests/nccl_like.py`)."""
    from nccl_like import under

    held = {}
    # Every rank calls full_state_dict once training is over (the final model): hold its model.
    classes = (strategies.Strategy, strategies.ShardedByHand, strategies.TorchFSDP)
    originals = {cls: cls.__dict__["full_state_dict"] for cls in classes}

    def holding(original):
        def full_state_dict(self, model):
            held["model"] = self.unwrap(model)
            return original(self, model)
        return full_state_dict

    for cls in classes:
        cls.full_state_dict = holding(originals[cls])
    results = []
    try:
        for i, argv in enumerate(argvs):
            with under(i in nccl_like) as harness:
                result = finetune.train(finetune.parse_args(argv))
            result["collectives_deferred"] = harness.deferred if harness else 0
            model = held.pop("model")
            result["frozen"] = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()
                                if not p.requires_grad and type(p) is torch.nn.Parameter}  # not FSDP2's DTensors
            results.append(result)
    finally:
        for cls in classes:
            cls.full_state_dict = originals[cls]
    return results
