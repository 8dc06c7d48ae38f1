"""The end of a run is covered too: a stop during the final evaluation or the final model write.

After its last step a run still evaluates the model (8-18 s on 2 CPU cores at the default 200
prefixes) and writes it. A scheduler's SIGTERM can come in that window as in any other. It must
mean what it means during the steps: a checkpoint of the last step, saved or kept, and status
75; `--resume` then does only what was left, the evaluation and the model write, and not another
training step. Both runs here keep the default `--save_steps 0`, where no checkpoint existed before
the stop: a run killed in that window loses every step. MINIDIST_PAUSE_AT holds the ranks at the
start of the evaluation (eval:2) or of the write (write:2) until the signal comes, so nothing is
left to timing.
"""

import json
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from minidist.checkpoint import output_dir, preemption
from minidist.runtime.launch import launch
from in_process import run_here
from interrupted import few_games, interrupt_one_process, interrupt_with_torchrun
from train_workers import run_finetune


@pytest.fixture(scope="module")
def games(tmp_path_factory) -> Path:
    return few_games(tmp_path_factory.mktemp("games"))


@pytest.fixture
def args(tiny_model, games):
    def make(out, *extra):  # two steps, a short evaluation, the model written: the default --save_steps 0
        return ["--model", tiny_model, "--impl", "torch", "--data", str(games), "--output_dir", str(out),
                "--max_steps", "2", "--max_seq_length", "48", "--eval_prefixes", "8", "--batch_size_per_device", "2",
                "--warmup_steps", "1", "--seed", "3", *extra]
    return make


def steps_logged(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def stopped_with_checkpoint_2(out: Path) -> None:
    """What a stop in the final window leaves: checkpoint-2 named by `latest`, the two steps logged,
    no lock and nothing half-written."""
    assert (out / "latest").read_text() == "checkpoint-2\n"
    assert steps_logged(out) == [1, 2]
    assert not (out / output_dir.LOCK).exists() and not list(out.glob("*.tmp"))


def finished_without_a_step(out: Path) -> None:
    """A resumed run that only evaluated and wrote the model: no step logged beyond the two."""
    assert steps_logged(out) == [1, 2]
    assert (out / "model" / "config.json").exists()
    assert json.loads((out / "eval.json").read_text())["rate_after"] is not None
    assert not (out / output_dir.LOCK).exists()


def test_a_stop_during_the_final_evaluation_saves_exits_75_and_resume_only_evaluates_and_writes(
        args, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    first = interrupt_one_process(args(out), tmp_path / "run.log", signal.SIGTERM, "eval:2")
    assert first["returncode"] == preemption.EXIT_STOPPED, first["log"][-3000:]
    assert f"stopped by SIGTERM during the evaluation after step 2: saved {out / 'checkpoint-2'}" in first["log"]
    stopped_with_checkpoint_2(out)
    assert not (out / "model").exists()

    # Stopped again in the window of the resumed run (by the stop file, from the start): the
    # checkpoint of step 2 is there already, and is kept, not saved a second time.
    stop_file = tmp_path / "stop-requested"
    stop_file.touch()
    monkeypatch.setenv(preemption.STOP_FILE, str(stop_file))
    code, err = run_here(args(out, "--resume"), capsys)
    assert code == preemption.EXIT_STOPPED, err[-3000:]
    assert f"during the evaluation after step 2: kept {out / 'checkpoint-2'}" in err
    stopped_with_checkpoint_2(out)

    monkeypatch.delenv(preemption.STOP_FILE)
    code, err = run_here(args(out, "--resume"), capsys)
    assert code == 0, err[-3000:]
    finished_without_a_step(out)


def test_a_stop_during_the_final_model_write_on_2_ranks_saves_exits_75_and_resume_finishes(args, tmp_path):
    """On the hand-written FSDP, whose units the evaluation gathered and the write gathered again: the
    checkpoint saved after them holds the weights of step 2, and the resumed run writes them again."""
    out = tmp_path / "out"
    first = interrupt_with_torchrun(args(out, "--impl", "minidist", "--strategy", "fsdp"), tmp_path / "torchrun.log",
                                    signal.SIGTERM, "write:2")
    said = f"stopped by SIGTERM during the final model write after step 2: saved {out / 'checkpoint-2'}"
    assert first["log"].count(said) == 1, first["log"][-3000:]
    assert f"exiting with status {preemption.EXIT_STOPPED}" in first["log"]
    stopped_with_checkpoint_2(out)
    written = load_file(out / "model" / "model.safetensors")  # the write the signal found under way was finished

    resumed = launch(run_finetune, 2, args(out, "--impl", "minidist", "--strategy", "fsdp", "--resume"), timeout_s=300)
    assert all("stopped" not in result for result in resumed)
    assert len(resumed[0]["losses"]) == 2  # the two steps' losses, from the checkpoint
    finished_without_a_step(out)
    for name, tensor in written.items():
        assert torch.equal(resumed[0]["parameters"][name].to(tensor.dtype), tensor), name
