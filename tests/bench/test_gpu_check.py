"""The GPU check's decisions, held on the CPU: which rows run on which GPU (the gate on the estimate),
the CPU threads the offload rows are timed on (a torchrun rank's), the 1B row's batch, the table's
reserved column and the goals, and the memory snapshot's calls where CUDA exists.

No GPU is needed: each decision is a function of numbers (the estimate, the GPU's memory, the
environment). Only the snapshot, which is nothing but calls into `torch.cuda.memory`, is checked
against stand-ins for those calls."""

import dataclasses
import time
import types
from pathlib import Path

import pytest
import torch

from minidist.bench import gate, gpu, gpu_report, snapshot, threads
from minidist.memory import estimator
from minidist.runtime.metrics import PEAK_BF16_FLOPS

# The full suite only: the GPU check's smoke mode and its tables, on 1B-parameter shapes.
pytestmark = pytest.mark.slow

H100 = 85_045_000_000  # bytes, torch.cuda.get_device_properties(...).total_memory of an H100 80GB HBM3 (79.2 GiB)
H200 = 150_100_000_000  # an H200 (139.8 GiB): what it reports
ON_A_GPU = types.SimpleNamespace(device=torch.device("cuda", 0))  # estimate() reads only the device's type


@pytest.fixture(scope="module")
def llama_1b(tmp_path_factory):
    """The GPU check's Llama, from its config alone (no weights written)."""
    from minidist.hf import models

    sizes = gpu.SIZES["gpu"]
    folder = tmp_path_factory.mktemp("llama_1b")
    models.tiny_llama_config(hidden_size=sizes["hidden_size"], num_layers=sizes["num_layers"],
                             num_heads=sizes["num_heads"]).save_pretrained(folder)
    return dataclasses.replace(estimator.model_shape(str(folder)), name="Llama 1.01B")


def codellama_estimate() -> float:
    shape = estimator.model_shape(str(gpu.CODELLAMA))
    big = dict(gpu.SIZES["gpu"], batch=1, seq=512)
    return gpu.estimate("minidist", "fsdp", True, big, ON_A_GPU, shape)


def test_the_7b_row_runs_where_its_estimate_fits_and_says_why_not_elsewhere():
    need = codellama_estimate()
    assert 130e9 < need < 140e9, need  # the 134.8 GB: above the 120 GB the check used to ask for
    reason = gate.skip_reason(need, H100)
    assert reason and f"{need / 1e9:.1f} GB" in reason and f"{H100 / 1e9:.1f} GB" in reason, reason
    assert gate.skip_reason(need, H200) is None  # FSDP at world size 1, batch 1 x 512, checkpointing
    assert gate.skip_reason(need, int(need + gate.RESERVE) - 1) is not None  # the reserve is asked for, not assumed
    assert gate.skip_reason(need, 125e9) is not None  # a 125 GB GPU passed the old 120 GB gate: it cannot hold it
    assert gate.skip_reason(need, None) is None  # no GPU, no gate (the smoke run's tiny rows)


def test_the_1b_rows_fill_an_h100_without_overflowing_it(llama_1b):
    sizes = gpu.SIZES["gpu"]
    assert 0.95e9 < llama_1b.num_params < 1.1e9, llama_1b.num_params
    assert sizes["batch"] * sizes["seq"] * gpu.ACCUMULATION >= 16_384  # tokens per step: MFU worth quoting
    estimates = [gpu.estimate(impl, strategy, ckpt, sizes, ON_A_GPU, llama_1b)
                 for impl, strategy in gpu.SETUPS for ckpt in (False, True)]
    assert all(gate.skip_reason(e, H100) is None for e in estimates), [e / 1e9 for e in estimates]
    assert max(estimates) > 0.4 * H100  # the hungriest setup uses a good part of the GPU


def test_mfu_is_against_989_tflops_on_an_h100_and_an_h200():
    assert PEAK_BF16_FLOPS["H100"] == PEAK_BF16_FLOPS["H200"] == 989e12  # NVIDIA H100 SXM datasheet, bf16 dense


