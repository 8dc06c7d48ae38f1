"""`--cpu_offload` where a GPU node would punish it, caught on CPU (issue 29, findings 2 to 4).

- **Threads**: torchrun sets OMP_NUM_THREADS=1, so a GPU rank's AdamW on the host ran on one
  thread. `distributed.offload_threads` decides from the environment (SLURM's cores for the task,
  shared by the node's ranks); `use_cores_for_offload` applies it on GPU ranks; the loop calls it.
- **Sharded checkpoints**: `DTensor.from_local` moves a tensor to the mesh's device type, so
  under NCCL (a `cuda` mesh) every save and sharded load put the host's masters and moments on the
  GPU. A CPU run cannot see it on its `cpu` mesh: here the mesh is a `cuda` one (built without a
  process group of its own), and the DTensors must still be views of the host shards.
- **The refresh**: what is copied into the device's compute-dtype weights is already cast on the
  host (bf16: the bytes that cross PCIe) and is sent without blocking. Seen through the copies a
  `TorchDispatchMode` records.
"""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from minidist.runtime import distributed
from minidist.runtime.distributed import DistEnv, cleanup, init_distributed

# The full suite only: a training run with offload through the loop.
pytestmark = pytest.mark.slow

# ------------------------------------------------------------------ threads

TORCHRUN_4 = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("environ,cores,want", [
    # slurm/chess_finetune.sh: one task per node, --cpus-per-task=32, torchrun starts 4 ranks in it
    ({**TORCHRUN_4, "SLURM_CPUS_PER_TASK": "32"}, 32, 8),
    # the task may use fewer cores than the node has, and SLURM says so: its 32, not the 128 visible
    ({**TORCHRUN_4, "SLURM_CPUS_PER_TASK": "32"}, 128, 8),
    # srun with one task per rank (--cpus-per-task=8): no LOCAL_WORLD_SIZE, the task's cores are its own
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_CPUS_PER_TASK": "8"}, 8, 8),
    # torchrun without SLURM: the cores this process may use (taskset, cgroups), shared
    (TORCHRUN_4, 16, 4),
    # an OMP_NUM_THREADS other than torchrun's 1 is someone's choice
    ({**TORCHRUN_4, "OMP_NUM_THREADS": "6", "SLURM_CPUS_PER_TASK": "32"}, 32, 6),
    # never fewer than one, and a plain `python` run takes every usable core
    ({**TORCHRUN_4, "LOCAL_WORLD_SIZE": "8", "SLURM_CPUS_PER_TASK": "4"}, 64, 1),
    ({}, 12, 12),
])
def test_the_offloaded_step_gets_the_cores_slurm_gave_the_task(environ, cores, want):
    threads, source = distributed.offload_threads(environ, cores)
    assert threads == want, source


@pytest.fixture
def threads_put_back():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_gpu_rank_sets_its_threads_and_says_so(monkeypatch, threads_put_back):
    """A GPU rank (no GPU is touched: only its DistEnv says cuda) under torchrun's OMP_NUM_THREADS=1."""
    monkeypatch.setattr(distributed, "usable_cores", lambda: 16)
    torch.set_num_threads(1)
    gpu_rank = DistEnv(1, 4, 1, 4, torch.device("cuda", 1), "nccl")
    line = distributed.use_cores_for_offload(gpu_rank, {**TORCHRUN_4, "SLURM_CPUS_PER_TASK": "12"})
    assert torch.get_num_threads() == 3
    assert line == "--cpu_offload: the optimizer step on 3 CPU threads per rank " \
                   "(SLURM_CPUS_PER_TASK=12 shared by 4 ranks on this node)"
    cpu_rank = DistEnv(0, 1, 0, 1, torch.device("cpu"), "gloo")  # its threads are init_distributed's: left alone
    assert "on 3 CPU threads per rank (CPU ranks)" in distributed.use_cores_for_offload(cpu_rank, {})
    assert torch.get_num_threads() == 3


def test_the_loop_applies_it_at_start(tiny_model, tmp_path, capsys, threads_put_back):
    """The training loop calls it on every rank with --cpu_offload (here a CPU rank: the line only)."""
    from minidist import finetune

    capsys.readouterr()
    finetune.main(["--model", tiny_model, "--output_dir", str(tmp_path), "--impl", "minidist", "--strategy", "zero2",
                   "--cpu_offload", "--max_steps", "1", "--max_seq_length", "32", "--eval_prefixes", "0",
                   "--batch_size_per_device", "2", "--no_save"])
    assert "--cpu_offload: the optimizer step on " in capsys.readouterr().out


