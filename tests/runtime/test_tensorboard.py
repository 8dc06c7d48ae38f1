"""`--report_to tensorboard`: the event files hold metrics.jsonl's records, and no package is one line."""

import importlib.util
import json

import numpy as np
from in_process import run_here, said
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from minidist import finetune
from minidist.runtime import tensorboard


def read_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard would draw from `folder`: (step, value) by tag."""
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_run_writes_its_records_to_tensorboard(tiny_model, tmp_path, capsys):
    out = tmp_path / "run"
    code, err = run_here(["--model", tiny_model, "--impl", "torch", "--max_steps", "3", "--max_seq_length", "32",
                          "--eval_prefixes", "0",
                          "--no_save", "--output_dir", str(out), "--report_to", "tensorboard"], capsys)
    assert code == 0, err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = {}
    for record in records:
        for tag, value in tensorboard.scalars(record).items():
            expected.setdefault(tag, []).append((record["step"], float(np.float32(value))))  # TensorBoard's float32
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "memory_bytes/peak/0"} <= expected.keys()
    assert read_scalars(out / tensorboard.FOLDER) == expected
    assert [step for step, _ in expected["loss"]] == [1, 2, 3]


def test_the_log_starts_again_as_metrics_jsonl_does(tmp_path):
    """A second start (a resumed run) removes the first one's event files: no killed run's steps."""
    for loss in (5.0, 4.0):
        board = tensorboard.TensorBoardLog(tmp_path)
        board.write({"step": 1, "loss": loss, "peak_memory_bytes": None})
        board.close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    assert read_scalars(tmp_path) == {"loss": [(1, 4.0)]}


def test_without_the_package_the_flag_is_one_line(tiny_model, tmp_path, capsys, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else find_spec(name, *a))
    line = said(finetune.main, ["--model", tiny_model, "--impl", "torch", "--output_dir", str(tmp_path),
                                "--report_to", "tensorboard"], capsys)
    assert line.endswith("argument --report_to: tensorboard is not installed: pip install tensorboard"), line
