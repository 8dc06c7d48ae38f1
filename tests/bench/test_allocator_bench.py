"""`python -m minidist.bench allocator` runs on sizes small enough for CI: one row per hidden size,
glibc condition ("before": `MINIDIST_GLIBC_DEFAULTS=1` in the child's environment; "after": freed
blocks kept) and implementation, with page faults, system and user time per step, the ratio of the
two implementations, and the figure. (No test asserts a time or a count of faults: those are for
people to read, on the machine they care about.)

The command's main runs in the test's own process, saving a fresh interpreter's start-up (importing
torch and transformers again, some 4 CPU seconds); its output, and its children's, is read at the
file descriptors, as `subprocess.run(capture_output=True)` reads a fresh interpreter's. Its children
are forked from `launch`'s fork server, and write where the server's output goes: so the test makes
the command start its fork server afresh, in the test, as the fresh interpreter did."""

import pytest

from in_process import exit_status
from minidist.bench import __main__ as bench_command
from minidist.runtime import launch

# The full suite only: a benchmark.
pytestmark = pytest.mark.slow


def test_the_allocator_bench_prints_its_table_and_draws_its_figure(tmp_path, capfd):
    png = tmp_path / "allocator.png"
    # Forget the fork server this process may run (`launch._fork_server_with` stops it and starts one
    # under this test's captured descriptors); the command's two conditions then each start their own.
    launch._server_started_with = None
    capfd.readouterr()  # only what the command writes counts
    try:
        returncode = exit_status(bench_command.main, ["allocator", "--sizes", "64", "--num_layers", "1", "--batch_size",
                                                      "1", "--seq_len", "8", "--warmup", "1", "--steps", "1", "--rounds",
                                                      "2", "--png", str(png)])
    finally:  # the last server writes to this test's descriptors, closed when it ends: the next launch
        launch._server_started_with = None  # starts one under the session's
    stdout, stderr = capfd.readouterr()
    assert returncode == 0, stderr[-3000:]
    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("| hidden x 1 layers |"))
    assert "minor page faults / step" in header and "system s / step" in header and "user s / step" in header
    rows = [line for line in lines if line.startswith("| 64 |")]
    assert len(rows) == 2 * 2, rows  # conditions x implementations (one size: each size costs two children)
    for size in ("64",):
        for condition in ("before (glibc defaults)", "after (freed blocks kept)"):
            for name in ("FSDP (minidist)", "fully_shard FSDP2 (torch)"):
                row = next(r for r in rows if r.startswith(f"| {size} | {condition} | {name} |"))
                cells = [cell.strip() for cell in row.split("|")[1:-1]]
                assert cells[3].endswith(")") and " s (" in cells[3], row  # a median with its spread
                assert float(cells[4].replace(",", "")) >= 0 and float(cells[5]) >= 0 and float(cells[6]) >= 0, row
    ratios = [line for line in lines if line.rstrip().endswith("x") and line.startswith("  ")]
    assert len(ratios) == 2, lines  # minidist FSDP / FSDP2 per size and condition
    assert png.stat().st_size > 10_000 and "Traceback" not in stderr