# ------------------------------------------------------------------ sharded checkpoints


@pytest.fixture
def world_of_one():
    env = init_distributed()
    yield env
    cleanup()


def offloaded_zero():
    """ZeRO-1 with --cpu_offload in bf16 on a small model, after one step (so AdamW has its moments)."""
    from minidist.parallel.precision import policy
    from minidist.parallel.zero import ShardedOptimizer, ZeroDP

    torch.manual_seed(0)
    model = ZeroDP(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)), 1, policy("bf16"), bucket_cap_mb=0.0005,
                   cpu_offload=True)
    optimizer = ShardedOptimizer(model.buckets, torch.optim.AdamW, process_group=model.group, lr=1e-2)
    model(torch.randn(3, 8, dtype=torch.bfloat16)).float().sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_sharded_checkpoint_leaves_host_shards_on_the_host(world_of_one):
    """The DTensors DCP saves from and loads into are the host shards themselves, on a `cuda` mesh."""
    from types import SimpleNamespace

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from minidist.parallel import flat_state

    model, optimizer = offloaded_zero()
    cuda_mesh = DeviceMesh("cuda", torch.arange(1), _init_backend=False)  # what NCCL ranks save on
    mesh = SimpleNamespace(dp_rank=0, dp_size=1, shard_rank=0, shard_group=model.group, replicate_rank=0,
                           replicate_group=None, tp_size=1, tp_group=None, shard_device_mesh=lambda: cuda_mesh,
                           placements=lambda: (Shard(0),))
    model_sd, optim_sd = flat_state.get_state_dict(model, optimizer, False, world_of_one, mesh)
    pieces = []
    for key, flat in flat_state.keyed_flats(model):
        state = optimizer.state[flat.shard]
        pieces += [(model_sd[key], flat.shard)] + [(optim_sd["flats"][key][m], state[m]) for m in flat_state.MOMENTS]
    assert len(pieces) == 3 * len(model.buckets) > 3
    for dtensor, host in pieces:
        assert isinstance(dtensor, DTensor) and dtensor.device_mesh.device_type == "cuda"
        local = dtensor.to_local()
        assert local.device == host.device and local.data_ptr() == host.data_ptr(), "moved off the host shard"
        assert dtensor.shape == (local.numel(),)
    before = {k: v.to_local().clone() for k, v in model_sd.items()}
    flat_state.set_state_dict(model, optimizer, model_sd, optim_sd, False, world_of_one, mesh)  # a sharded load
    for key, dtensor in model_sd.items():
        assert torch.equal(dtensor.to_local(), before[key])


# ------------------------------------------------------------------ the refresh


class CopiesInto(TorchDispatchMode):
    """Record (source dtype, non_blocking) of every `copy_` whose destination shares `target`'s storage."""

    def __init__(self, target: torch.Tensor):
        super().__init__()
        self.storage, self.copies = target.untyped_storage().data_ptr(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default and args[0].untyped_storage().data_ptr() == self.storage:
            self.copies.append((args[1].dtype, bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))))
        return func(*args, **kwargs)


def test_fsdp_refresh_sends_bf16_cast_on_the_host():
    from minidist.parallel import offload

    master = offload.to_host(torch.randn(1000))
    copy = offload.DeviceCopy(master, torch.device("cpu"), torch.bfloat16)
    with CopiesInto(copy.tensor) as seen:
        sent = copy.get()
    assert seen.copies == [(torch.bfloat16, True)]  # not the fp32 master, converted on the device
    assert torch.equal(sent, master.to(torch.bfloat16))


def test_zero_refresh_sends_bf16_without_blocking(monkeypatch):
    """ZeRO's weights from its host masters: one non-blocking copy of bf16 into the device's shard
    (the all-gather that follows is left out: a world of one would copy locally)."""
    from minidist.parallel import zero

    monkeypatch.setattr(zero.comm, "all_gather", lambda *args, **kwargs: None)
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(6, 5)), nn.Parameter(torch.randn(7))]
    bucket = zero.FlatBucket(params, 1, 0, torch.bfloat16, host=True)
    with torch.no_grad():
        bucket.master.add_(1.0)  # as an optimizer step would
    with CopiesInto(bucket.weights) as seen:
        bucket.refresh_weights(group=None)
    assert seen.copies == [(torch.bfloat16, True)]
    assert torch.equal(bucket.weights[bucket.layout.shard_slice], bucket.master.detach().to(torch.bfloat16))
