"""minidist.runtime.distributed and minidist.runtime.launch: process groups from the environment, N CPU
ranks from Python, results back by rank, and failures that surface fast and leave no process."""

import multiprocessing as mp
import os
import time

import pytest
import torch
import torch.distributed as dist

import workers  # tests/ is on sys.path (pytest's rootdir insertion); the ranks import it too
from minidist.runtime import distributed
from minidist.runtime.distributed import DistEnv, cleanup, get_env, init_distributed, read_launch_env
from minidist.runtime.launch import RankFailed, launch

# The full suite only: the launcher's failures, each in a launch of its own.
pytestmark = pytest.mark.slow

LAUNCH_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]


def assert_all_gone(pid_dir):
    """Nothing launch() started may survive it: no live child, no pid still running."""
    assert mp.active_children() == []
    for name in os.listdir(pid_dir):
        with pytest.raises(ProcessLookupError):
            os.kill(int(name.split(".")[0]), 0)


# ---- launch: results ------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_results_come_back_by_rank(world_size, tmp_path):
    results = launch(workers.rank_info, world_size, pid_dir=str(tmp_path))
    assert [r["rank"] for r in results] == list(range(world_size))
    expected_sum = world_size * (world_size + 1) / 2
    for r in results:
        assert r["world_size"] == world_size and r["local_rank"] == r["rank"]
        assert r["backend"] == "gloo" and r["device"] == "cpu"
        assert r["sum"] == expected_sum  # the all_reduce really reduced across ranks
        assert r["big"] == list(range(100_000))
    assert len(os.listdir(tmp_path)) == world_size
    assert_all_gone(tmp_path)


def test_the_ranks_see_the_callers_environment_as_it_is_at_launch(monkeypatch):
    """The ranks fork from a server started at the first launch; a variable set after that (a
    notebook cell's os.environ, a test's monkeypatch) must still reach them, OMP_NUM_THREADS too,
    which OpenMP read when the server loaded torch."""
    launch(workers.environment, 1, ["MINIDIST_PROBE"])  # the server is running from here on
    monkeypatch.setenv("MINIDIST_PROBE", "set after the server started")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    for rank in launch(workers.environment, 2, ["MINIDIST_PROBE", "OMP_NUM_THREADS"]):
        assert rank == {"MINIDIST_PROBE": "set after the server started", "OMP_NUM_THREADS": "3", "threads": 3}
    monkeypatch.delenv("MINIDIST_PROBE")
    assert launch(workers.environment, 1, ["MINIDIST_PROBE"])[0]["MINIDIST_PROBE"] is None  # unset is unset


def test_a_variable_the_preloaded_libraries_read_at_import_reaches_them(monkeypatch, tmp_path):
    """The fork server imports transformers (and so huggingface_hub) once, for every rank: HF_HOME
    set after it started must restart it, or the ranks would keep the old cache folder."""
    launch(workers.hub_home, 1)  # the server is running from here on
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hub"))
    for rank in launch(workers.hub_home, 2):
        assert rank == {"HF_HOME": str(tmp_path / "hub"), "preloaded": True}


def test_the_collector_leaves_the_preloaded_libraries_alone_in_a_rank():
    """What the server imported lives as long as the rank: frozen, so that a full collection (the
    memory trace's, `cleanup`'s) does not walk torch's and transformers' objects every time."""
    assert all(count > 100_000 for count in launch(workers.frozen_objects, 2))


# ---- launch: failures -----------------------------------------------------------------


def test_failing_rank_is_reported_fast(tmp_path, monkeypatch):
    # Guard: if fail-fast did not work, rank 0 would wait this long in its all_reduce. The bar
    # below is far under it and well above a normal run, start-up of three ranks included, so a
    # loaded machine (other jobs on the same 2 cores) does not fail the test.
    monkeypatch.setenv("MINIDIST_TIMEOUT_S", "300")
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        launch(workers.fail_on_rank_1, 3, str(tmp_path))
    elapsed = time.monotonic() - start
    assert info.value.rank == 1
    message = str(info.value)
    assert "rank 1" in message and "boom" in message
    assert "Traceback" in message and "ValueError" in message and "fail_on_rank_1" in message
    assert elapsed < 120, f"took {elapsed:.1f} s: the other rank was not stopped promptly"
    assert len(os.listdir(tmp_path)) == 3
    assert_all_gone(tmp_path)


