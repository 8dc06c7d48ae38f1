"""On a GPU the process group is bound to the rank's device (`distributed.group_device`), so NCCL's
communicator is made inside `init_process_group`, not by the first collective; on the CPU nothing is
passed. `init_process_group` is replaced by one that records what it was given: no GPU is needed."""

import torch
import torch.distributed as dist

from minidist.runtime import distributed


def test_a_gpu_rank_binds_its_group_to_its_device_and_a_cpu_rank_does_not(monkeypatch):
    given = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: given.append(kwargs))
    where = {"rank": 0, "world_size": 1, "master_addr": "127.0.0.1"}
    for device in (torch.device("cuda", 1), torch.device("cpu")):
        distributed._rendezvous("nccl" if device.type == "cuda" else "gloo", "env://", where, 29500, 60, 30, device)
    assert given[0]["device_id"] == torch.device("cuda", 1)
    assert "device_id" not in given[1]
