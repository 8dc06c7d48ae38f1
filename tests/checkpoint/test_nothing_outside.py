"""Nothing lost, nothing read from outside: minidist writes, deletes and reads only what it created
inside --output_dir.

A link is not minidist's: a checkpoint folder linked in from an archive (to resume from it), a
`checkpoint-N.tmp` link, a link met by --overwrite_output_dir. Each goes as a link, and what it names
keeps every file. DCP's `.metadata` and the manifest name files by path: a path that is absolute, has
`..`, names a pipe or claims bytes past a file's end is refused in one line, before anything is read
(the checksums do not help: whoever hands over a folder recomputes them). What else a resume may
meet is one line too: a manifest's step written as text, a pickled `scheduler.pt`, `--resume` naming
a file or nothing, a folder where the lock goes, `MINIDIST_TIMEOUT_S=abc`. One process, 64 games,
two runs that save (shared by the tests); the faults are in the files.
"""

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from in_process import run_here_in_one_line as run_here
from test_checkpoint_is_data import argv, games, planted_copy, saved  # noqa: F401 (fixtures)

from minidist.checkpoint import checksums, data_only, state

# The full suite only: runs that launch ranks, save and resume.
pytestmark = pytest.mark.slow


def listing(folder: Path) -> dict:
    """Every file under `folder` with its bytes: what must not change."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def linked_run(saved, tiny_model, games, tmp_path_factory):  # noqa: F811
    """A run folder whose checkpoint-2 is a link to an archived checkpoint, a `checkpoint-9.tmp` link
    to another folder, resumed from the link and saving at every step, keeping one: the rotation
    meets the link at once, and the first save the `.tmp` link."""
    root = tmp_path_factory.mktemp("linked")
    archive, elsewhere, run = root / "archive" / "checkpoint-2", root / "elsewhere", root / "run"
    shutil.copytree(saved, archive)
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("a user's file\n")
    run.mkdir()
    (run / "checkpoint-2").symlink_to(archive)
    (run / "checkpoint-9.tmp").symlink_to(elsewhere)
    before = {"archive": listing(archive), "elsewhere": listing(elsewhere)}
    args = argv(tiny_model, games, run, "--resume", str(run / "checkpoint-2"), "--max_steps", "4",
                "--save_steps", "1", "--save_total_limit", "1")
    args.remove("--no_save")
    finetune_status = run_once(args)
    return {"archive": archive, "elsewhere": elsewhere, "run": run, "before": before, "status": finetune_status}


def run_once(args) -> int:
    from minidist import finetune

    try:
        finetune.main(args)
        return 0
    except SystemExit as stop:
        return stop.code


def test_a_linked_checkpoint_and_a_linked_tmp_lose_nothing_to_rotation_and_saves(linked_run):
    assert linked_run["status"] == 0
    assert listing(linked_run["archive"]) == linked_run["before"]["archive"], "the archived checkpoint changed"
    assert state.complete(linked_run["archive"])
    assert listing(linked_run["elsewhere"]) == linked_run["before"]["elsewhere"], "a save wrote through the .tmp link"
    run = linked_run["run"]
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-4"]
    assert not (run / "checkpoint-4").is_symlink() and state.complete(run / "checkpoint-4")


def test_overwrite_output_dir_removes_a_link_never_what_it_names(linked_run, tiny_model, games):  # noqa: F811
    """A fresh run over a folder whose checkpoint is a link: the link goes, the archive stays whole."""
    run, archive = linked_run["run"].parent / "overwritten", linked_run["archive"]
    run.mkdir()
    (run / "checkpoint-7").symlink_to(archive)
    before = listing(archive)
    assert run_once(argv(tiny_model, games, run, "--overwrite_output_dir", "--max_steps", "1")) == 0
    assert not os.path.lexists(run / "checkpoint-7")
    assert listing(archive) == before and state.complete(archive)


# ---------------------------------------------------------------- paths in DCP's metadata and the manifest
def test_a_metadata_path_to_another_runs_shard_is_refused_and_nothing_is_read(saved, tiny_model, games, tmp_path,
                                                                                capsys):  # noqa: F811
    """Every file of the copy verifies; its metadata sends one item to the original's shard, by an
    absolute path. Without the check DCP reads it (another run's weights, exit 0, no word)."""
    def plant(metadata, _):
        entry = next(iter(metadata.storage_data))
        where = metadata.storage_data[entry]
        metadata.storage_data[entry] = type(where)(str(saved / "dcp" / where.relative_path), where.offset, where.length)

    copy = planted_copy(saved, tmp_path, plant)
    code, line = run_here(argv(tiny_model, games, tmp_path, "--resume", str(copy)), capsys)
    assert code == 2, line
    assert f"checkpoint {copy / 'dcp'} is damaged: its .metadata" in line and "not a file inside the checkpoint" in line
    assert not (tmp_path / "metrics.jsonl").exists(), "training started"


@pytest.mark.parametrize("fault", ["escaping", "fifo", "a terabyte", "unlisted", "chunks holding themselves"])
def test_metadata_that_reads_outside_the_checkpoints_files_is_refused_in_one_line(saved, tmp_path, fault):  # noqa: F811
    def plant(metadata, dcp_folder):
        entry = next(iter(metadata.storage_data))
        where = metadata.storage_data[entry]
        if fault == "escaping":
            where.relative_path = "../../" + where.relative_path
        elif fault == "fifo":
            os.mkfifo(dcp_folder / "pipe")  # not listed by the manifest (reseal lists regular files)
            where.relative_path = "pipe"
        elif fault == "a terabyte":
            where.length = 10**12
        elif fault == "unlisted":
            shutil.copy(dcp_folder / where.relative_path, dcp_folder / "extra.distcp")
            where.relative_path = "extra.distcp"
        else:
            tensor = next(item for item in metadata.state_dict_metadata.values() if hasattr(item, "chunks"))
            tensor.chunks.append(tensor.chunks)

    copy = planted_copy(saved, tmp_path, plant)
    if fault == "unlisted":  # resealed with the extra file listed: take it out of the manifest again
        manifest = json.loads((copy / "checkpoint.json").read_text())
        for key in ("files", "checksums"):
            manifest[key].pop("dcp/extra.distcp")
        manifest.pop("manifest_checksum")
        manifest["manifest_checksum"] = state._manifest_checksum(manifest)
        (copy / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=rf"^checkpoint {copy}(/dcp)? is damaged: its (dcp/)?\.metadata ") as refused:
        state.verify(copy, {})
    assert "\n" not in str(refused.value)


def test_a_manifest_path_outside_the_checkpoint_is_refused(saved, tmp_path):  # noqa: F811
    """The manifest lists `../../../etc/hostname` with its true size and checksum, resealed."""
    copy = tmp_path / "checkpoint-2"
    shutil.copytree(saved, copy)
    outside = tmp_path / "outside.txt"
    outside.write_text("not the checkpoint's\n")
    name = os.path.relpath(outside, copy)  # "../outside.txt"
    manifest = json.loads((copy / "checkpoint.json").read_text())
    manifest["files"][name] = outside.stat().st_size
    manifest["checksums"][name] = checksums.file_checksums(copy, [name])[name]
    manifest.pop("manifest_checksum")
    manifest["manifest_checksum"] = state._manifest_checksum(manifest)
    (copy / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"lists '\.\./outside\.txt', which is not a file inside the checkpoint"):
        state.verify(copy, {})
    link = copy / "dcp" / "linked.distcp"
    link.symlink_to(outside)
    reseal_with_link = json.loads((copy / "checkpoint.json").read_text())
    del reseal_with_link["files"][name], reseal_with_link["checksums"][name]
    reseal_with_link["files"]["dcp/linked.distcp"] = outside.stat().st_size
    reseal_with_link["checksums"]["dcp/linked.distcp"] = checksums.file_checksums(copy, ["dcp/linked.distcp"])[
        "dcp/linked.distcp"]
    reseal_with_link.pop("manifest_checksum")
    reseal_with_link["manifest_checksum"] = state._manifest_checksum(reseal_with_link)
    (copy / "checkpoint.json").write_text(json.dumps(reseal_with_link))
    with pytest.raises(ValueError, match=r"dcp/linked.distcp is not a regular file of its own \(a link"):
        state.verify(copy, {})


def test_the_real_metadata_names_only_its_own_listed_files(saved):  # noqa: F811
    manifest = json.loads((saved / "checkpoint.json").read_text())
    named = data_only.check(saved / "dcp")
    assert named and {f"dcp/{name}" for name in named} <= manifest["files"].keys()
    assert pickle.loads((saved / "dcp" / ".metadata").read_bytes()).storage_data  # the check saw every item


# ---------------------------------------------------------------- what a resume meets, each one line
def resealed_with(saved: Path, where: Path, change) -> Path:  # noqa: F811
    """A copy of `saved` with `change(manifest)` done to its manifest, its own checksum recomputed."""
    copy = where / "checkpoint-2"
    shutil.copytree(saved, copy)
    manifest = json.loads((copy / "checkpoint.json").read_text())
    change(manifest, copy)
    manifest.pop("manifest_checksum")
    manifest["manifest_checksum"] = state._manifest_checksum(manifest)
    (copy / "checkpoint.json").write_text(json.dumps(manifest))
    return copy


class Payload:
    def __reduce__(self):
        return os.system, ("true",)


def pickled_scheduler(manifest, copy):
    torch.save({"last_epoch": Payload()}, copy / "scheduler.pt")
    manifest["files"]["scheduler.pt"] = (copy / "scheduler.pt").stat().st_size
    manifest["checksums"]["scheduler.pt"] = checksums.file_checksums(copy, ["scheduler.pt"])["scheduler.pt"]


@pytest.mark.parametrize("fault, said", [
    ("step '4'", "checkpoint.json is damaged: its step, form or position is not what minidist writes"),
    ("a pickled scheduler.pt", "scheduler.pt is not plain data: it names"),
    ("--resume a file", "checkpoint.json is a file; pass a checkpoint folder"),
    ("--resume a missing path", "/missing is not there; pass a checkpoint folder"),
    ("minidist.lock a folder", "minidist.lock is a folder, not the lock file minidist writes there; remove it"),
])
def test_a_resume_that_meets_a_fault_says_it_in_one_line(saved, tiny_model, games, tmp_path, capsys, fault, said):  # noqa: F811
    resume = str(saved)
    if fault == "step '4'":
        resume = str(resealed_with(saved, tmp_path, lambda manifest, _: manifest.update(step="4")))
    elif fault == "a pickled scheduler.pt":
        resume = str(resealed_with(saved, tmp_path, pickled_scheduler))
    elif fault == "--resume a file":
        resume = str(saved / "checkpoint.json")
    elif fault == "--resume a missing path":
        resume = str(tmp_path / "missing")
    else:
        (tmp_path / "out" / "minidist.lock").mkdir(parents=True)
    code, line = run_here(argv(tiny_model, games, tmp_path / "out", "--resume", resume), capsys)
    assert code == 2 and said in line, line
    assert "weights_only" not in line


def test_minidist_timeout_s_that_is_not_a_number_is_one_line(monkeypatch):
    from minidist.runtime import distributed
    from minidist.runtime.errors import UsageError

    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    for text in ("abc", "0", "inf"):  # refused before any process group is made
        monkeypatch.setenv("MINIDIST_TIMEOUT_S", text)
        with pytest.raises(UsageError, match=rf"MINIDIST_TIMEOUT_S='{text}' in the environment is not a number"):
            distributed.init_distributed()
        assert not torch.distributed.is_initialized()


def test_an_output_folder_removed_during_the_run_is_one_line_at_the_next_save(tiny_model, games, tmp_path, capsys,
                                                                             monkeypatch):  # noqa: F811
    """The folder goes between the saves of step 1 and step 2 (as an `rm -r` in another shell would)."""
    save = state.Checkpointer.save

    def removed_before_step_2(self, step, *args):
        if step == 2:
            shutil.rmtree(self.root)
        return save(self, step, *args)

    monkeypatch.setattr(state.Checkpointer, "save", removed_before_step_2)
    out = tmp_path / "run"
    code, line = run_here(argv(tiny_model, games, out, "--save_steps", "1"), capsys)
    assert code == 2 and f"--output_dir {out} is gone (removed during the run)" in line, line
    assert not out.exists(), "the save made a new output folder"