def test_rank_dying_silently_reports_exit_code(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIDIST_TIMEOUT_S", "60")
    with pytest.raises(RankFailed) as info:
        launch(workers.exit_on_rank_1, 2, str(tmp_path))
    assert info.value.rank == 1 and info.value.exitcode == 3
    assert "exited with code 3" in str(info.value)
    assert_all_gone(tmp_path)


def test_a_collective_gives_up_after_the_timeout(monkeypatch):
    # A rank that never arrives must not hang the others forever: the process group's timeout
    # (MINIDIST_TIMEOUT_S) turns the wait into an error. The launch then ends the sleeper.
    monkeypatch.setenv("MINIDIST_TIMEOUT_S", "3")
    start = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        launch(workers.wait_for_a_rank_that_never_comes, 2, timeout_s=90)
    assert failed.value.rank == 0 and "all_reduce" in failed.value.traceback
    assert "Timed out" in failed.value.traceback  # gloo's words for the collective timeout
    assert time.monotonic() - start < 60  # the 3 s timeout, not the sleeper's 120 s nor launch's 90 s


def test_launch_timeout_kills_everything(tmp_path):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="timed out"):
        launch(workers.sleep_forever, 2, str(tmp_path), timeout_s=5)
    assert time.monotonic() - start < 5 + 10
    assert_all_gone(tmp_path)


def test_function_from_main_is_refused():
    def in_a_notebook_cell():
        return 0

    in_a_notebook_cell.__module__ = "__main__"
    with pytest.raises(ValueError, match=r"\.py module"):
        launch(in_a_notebook_cell, 2)
    with pytest.raises(ValueError, match="lambda"):
        launch(lambda: 0, 2)
    assert mp.active_children() == []


# ---- read_launch_env: pure --------------------------------------------------------------


def test_read_launch_env_torchrun():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "node01", "MASTER_PORT": "29400",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}  # torchrun inside sbatch: torchrun wins
    assert read_launch_env(env) == dict(
        source="torchrun", rank=5, world_size=8, local_rank=1, local_world_size=4,
        master_addr="node01", master_port=29400)


def test_read_launch_env_slurm():
    env = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2",
           "SLURM_NTASKS_PER_NODE": "4", "SLURM_NODEID": "1",
           "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"}
    asked = []
    got = read_launch_env(env, resolve_host=lambda nodes: asked.append(nodes) or "gpu07")
    assert asked == ["gpu[07-08]"]
    assert got == dict(source="slurm", rank=6, world_size=8, local_rank=2, local_world_size=4,
                       master_addr="gpu07", master_port=29500 + 123456 % 1000)
    # MASTER_ADDR/PORT from the batch script win, and scontrol is not asked.
    env.update(MASTER_ADDR="10.0.0.1", MASTER_PORT="12345", SLURM_NTASKS_PER_NODE="")
    env["SLURM_TASKS_PER_NODE"] = "2(x3),1"
    env["SLURM_NODEID"] = "3"
    got = read_launch_env(env, resolve_host=lambda nodes: pytest.fail("scontrol called"))
    assert (got["master_addr"], got["master_port"], got["local_world_size"]) == ("10.0.0.1", 12345, 1)


def test_read_launch_env_bare():
    assert read_launch_env({"PATH": "/usr/bin", "MASTER_ADDR": "elsewhere", "MASTER_PORT": "1"}) == dict(
        source="single", rank=0, world_size=1, local_rank=0, local_world_size=1,
        master_addr="127.0.0.1", master_port=None)


# ---- init_distributed in this process ------------------------------------------------------


def test_init_distributed_world_1_is_idempotent(monkeypatch):
    for name in LAUNCH_VARS + ["SLURM_PROCID", "SLURM_NTASKS", "OMP_NUM_THREADS"]:
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()
    assert not dist.is_initialized()
    try:
        env = init_distributed(timeout_s=30)
        assert env == DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1,
                              device=torch.device("cpu"), backend="gloo")
        assert env.is_main and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        assert init_distributed() is env and get_env() is env
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    finally:
        cleanup()
        torch.set_num_threads(threads)
    assert not dist.is_initialized() and distributed._env is None
    with pytest.raises(RuntimeError, match="init_distributed"):
        get_env()
    cleanup()  # a second cleanup is harmless


@pytest.mark.parametrize("device_type,backend,bound", [(None, "nccl", 0), ("cpu", "gloo", None)])
def test_on_a_gpu_node_the_gpu_is_local_rank_modulo_the_gpus_seen_and_cpu_ranks_stay_on_gloo(
        monkeypatch, device_type, backend, bound):
    """Rank 1 of a node where SLURM shows each task one GPU (`--gpus-per-task=1`): its GPU is
    cuda:0, not cuda:1, which does not exist for it. And `launch`'s CPU ranks (device_type="cpu")
    stay on gloo there. CUDA and the group itself are stood in for: this machine has no GPU."""
    for name in LAUNCH_VARS + ["SLURM_PROCID", "SLURM_NTASKS"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # no scontrol needed to find the host
    monkeypatch.setenv("MASTER_PORT", "29999")
    bound_to, joined = [], {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: bound_to.append(torch.device(device).index))
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: joined.update(kwargs))
    try:
        env = init_distributed(**({} if device_type is None else {"device_type": device_type}))
    finally:
        monkeypatch.setattr(distributed, "_env", None)
    assert joined["backend"] == backend and env.backend == backend and env.local_rank == 1
    assert bound_to == ([] if bound is None else [bound])
    assert env.device == (torch.device("cuda", bound) if bound is not None else torch.device("cpu"))
