"""Nothing opens a FIFO that a command line, a model folder or a checkpoint's manifest names: opening one for reading waits
for a writer, forever, before training. Each case is refused in one line.

On code that opens the FIFO, a watchdog thread writes one game into it after a while, so that such code
goes on (and the test fails) instead of hanging the suite."""

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
from in_process import said

from minidist import evaluate, finetune
from minidist.checkpoint import state

UNBLOCK_AFTER_S = 20.0


@pytest.fixture
def make_fifo():
    """Make a FIFO at a path; whoever still waits on it after UNBLOCK_AFTER_S gets one game."""
    done = threading.Event()

    def make(path: Path) -> Path:
        os.mkfifo(path)

        def unblock():
            if not done.wait(UNBLOCK_AFTER_S):
                fd = os.open(path, os.O_WRONLY)  # only returns once a reader has the FIFO open
                os.write(fd, (json.dumps({"text": "e2e4 e7e5 1-0"}) + "\n").encode())
                os.close(fd)

        threading.Thread(target=unblock, daemon=True).start()
        return path

    yield make
    done.set()


@pytest.fixture
def fifo(tmp_path, make_fifo):
    return make_fifo(tmp_path / "games.jsonl")


def test_finetune_refuses_a_fifo_as_its_data(tiny_model, tmp_path, fifo, capsys):
    line = said(finetune.main, ["--model", tiny_model, "--impl", "torch", "--data", str(fifo), "--output_dir",
                                str(tmp_path / "run"), "--eval_prefixes", "0", "--max_steps", "1", "--no_save"], capsys)
    assert f"error: {fifo} is not a regular file (a pipe, a socket or a device)" in line


def test_evaluate_refuses_a_fifo_as_its_data(tiny_model, fifo, capsys):
    line = said(evaluate.main, ["--model", tiny_model, "--data", str(fifo)], capsys)
    assert f"minidist.evaluate: error: {fifo} is not a regular file" in line


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_model_folder_with_a_fifo_for_a_file_is_refused(tiny_model, tmp_path, make_fifo, capsys, name):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / name).unlink()
    make_fifo(model / name)
    line = said(evaluate.main, ["--model", str(model), "--num_prefixes", "1"], capsys)
    assert f"minidist.evaluate: error: {model / name} is not a regular file" in line


def test_a_manifest_entry_naming_a_fifo_is_refused(tmp_path, make_fifo):
    """A checkpoint whose manifest is intact (its own checksum) but lists a FIFO as one of its files:
    verifying it hashes every file, and would wait on the FIFO forever."""
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    make_fifo(checkpoint / "model.safetensors")
    meta = {"files": {"model.safetensors": 0}, "checksums": {"model.safetensors": "0" * 64}}
    meta["manifest_checksum"] = state._manifest_checksum(meta)
    (checkpoint / "checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="model.safetensors is not a regular file"):
        state.verify(checkpoint, {})
    assert not state.complete(checkpoint)
