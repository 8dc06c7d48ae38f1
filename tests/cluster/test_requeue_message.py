"""chess_finetune.sh's `requeue` says where the next start goes on from, in each case the script tells
apart when it decides on `--resume`: `latest` names a checkpoint; no `latest` but a `checkpoint-<step>`
folder (a start killed just after publishing its first checkpoint: the next start passes `--resume`,
which finds the newest complete one); nothing at all (the next start begins afresh).

No SLURM is needed: the function is read out of the script and run by bash, with a `scontrol` that
does nothing. The real requeue, under a real SLURM, is tests/cluster/test_slurm.py's."""

import re
import subprocess
from pathlib import Path

import pytest

# The full suite only: a batch script under a real SLURM started on this machine.
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "slurm" / "chess_finetune.sh"


def requeue_says(output_dir: Path, tmp_path: Path) -> str:
    """The line `requeue` prints for this OUTPUT_DIR, run out of the script as it is."""
    function = re.search(r"^requeue\(\) \{.*?^\}", SCRIPT.read_text(), re.DOTALL | re.MULTILINE).group(0)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    scontrol = fake_bin / "scontrol"
    scontrol.write_text("#!/bin/sh\nexit 0\n")
    scontrol.chmod(0o755)
    result = subprocess.run(["bash", "-c", f"set -euo pipefail\n{function}\nrequeue"], capture_output=True,
                            text=True, check=True, env={"PATH": f"{fake_bin}:/usr/bin:/bin", "SLURM_JOB_ID": "7",
                                                        "OUTPUT_DIR": str(output_dir)})
    return result.stdout.strip()


def test_latest_names_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoint-3").mkdir(parents=True)
    (out / "latest").write_text("checkpoint-3")
    assert requeue_says(out, tmp_path) == f"requeueing job 7; the next start resumes from {out}/checkpoint-3"


def test_a_checkpoint_without_latest_is_not_called_the_beginning(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoint-3").mkdir(parents=True)
    line = requeue_says(out, tmp_path)
    assert "the beginning" not in line, line
    assert line == f"requeueing job 7; the next start resumes from the newest complete checkpoint in {out}", line


def test_nothing_saved_is_the_beginning(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint-best").mkdir()  # a user's folder: not one minidist resumes from
    assert requeue_says(out, tmp_path) == "requeueing job 7; the next start resumes from the beginning (no checkpoint yet)"