@pytest.mark.parametrize("environ,ranks,offload,expected", [
    ({}, 4, False, (1, "OMP_NUM_THREADS=1, set by torchrun")),  # torchrun's rule for N > 1 ranks
    ({}, 1, False, (16, "this process's")),  # one rank: torchrun sets nothing
    ({"OMP_NUM_THREADS": "6"}, 4, False, (6, "OMP_NUM_THREADS=6, set by the environment")),
    ({"SLURM_CPUS_PER_TASK": "32"}, 4, True, (8, "SLURM_CPUS_PER_TASK=32 shared by 4 ranks")),  # the capstone's
    ({}, 4, True, (16, "64 usable cores shared by 4 ranks")),
    ({"OMP_NUM_THREADS": "3"}, 4, True, (3, "OMP_NUM_THREADS=3")),  # someone's choice, kept
])
def test_offload_is_timed_on_the_threads_a_torchrun_rank_gets(environ, ranks, offload, expected):
    found, source = threads.job_threads(environ, usable_cores=64, default_threads=16, ranks_per_node=ranks,
                                        cpu_offload=offload)
    assert found == expected[0] and source.startswith(expected[1]), (found, source)


def test_threads_using_sets_the_count_and_gives_it_back():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), threads.using(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError("a step that fails")
    assert torch.get_num_threads() == before


def row(impl, strategy, ckpt, median, peak, estimate, mfu=None, reserved=None, model="Llama 1.01B"):
    return {"model": model, "impl": impl, "strategy": strategy, "checkpointing": ckpt, "estimate": estimate,
            "times": [median * 0.9, median, median * 1.2], "peak": peak, "reserved": reserved,
            "tokens_per_s": 16_384 / median, "mfu": mfu}


def test_the_table_has_the_reserved_peak_and_says_it_is_blind_to_nccl():
    rows = [row("torch", "fsdp", False, 0.40, 30e9, 31e9, reserved=33e9),
            row("minidist", "fsdp", False, 0.41, 31e9, 31e9, reserved=34.5e9),
            {"model": "CodeLlama-7b", "impl": "minidist", "strategy": "fsdp", "checkpointing": True,
             "estimate": 134.8e9, "error": gate.skip_reason(134.8e9, H100)}]
    text = gpu_report.table(rows)
    assert text.startswith("Blind to NCCL: world size 1") and "local copies" in text
    header = next(line for line in text.splitlines() if line.startswith("| model |"))
    assert "peak allocated (GB)" in header and "peak reserved (GB)" in header
    cells = {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[1:-1]]
             for line in text.splitlines() if line.startswith("| ") and "---" not in line and "model" not in line}
    assert cells["Llama 1.01B", "minidist/fsdp"][6:10] == ["31.00", "34.50", "31.00", "1.00x"]
    assert cells["Llama 1.01B", "minidist/fsdp"][10] == "1.02x"
    assert cells["CodeLlama-7b", "minidist/fsdp"][3].startswith("skipped: estimate 134.8 GB")


def test_the_goals_judge_fsdp_against_fsdp2_the_estimate_and_mfu():
    rows = [row("torch", "fsdp", False, 0.40, 30e9, 30e9, mfu=0.42),
            row("minidist", "fsdp", False, 0.43, 30.5e9, 30e9, mfu=0.39),
            row("minidist", "ddp", False, 0.50, 40e9, 36e9, mfu=0.30)]
    lines = gpu_report.goals(rows, "Llama 1.01B")
    assert lines[0].startswith("peak within 5% of the estimate: 2 of 3 rows") and "minidist/ddp" in lines[0]
    assert lines[0].endswith("NOT met")
    fsdp = next(line for line in lines if "FSDP / FSDP2" in line and "checkpointing off" in line)
    assert "step 1.07x" in fsdp and "peak 1.02x" in fsdp and fsdp.endswith("NOT met)")
    assert not any("checkpointing on" in line for line in lines)  # no pair ran with it: nothing judged
    mfu = lines[-1]
    assert "best 42.0%" in mfu and "torch/fsdp" in mfu and "1 of 3 rows" in mfu and mfu.endswith("met)")
    cpu = gpu_report.goals([dict(r, mfu=None) for r in rows], "Llama 1.01B")
    assert cpu[-1].startswith("MFU: no bf16 peak known")


def test_offload_is_timed_on_a_capstone_ranks_threads_whatever_the_machines_gpus():
    assert gpu.offload_ranks_per_node(None, torch.device("cuda", 0)) == 4  # a one-GPU machine: still a rank's share
    assert gpu.offload_ranks_per_node(2, torch.device("cuda", 0)) == 2
    assert gpu.offload_ranks_per_node(None, torch.device("cpu")) == 1


