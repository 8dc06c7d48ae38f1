"""A checkpoint is data, never code: a payload planted in a sharded checkpoint is refused and never runs.

The attacker's moves are real: unpickle DCP's `.metadata` (or append a `torch.save` file to a shard),
add an object whose `__reduce__` calls `os.system`, and recompute every checksum and the manifest's
own, as anyone who hands over a folder can (plain SHA-256, `checkpoint.json` beside the files). The
payload would create a file; each test checks that the file does not exist, and that `--resume`
ends in one line (exit 2) before training. One process, 64 games: the fault is in the files.
"""

import dataclasses
import io
import json
import os
import pathlib
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from in_process import run_here_in_one_line as run_here

from minidist import finetune
from minidist.checkpoint import checksums, data_only, state
from minidist.chess import jsonl
from minidist.chess.games import bundled_games


class Payload:
    """Unpickled, it runs a shell command: what a planted checkpoint would do on every rank."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def games(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("games") / "games.jsonl"
    jsonl.write_games(jsonl.load_games(bundled_games("train"))[:64], path)
    return path


def argv(model, games, out, *extra):
    return ["--model", model, "--impl", "torch", "--data", str(games), "--output_dir", str(out), "--max_steps", "2",
            "--max_seq_length", "48", "--eval_prefixes", "0", "--batch_size_per_device", "4", "--warmup_steps", "1",
            "--seed", "3", "--no_save", *extra]


@pytest.fixture(scope="module")
def saved(tiny_model, games, tmp_path_factory) -> Path:
    """A sharded checkpoint-2 of PyTorch's FSDP2 (the default), whose optimizer's learning rate and
    betas DCP stores as pickled bytes beside the tensors."""
    out = tmp_path_factory.mktemp("saved") / "run"
    finetune.main(argv(tiny_model, games, out, "--save_steps", "2"))
    return out / "checkpoint-2"


def reseal(checkpoint: Path) -> None:
    """Recompute every file's size and checksum and the manifest's own, as an attacker would."""
    manifest = json.loads((checkpoint / "checkpoint.json").read_text())
    names = [str(p.relative_to(checkpoint)) for p in sorted(checkpoint.rglob("*"))
             if p.is_file() and p.name != "checkpoint.json"]
    manifest["files"] = {name: (checkpoint / name).stat().st_size for name in names}
    manifest["checksums"] = checksums.file_checksums(checkpoint, names)
    manifest.pop("manifest_checksum")
    manifest["manifest_checksum"] = state._manifest_checksum(manifest)
    (checkpoint / "checkpoint.json").write_text(json.dumps(manifest, indent=1))


def planted_copy(saved: Path, where: Path, plant) -> Path:
    """A copy of `saved` with `plant(metadata, dcp_folder)` done to its DCP metadata, resealed."""
    copy = where / "checkpoint-2"
    shutil.copytree(saved, copy)
    metadata = pickle.loads((copy / "dcp" / ".metadata").read_bytes())  # the attacker's own tools
    plant(metadata, copy / "dcp")
    (copy / "dcp" / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(copy)
    return copy


def test_a_payload_in_the_metadata_is_refused_in_one_line_and_never_runs(saved, tiny_model, games, tmp_path, capsys):
    marker = tmp_path / "payload-ran"

    def plant(metadata, _):
        metadata.planner_data = Payload(marker)  # any field: unpickling the file runs it

    copy = planted_copy(saved, tmp_path, plant)
    code, line = run_here(argv(tiny_model, games, tmp_path, "--resume", str(copy)), capsys)  # no step left: it loads
    assert not marker.exists(), "the checkpoint's payload ran"
    assert code == 2, line
    assert f"checkpoint {copy / 'dcp'} is not plain data: it names posix.system" in line, line
    assert not (tmp_path / "metrics.jsonl").exists(), "training started"


def test_a_payload_in_a_shards_bytes_is_refused_in_one_line_and_never_runs(saved, tiny_model, games, tmp_path,
                                                                           capsys):
    """DCP stores non-tensor entries (here the optimizer's learning rate) as `torch.save` bytes in a
    shard file, and reads them back with `torch.load(weights_only=False)`. The metadata stays clean."""
    marker = tmp_path / "payload-ran"

    def plant(metadata, dcp_folder):
        entry = next(index for index in metadata.storage_data if index.fqn.endswith(".lr"))
        where = metadata.storage_data[entry]
        buffer = io.BytesIO()
        torch.save(Payload(marker), buffer)
        shard = dcp_folder / where.relative_path
        offset = shard.stat().st_size
        with open(shard, "ab") as f:
            f.write(buffer.getvalue())
        metadata.storage_data[entry] = dataclasses.replace(where, offset=offset, length=len(buffer.getvalue()))

    copy = planted_copy(saved, tmp_path, plant)
    code, line = run_here(argv(tiny_model, games, tmp_path, "--resume", str(copy)), capsys)  # no step left: it loads
    assert not marker.exists(), "the checkpoint's payload ran"
    assert code == 2, line
    assert f"checkpoint {copy / 'dcp'} is not plain data: its entry optimizer." in line, line


def test_only_the_metadatas_own_types_are_admitted(saved, tmp_path):
    """The real metadata reads as plain pickle reads it; a method reached through an admitted
    class's module (`pathlib.Path.touch`, pickled by its qualified name) is refused, unimported."""
    real = saved / "dcp"
    assert data_only.DataOnlyReader(real).read_metadata().state_dict_metadata == \
        pickle.loads((real / ".metadata").read_bytes()).state_dict_metadata
    marker = tmp_path / "touched"

    class Touch:
        def __reduce__(self):
            return pathlib.Path.touch, (pathlib.Path(marker),)

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Touch()))
    with pytest.raises(ValueError, match=r"is not plain data: it names pathlib.Path.touch, which is not part"):
        data_only.check(tmp_path)
    assert not marker.exists()
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(ValueError, match=r"is not plain data: it holds a dict, not DCP's Metadata"):
        data_only.check(tmp_path)
