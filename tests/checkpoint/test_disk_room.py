"""Room on the disk, checked after the first step of a start (`minidist/checkpoint/disk_room.py`).

- The checkpoint's size is counted from the state a save writes: on 2 ranks, for each way a
  checkpoint is cut (FSDP's flats, DDP's copies, FSDP2's DTensors, tensor-parallel slices, pipeline
  stages), the count matches the bytes DCP then wrote, within its per-tensor overhead.
- How many are on the disk at once follows the rotation: checked case by case.
- A run that does not fit stops after its first step, before any save, in one line, with the
  counted sizes and what to do (the file system's free space planted small).
"""

from collections import namedtuple

import pytest
from torch.distributed.checkpoint import FileSystemReader
from in_process import exit_status, run_here_in_one_line
from interrupted import few_games
from train_workers import run_finetunes_counting_checkpoints

from minidist import finetune
from minidist.checkpoint import disk_room
from minidist.runtime.launch import launch

LAYOUTS = {  # one of each checkpoint form on 2 ranks
    "fsdp": ["--strategy", "fsdp"],
    "ddp": ["--strategy", "ddp"],
    "fsdp2": ["--impl", "torch"],
    "ddp tp 2": ["--strategy", "ddp", "--tp_size", "2", "--batch_size_per_device", "2"],
    "fsdp2 pp 2": ["--impl", "torch", "--pp_size", "2", "--gradient_accumulation_steps", "2"],
}


@pytest.mark.slow
def test_the_counted_checkpoint_is_what_dcp_writes(tiny_model, tmp_path):
    games = str(few_games(tmp_path))
    argvs = [["--model", tiny_model, "--data", games, "--output_dir", str(tmp_path / name.replace(" ", "-")),
              "--max_steps", "1", "--save_steps", "1", "--max_seq_length", "48", "--eval_prefixes", "0",
              "--batch_size_per_device", "1", "--no_save", *extra] for name, extra in LAYOUTS.items()]
    counted_by_rank = launch(run_finetunes_counting_checkpoints, 2, argvs, timeout_s=600)
    for i, name in enumerate(LAYOUTS):
        counted = {rank[i] for rank in counted_by_rank}
        assert len(counted) == 1, (name, counted)  # every rank counts the same
        folder = tmp_path / name.replace(" ", "-") / "checkpoint-1" / "dcp"
        written = sum(f.stat().st_size for f in folder.glob("*.distcp"))
        items = len(FileSystemReader(str(folder)).read_metadata().storage_data)  # the pieces DCP wrote
        # Each piece is a torch.save record: the tensor's bytes and about 1.5 KB around them (a
        # 7B checkpoint's ~1,000 pieces per rank add under 0.01%; the tiny model's 22-160, 0.4-6%).
        assert 0 <= written - counted.pop() <= 2048 * items, (name, counted, written, items)


Usage = namedtuple("Usage", "total used free")


@pytest.mark.parametrize("saves, keep, existing, at_once", [
    (1, 2, 0, 1),    # --save_steps 0: only a stop's checkpoint
    (3, 2, 0, 3),    # two saves and a stop's: the third is written before the first goes
    (9, 2, 0, 3),    # many saves: never more than the kept ones and the one being written
    (9, 2, 2, 1),    # resumed beside two: one more at a time
    (9, 2, 5, 1),    # more than kept (the limit lowered): one more, then the rotation removes the rest
    (9, 0, 1, 9),    # --save_total_limit 0: all of them stay
    (9, 1, 0, 2),
])
def test_how_many_checkpoints_are_on_the_disk_at_once(saves, keep, existing, at_once):
    assert disk_room.new_checkpoints_at_once(saves, keep, existing) == at_once


@pytest.mark.parametrize("first, last, every, saves", [
    (1, 200, 100, 3),   # steps 100 and 200, and one for a stop
    (101, 200, 100, 2),  # resumed after step 100: step 200 and a stop
    (1, 200, 0, 1),     # no --save_steps: a stop's only
    (1, 5, 1, 6),
    (4, 5, 2, 2),        # step 4 and a stop
])
def test_the_saves_left_in_a_start(first, last, every, saves):
    assert disk_room.saves_left(first, last, every) == saves


def test_a_run_says_its_room_after_its_first_step_and_stops_there_if_it_does_not_fit(tiny_model, tmp_path, capsys,
                                                                                      monkeypatch):
    out = tmp_path / "out"
    argv = ["--model", tiny_model, "--output_dir", str(out), "--max_steps", "300", "--save_steps", "100",
            "--max_seq_length", "32", "--eval_prefixes", "0", "--batch_size_per_device", "1", "--overwrite_output_dir"]
    capsys.readouterr()
    assert exit_status(finetune.main, [*argv, "--max_steps", "1"]) == 0  # the last --max_steps given wins
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("disk: ")]
    assert len(said) == 1 and " the fine-tuned model 1.4 MB; this start writes up to " in said[0], said
    assert "(1 checkpoint, if a stop signal asks for it (--save_steps saves none in this start), then the model)" in said[0]
    assert exit_status(finetune.main, [*argv, "--max_steps", "1", "--save_steps", "0"]) == 0
    assert "disk: " not in capsys.readouterr().out  # no saves planned, and it fits: nothing to say

    monkeypatch.setattr(disk_room.shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - 10**6, 10**6))
    code, line = run_here_in_one_line(argv, capsys)
    assert code == 2
    assert f"--output_dir {out} has 1.0 MB free, and a checkpoint holds " in line, line
    assert ("(3 checkpoints at once: the 2 kept (--save_total_limit) and the one being written, then the model)"
            in line), line
    assert "--save_total_limit 1" in line and "OUTPUT_DIR=" in line, line
    assert not [p for p in out.iterdir() if p.name.startswith("checkpoint-")]  # stopped before any save
