"""The benchmarks run, on a model small enough for CI, and print what they promise: step-time
ratios with their spread over rounds, and whole-step peak memory ratios, against PyTorch's own.
(No test asserts a time: ratios are for people to read, on the machine they care about.)"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--hidden_size", "64", "--num_layers", "2", "--batch_size", "2", "--seq_len", "16",
         "--warmup", "1", "--steps", "2", "--rounds", "2"]


@pytest.mark.parametrize("what,world,rows", [
    ("fsdp", 1, ["FSDP (minidist)", "ZeRO-2 (minidist)", "fully_shard FSDP2 (torch)"]),
    ("ddp", 2, ["naive DDP (minidist)", "bucketed DDP (minidist)", "DistributedDataParallel (torch)"]),
])
def test_the_strategy_bench_prints_time_and_peak_ratios(what, world, rows):
    done = subprocess.run([sys.executable, "-m", "minidist.bench", what, "--world_size", str(world), *SMALL],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert f"on {world} x cpu (gloo)" in out and "vs torch (rounds)" in out and "peak" in out, out
    for row in rows:
        line = next(line for line in out.splitlines() if line.startswith(row))
        assert line.count("x") >= 2 and " MB" in line, line  # a time ratio with its spread, a peak and its ratio
    assert "goal: at most" in out and "Traceback" not in done.stderr
    if what == "fsdp":
        assert "minidist FSDP / FSDP2, peak" in out and "ZeRO-2 peak" in out
