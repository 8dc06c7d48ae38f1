"""Publishing a checkpoint is safe at every instant, and touches only the names minidist writes.

`latest` names a complete checkpoint, or `--resume` falls back to the newest complete one and says
so; a `latest` minidist cannot have written is refused in one line; the rotation leaves a user's
`checkpoint-best/` alone. The saves run here, on one rank (PyTorch's FSDP2, the tiny model); the
kills at every rename and fsync of a save are in `test_kill_at_every_step.py`.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from minidist.checkpoint import output_dir, state
from minidist.hf.models import load_model
from minidist.strategy.options import ParallelOptions
from minidist.strategy import get_strategy
from minidist.runtime.distributed import cleanup, init_distributed

RUN = {"model": {}, "strategy": "torch/fsdp", "global_batch_size": 4, "seed": 0, "num_examples": 2}


@pytest.fixture(scope="module")
def three_saves(tiny_model, tmp_path_factory) -> Path:
    """An output folder that holds a user's `checkpoint-best/` and `checkpoint-4-backup/` beside
    minidist's saves of steps 1, 2 and 3 (`--save_total_limit 2`)."""
    out = tmp_path_factory.mktemp("three-saves")
    for mine in ("checkpoint-best", "checkpoint-4-backup", "checkpoint-0.tmp-notes"):
        (out / mine).mkdir()
        (out / mine / "note.txt").write_text("the user's\n")
    env = init_distributed()
    try:
        strategy = get_strategy(ParallelOptions("fsdp", "torch"), env)
        model = strategy.wrap(load_model(tiny_model))
        optimizer = strategy.build_optimizer(model, 1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        metrics = out / "metrics.jsonl"
        metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
        checkpoints = state.Checkpointer(out, strategy, model, optimizer, scheduler, RUN, form="sharded", keep=2)
        for step in (1, 2, 3):
            checkpoints.save(step, (0, 4 * step), metrics, {})
    finally:
        cleanup()
    return out


def test_the_rotation_touches_only_the_names_minidist_writes(three_saves):
    names = sorted(p.name for p in three_saves.iterdir())
    assert names == ["checkpoint-0.tmp-notes", "checkpoint-2", "checkpoint-3", "checkpoint-4-backup",
                     "checkpoint-best", "latest", "metrics.jsonl"]
    assert (three_saves / "latest").read_text() == "checkpoint-3\n"
    for mine in ("checkpoint-best", "checkpoint-4-backup", "checkpoint-0.tmp-notes"):
        assert (three_saves / mine / "note.txt").read_text() == "the user's\n"


def test_overwrite_deletes_only_the_names_minidist_writes(three_saves, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(three_saves, out)
    with output_dir.claimed(out, is_main=True, overwrite=True):
        pass
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-0.tmp-notes", "checkpoint-4-backup",
                                                      "checkpoint-best", "metrics.jsonl"]


def copy_of(three_saves, where: Path) -> Path:
    shutil.copytree(three_saves, where)
    return where


def test_resume_falls_back_to_the_newest_complete_checkpoint_and_says_so(three_saves, tmp_path, capsys):
    # A kill after the first checkpoint is published, before `latest` is written: no `latest`.
    out = copy_of(three_saves, tmp_path / "no-latest")
    (out / "latest").unlink()
    assert state.find("latest", out) == out / "checkpoint-3"
    assert f"there is no {out / 'latest'} (a save was cut short); resuming from the newest complete checkpoint, " \
           f"checkpoint-3" in capsys.readouterr().out
    # A kill after a resumed run moved its older save of step 3 aside: latest names a missing folder.
    out = copy_of(three_saves, tmp_path / "moved-aside")
    (out / "checkpoint-3").rename(out / "checkpoint-3.replaced")
    assert state.find("latest", out) == out / "checkpoint-2"
    assert f"{out / 'latest'} names checkpoint-3, which is missing or incomplete" in capsys.readouterr().out
    # A checkpoint cut short (a file short of its size) is passed over; so is a folder without its manifest.
    out = copy_of(three_saves, tmp_path / "cut-short")
    shard = max((out / "checkpoint-3" / "dcp").glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    (out / "checkpoint-9").mkdir()
    assert state.find("latest", out) == out / "checkpoint-2"
    # Only a save moved aside is left whole: it is resumed rather than nothing.
    out = copy_of(three_saves, tmp_path / "only-aside")
    shutil.rmtree(out / "checkpoint-2")
    (out / "checkpoint-3").rename(out / "checkpoint-3.replaced")
    assert state.find("latest", out) == out / "checkpoint-3.replaced"


def test_a_latest_minidist_cannot_have_written_is_refused_in_one_line(three_saves, tmp_path):
    out = copy_of(three_saves, tmp_path / "folder")
    (out / "latest").unlink()
    (out / "latest").mkdir()
    with pytest.raises(ValueError, match=f"{out / 'latest'} is a folder, not the one-line file minidist writes"):
        state.find("latest", out)
    for outside in ("../other-run/checkpoint-3", "/tmp/checkpoint-3", "checkpoint-best"):
        out = copy_of(three_saves, tmp_path / f"outside-{len(outside)}")
        (out / "latest").write_text(outside + "\n")
        with pytest.raises(ValueError, match="which is not a checkpoint of this output folder"):
            state.find("latest", out)
    out = tmp_path / "nothing-whole"
    out.mkdir()
    (out / "latest").write_text("checkpoint-7\n")
    with pytest.raises(ValueError, match="names checkpoint-7, which does not exist or is incomplete, and"):
        state.find("latest", out)
