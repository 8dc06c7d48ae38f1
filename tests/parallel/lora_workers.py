"""Worker functions for tests/parallel/test_lora.py, run in each rank by `launch`.

`run_lora_finetunes` trains as `torchrun -m minidist.finetune` would, and also returns, on every
rank, the frozen weights this rank holds at the end: a replicated strategy (DDP, ZeRO) holds them
whole on every rank, and each rank's copy must be the pretrained base, bit for bit. (FSDP's frozen
shards come back through rank 0's gathered `parameters`, every rank's shard in it.)
"""

import shutil

import torch

from minidist import finetune
from minidist import strategy as strategies


def run_lora_finetunes(argvs, nccl_like=()):
    """Each run as the training script; those whose index is in `nccl_like` under the NCCL-like
    harness (`tests/nccl_like.py`)."""
    from nccl_like import under

    held = {}
    # Every rank calls full_state_dict once training is over (the final model): hold its model.
    classes = (strategies.Strategy,)  # where every strategy's full_state_dict is defined
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


def everything(argvs, nccl_like, peaks, full, resumes, stopped):
    """All of test_lora.py's runs of one world size, one after the other in the same ranks: one
    start-up for all of them. Each run seeds itself (`--seed`) and writes its own folder; the
    NCCL-like harness and the held `full_state_dict` are put back after their runs.

    - `peaks`: runs whose metrics trace each step's peak (`memory_workers.train_each`), first, as
      when they had ranks of their own (their peak counts only what the model and optimizer reach
      and what the step allocates, not what earlier runs left);
    - `run_lora_finetunes(argvs, nccl_like)`;
    - `full`: runs uninterrupted; then each of `resumes`, (checkpoint, copy, argv), resumed from a
      copy of its checkpoint (rank 0 copies it between two barriers: after every rank wrote it,
      before any rank reads the copy);
    - `stopped`: more runs (the references and resumes of runs stopped by SIGTERM).
    """
    import torch.distributed as dist
    from memory_workers import train_each
    from train_workers import run_finetunes

    from minidist.runtime.distributed import get_env

    train_each(peaks)
    lora = run_lora_finetunes(argvs, nccl_like)
    whole = run_finetunes(full)
    dist.barrier()
    if get_env().rank == 0:
        for checkpoint, copy, _ in resumes:
            shutil.copytree(checkpoint, copy)
    dist.barrier()
    resumed = run_finetunes([argv for *_, argv in resumes])
    return {"lora": lora, "full": whole, "resumed": resumed, "stopped": run_finetunes(stopped)}