def test_the_snapshot_records_one_step_where_cuda_exists(tmp_path, monkeypatch):
    calls = []

    def record_history(enabled="all", max_entries=None, stacks="all", **_):
        calls.append(("record", enabled, max_entries) + ((stacks,) if enabled else ()))

    def dump(path):
        calls.append(("dump", path))
        Path(path).write_bytes(b"snapshot")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record_history)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    path = tmp_path / gpu.SNAPSHOT
    written = snapshot.record_step(lambda: calls.append(("step",)), torch.device("cuda", 0), path)
    assert written == path and path.read_bytes() == b"snapshot"
    # Python's stacks only: C++'s take minutes to symbolise at the dump (snapshot.py)
    assert calls == [("record", "all", snapshot.MAX_ENTRIES, "python"), ("step",), ("dump", str(path)),
                     ("record", None, None)]
    calls.clear()
    with pytest.raises(torch.OutOfMemoryError):  # a step that fails still turns the history off
        snapshot.record_step(lambda: (_ for _ in ()).throw(torch.OutOfMemoryError("oom")), torch.device("cuda", 0),
                             tmp_path / "again.pickle")
    assert calls[-1] == ("record", None, None)
    assert snapshot.record_step(lambda: None, torch.device("cpu"), tmp_path / "cpu.pickle") is None
    assert not (tmp_path / "cpu.pickle").exists() and snapshot.reserved_peak(torch.device("cpu")) is None


def test_a_row_that_does_not_fit_is_not_built(llama_1b, monkeypatch, capsys):
    from minidist.bench import offload

    sizes, nowhere = gpu.SIZES["gpu"], "/no/model/here"  # building from it would raise
    need = gpu.estimate("torch", "ddp", False, sizes, ON_A_GPU, llama_1b)
    monkeypatch.setattr(gpu, "gpu_memory", lambda device: need + gate.RESERVE - 1)  # a byte short
    row = gpu.run_setup("torch", "ddp", False, nowhere, sizes, ON_A_GPU, llama_1b)
    assert row["error"].startswith(f"skipped: estimate {need / 1e9:.1f} GB + 5 GB reserve > GPU"), row
    assert "Llama 1.01B torch/ddp checkpointing off: skipped" in capsys.readouterr().out
    need = offload.estimate("fsdp", False, sizes, ON_A_GPU, llama_1b, gpu.ACCUMULATION)["peak"]
    monkeypatch.setattr(offload, "gpu_memory", lambda device: need + gate.RESERVE - 1)
    row = offload.run("fsdp", False, nowhere, sizes, ON_A_GPU, llama_1b, [], gpu.ACCUMULATION, 1, 16)
    assert row["error"].startswith(f"skipped: estimate {need / 1e9:.1f} GB"), row
    table = offload.offload_table([row], 16)
    assert f"| minidist/fsdp | off | 1 | skipped: estimate {need / 1e9:.1f} GB" in table, table


def fake_row(impl, strategy_name, checkpointing, *args, **kwargs) -> dict:
    """A measured row as `run_setup` returns it, without the measuring."""
    return {"model": "Llama tiny", "impl": impl, "strategy": strategy_name, "checkpointing": checkpointing,
            "times": [0.1, 0.1, 0.1], "tokens_per_s": 1000.0, "mfu": None, "peak": 2e6, "reserved": None,
            "estimate": 2e6}


def test_every_finished_row_is_on_disk_when_the_check_is_stopped(tmp_path, monkeypatch):
    """A kill (the device call's limit) after three rows: table.md already holds all three."""
    done = []

    def three_then_killed(*args, **kwargs):
        if len(done) == 3:
            raise KeyboardInterrupt("the device call's limit")
        done.append(fake_row(*args))
        return done[-1]

    monkeypatch.setattr(gpu, "run_setup", three_then_killed)
    monkeypatch.setattr(gpu, "free", lambda device: None)
    progress = gpu.Progress(tmp_path, time.perf_counter(), gpu.DEADLINE_S)
    with pytest.raises(KeyboardInterrupt):
        gpu.llama_rows("unused", gpu.SIZES["smoke"], types.SimpleNamespace(device=None), None, tmp_path, progress)
    table = (tmp_path / "table.md").read_text()
    assert table.count("| Llama tiny |") == 3 and "(in progress: 3 row(s) after" in table, table


def test_no_row_starts_after_the_deadline_and_the_report_says_which(tmp_path, monkeypatch):
    started = time.perf_counter()
    monkeypatch.setattr(gpu, "run_setup", fake_row)
    monkeypatch.setattr(gpu, "free", lambda device: None)
    progress = gpu.Progress(tmp_path, started, deadline_s=0.0)
    time.sleep(0.01)
    assert gpu.llama_rows("unused", gpu.SIZES["smoke"], types.SimpleNamespace(device=None), None, tmp_path,
                          progress) == []
    assert progress.note().startswith("stopped at its deadline (0 s, --deadline_s): not run: torch/ddp, checkpointing "
                                      "off; minidist/ddp, checkpointing off"), progress.note()
    assert len(progress.not_run) == 12 and not (tmp_path / "table.md").exists()
