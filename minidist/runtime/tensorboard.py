"""Live curves in TensorBoard (`--report_to tensorboard`): the records of `metrics.jsonl`, again.

`metrics.jsonl` stays the source of truth: one JSON line per step, which a test, a notebook or a
script reads with two lines of Python. Many learners, though, arrive from the Trainer or
Accelerate expecting to watch the loss in TensorBoard while the run goes. So rank 0 also hands
every record to `torch.utils.tensorboard.SummaryWriter`, in OUTPUT_DIR/tensorboard:

    tensorboard --logdir OUTPUT_DIR/tensorboard

Each number of a record becomes a scalar at the record's step, under its key (`loss`, `lr`,
`tokens_per_s`, ...); nested figures are named by their path (`memory_bytes/peak/0`: rank 0's
peak). None (a figure not measured this step) and the step itself are left out. TensorBoard keeps
scalars as float32, so a byte count in the billions reads back rounded to about 7 digits.

The log is rewritten from step 1 on every start, as `metrics.jsonl` is (a resumed run writes the
records it restored first): the old event files are removed, so that TensorBoard does not draw a
killed run's steps beside the resumed run's.

TensorBoard is optional (`pip install tensorboard`): the flag without it is one line, at start.
"""

import argparse
import importlib.util
from pathlib import Path

from minidist.runtime.errors import UsageError

FOLDER = "tensorboard"  # under --output_dir
CHOICES = ("none", "tensorboard")


def report_to(value: str) -> str:
    """`--report_to`'s type: checked when the command line is read, so that a missing package is
    one line before the model loads, not a traceback after."""
    if value == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        raise argparse.ArgumentTypeError("tensorboard is not installed: pip install tensorboard")
    return value


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a record by tag: nested dicts and lists flattened into `a/b/0`, None and bools left out."""
    found = {}
    items = record.items() if isinstance(record, dict) else enumerate(record)
    for key, value in items:
        tag = f"{prefix}{key}"
        if isinstance(value, (dict, list, tuple)):
            found.update(scalars(value, tag + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and tag != "step":
            found[tag] = value
    return found


class TensorBoardLog:
    """Write each record's scalars to TensorBoard's event files in `folder`, at the record's step."""

    def __init__(self, folder: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch's module imports the tensorboard package
            raise UsageError("--report_to tensorboard needs the tensorboard package: pip install tensorboard") from err
        self.folder = folder
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for old in folder.glob("events.out.tfevents.*"):  # rewritten from step 1, as metrics.jsonl is
                old.unlink()
            self.writer = SummaryWriter(log_dir=str(folder))
        except OSError as err:  # a file of that name, a read-only folder: as metrics.jsonl's faults, one line
            raise UsageError(self._said(err)) from None

    def _said(self, err: OSError) -> str:
        return (f"could not write --report_to tensorboard's log in {self.folder}: {err.strerror or err}; free some "
                f"space or make it a folder this run may write to (or drop --report_to), and run again with --resume")

    def write(self, record: dict) -> None:
        try:  # the writer's thread keeps a failed write's error, and raises it at the next call
            for tag, value in scalars(record).items():
                self.writer.add_scalar(tag, value, global_step=record["step"])
            self.writer.flush()  # live: TensorBoard reads the file while the run goes
        except OSError as err:  # a full disk
            raise UsageError(self._said(err)) from None

    def close(self) -> None:
        try:
            self.writer.close()
        except OSError as err:
            raise UsageError(self._said(err)) from None
