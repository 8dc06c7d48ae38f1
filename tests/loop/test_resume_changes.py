"""--resume honours what the user changes, or refuses it in one line.

A checkpoint is the state of one run: its weights, its Adam moments, its learning-rate schedule
and its place in the data. A resume with another training file, sequence length, warm-up, step
count or model shape would go on as if it were the same run, and silently train something no
command describes. So each of them is refused in one line that names the setting and both values.
The learning rate is the one change a user needs after a divergence: an explicit `--learning_rate`
rescales the saved schedule, in a line that says so, and the steps after it train with it. `--pack`
may change: a step computes the same games, padded or packed, so the run goes on as the same run.

One rank, 64 games, the 64-wide tiny Llama: the checks are about what a checkpoint records.
"""

import json
import shutil

import pytest
from in_process import run_here
from in_process import run_here_in_one_line as run_in_one_line

from minidist import finetune
from minidist.checkpoint import state
from minidist.chess import jsonl
from minidist.chess.games import bundled_games
from minidist.hf.models import write_tiny_gpt2
from minidist.step import lr_schedule

# The full suite only: runs trained, stopped and resumed with changed options.
pytestmark = pytest.mark.slow

GAMES = jsonl.load_games(bundled_games("train"))


@pytest.fixture(scope="module")
def games(tmp_path_factory) -> dict:
    """The training file, and another with the same number of games (the next 64)."""
    root = tmp_path_factory.mktemp("games")
    jsonl.write_games(GAMES[:64], root / "games.jsonl")
    jsonl.write_games(GAMES[64:128], root / "other.jsonl")
    return {"games": str(root / "games.jsonl"), "other": str(root / "other.jsonl")}


def common(model, data, out, *extra) -> list[str]:
    return ["--model", model, "--impl", "torch", "--data", data, "--output_dir", str(out), "--max_steps", "3",
            "--max_seq_length", "48",
            "--eval_prefixes", "0", "--batch_size_per_device", "4", "--warmup_steps", "1", "--seed", "3",
            "--no_save", *extra]


def stopped_after_step_1(argv, stop_file, monkeypatch, capsys) -> None:
    """Run `argv`, stopped after its first step by the stop file (status 75): checkpoint-1 holds it."""
    stop_file.touch()
    monkeypatch.setenv("MINIDIST_STOP_FILE", str(stop_file))
    code, err = run_here(argv, capsys)
    monkeypatch.delenv("MINIDIST_STOP_FILE")
    assert code == 75, err


@pytest.fixture(scope="module")
def llama_run(tiny_model, games, tmp_path_factory):
    """A Llama run of 3 steps at the default learning rate, stopped after step 1 (checkpoint-1)."""
    out = tmp_path_factory.mktemp("llama")
    stop_file = out.parent / f"{out.name}.stop"
    stop_file.touch()
    with pytest.MonkeyPatch.context() as monkeypatch, pytest.raises(SystemExit) as stop:
        monkeypatch.setenv("MINIDIST_STOP_FILE", str(stop_file))
        finetune.main(common(tiny_model, games["games"], out))
    assert stop.value.code == 75
    return out


CHANGES = [
    (["--data", "other"], "training data"),
    (["--max_seq_length", "40"], "another --max_seq_length (48; this run: 40)"),
    (["--warmup_steps", "2"], "another --warmup_steps (1; this run: 2)"),
]


@pytest.mark.parametrize("change, named", CHANGES, ids=["data", "max_seq_length", "warmup_steps"])
def test_a_resume_that_changes_the_batches_or_the_schedule_is_refused_in_one_line(tiny_model, games, llama_run,
                                                                                   capsys, change, named):
    argv = common(tiny_model, games["games"], llama_run, "--resume")
    flag, value = change
    argv[argv.index(flag) + 1] = games.get(value, value)
    code, line = run_in_one_line(argv, capsys)
    assert code == 2, line
    assert f"checkpoint {llama_run / 'checkpoint-1'} was written with another" in line and named in line, line
    assert json.loads((llama_run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 1  # nothing trained


def test_an_explicit_learning_rate_on_resume_rescales_the_schedule_and_says_so(tiny_model, games, tmp_path,
                                                                              monkeypatch, capsys):
    out = tmp_path / "run"
    stopped_after_step_1(common(tiny_model, games["games"], out, "--learning_rate", "2e-3"), tmp_path / "stop",
                         monkeypatch, capsys)
    capsys.readouterr()
    finetune.main(common(tiny_model, games["games"], out, "--resume", "--learning_rate", "5e-4"))  # returns: status 0
    said = capsys.readouterr().out
    assert "--learning_rate 0.0005 on resume: the saved schedule's peak 0.002 is rescaled to it" in said, said
    lrs = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    args = type("Args", (), {"warmup_steps": 1, "max_steps": 3})
    assert lrs[0] == pytest.approx(2e-3 * lr_schedule(0, args.warmup_steps, args.max_steps))  # step 1, before the resume: the old peak
    assert lrs[1:] == pytest.approx([5e-4 * lr_schedule(s, args.warmup_steps, args.max_steps) for s in (1, 2)])  # after it: the new peak


def test_another_max_steps_on_resume_trains_on_to_it_and_says_so(tiny_model, games, tmp_path, monkeypatch, capsys):
    """A 3-step run stopped after steps 1 and 2, resumed with --max_steps 5 (stopped again after
    step 3, then resumed to the end): it says so, trains steps 3 to 5, and from the resumed step on
    its rates are the 5-step schedule's (the cosine decays towards max_steps; with one warm-up step
    the two schedules part from step 3). Asked for fewer steps than its checkpoint has done, a
    resume refuses in one line."""
    out, stop = tmp_path / "run", tmp_path / "stop"
    first = common(tiny_model, games["games"], out, "--learning_rate", "2e-3")
    stopped_after_step_1(first, stop, monkeypatch, capsys)  # checkpoint-1
    stopped_after_step_1([*first, "--resume"], stop, monkeypatch, capsys)  # checkpoint-2
    longer = common(tiny_model, games["games"], out, "--resume")
    longer[longer.index("--max_steps") + 1] = "5"
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as stop_after_one, pytest.raises(SystemExit) as stopped:
        stop.touch()
        stop_after_one.setenv("MINIDIST_STOP_FILE", str(stop))
        finetune.main(longer)  # step 3 only: checkpoint-3
    said = capsys.readouterr().out
    assert stopped.value.code == 75
    assert "--max_steps 5 on resume (the checkpoint's run had 3): training goes on to step 5" in said, said
    finetune.main(longer)  # steps 4 and 5; checkpoint-3 was written with 5: nothing to announce
    lrs = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    three, five = (type("Args", (), {"warmup_steps": 1, "max_steps": n}) for n in (3, 5))
    assert lrs[:2] == pytest.approx([2e-3 * lr_schedule(s, three.warmup_steps, three.max_steps) for s in (0, 1)])  # steps 1, 2: before
    assert lrs[2:] == pytest.approx([2e-3 * lr_schedule(s, five.warmup_steps, five.max_steps) for s in (2, 3, 4)])  # steps 3-5: the new schedule
    assert lr_schedule(2, three.warmup_steps, three.max_steps) != pytest.approx(lr_schedule(2, five.warmup_steps, five.max_steps))  # so the test can tell them apart

    shorter = common(tiny_model, games["games"], out, "--resume", str(out / "checkpoint-3"))
    shorter[shorter.index("--max_steps") + 1] = "2"
    code, line = run_in_one_line(shorter, capsys)
    assert code == 2 and "is already at step 3; pass a --max_steps of at least 3" in line, line


def test_a_resume_without_learning_rate_keeps_the_saved_schedule(tiny_model, games, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    stopped_after_step_1(common(tiny_model, games["games"], out, "--learning_rate", "2e-3"), tmp_path / "stop",
                         monkeypatch, capsys)
    code, err = run_here(common(tiny_model, games["games"], out, "--resume"), capsys)
    assert code == 0, err
    lrs = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    args = type("Args", (), {"warmup_steps": 1, "max_steps": 3})
    assert lrs == pytest.approx([2e-3 * lr_schedule(s, args.warmup_steps, args.max_steps) for s in range(3)])


def test_pack_may_change_on_resume_the_steps_compute_the_same_games(tiny_model, games, tmp_path, monkeypatch,
                                                                    capsys):
    """A run stopped after step 1 without --pack, resumed with it: steps 2 and 3 take the same games
    (the sampler's place is in the checkpoint) and their losses are those of the same resume without
    --pack, up to the order of the sums (packed rows add the same terms in another order)."""
    def argv(out, *extra):  # games of up to 96 tokens: few are cut, so rows of several games pad less
        line = common(tiny_model, games["games"], out, *extra)
        line[line.index("--max_seq_length") + 1] = "96"
        return line

    padded = tmp_path / "padded"
    stopped_after_step_1(argv(padded), tmp_path / "stop", monkeypatch, capsys)
    packed = tmp_path / "packed"
    shutil.copytree(padded, packed)
    for out, extra in ((padded, []), (packed, ["--pack"])):
        code, err = run_here(argv(out, "--resume", *extra), capsys)
        assert code == 0, err
    records = {out: [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
               for out in (padded, packed)}
    assert [r["step"] for r in records[packed]] == [1, 2, 3]
    assert [r["tokens"] for r in records[packed]] == [r["tokens"] for r in records[padded]]  # the same games
    assert [r["loss"] for r in records[packed]] == pytest.approx([r["loss"] for r in records[padded]], rel=1e-5)
    assert sum(r["padded_tokens"] for r in records[packed]) < sum(r["padded_tokens"] for r in records[padded])


def test_a_wider_gpt2_is_refused_in_one_line_naming_its_size(games, tmp_path, monkeypatch, capsys):
    """GPT-2's config names its sizes n_embd, n_layer, n_head: they are fingerprinted too."""
    narrow, wide = write_tiny_gpt2(tmp_path / "narrow", hidden_size=32), write_tiny_gpt2(tmp_path / "wide")
    out = tmp_path / "run"
    stopped_after_step_1(common(str(narrow), games["games"], out), tmp_path / "stop", monkeypatch, capsys)
    code, line = run_in_one_line(common(str(wide), games["games"], out, "--resume"), capsys)
    assert code == 2, line
    assert "n_embd 32" in line and "this run: " in line and "n_embd 64" in line, line


def test_a_checkpoint_from_before_these_were_recorded_is_refused_in_one_line(llama_run, tmp_path):
    """A checkpoint whose manifest lacks the data's hash and the schedule's settings (as minidist wrote
    them before) cannot be checked: refused, naming what it lacks, rather than resumed on trust."""
    old = tmp_path / "checkpoint-1"
    shutil.copytree(llama_run / "checkpoint-1", old)
    meta = json.loads((old / "checkpoint.json").read_text())
    run = dict(meta["run"])
    for key in ("data", "max_seq_length", "warmup_steps", "max_steps"):
        del meta["run"][key]
    del meta["manifest_checksum"]
    meta["manifest_checksum"] = state._manifest_checksum(meta)
    (old / "checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="written by an older minidist, which did not record its data, "
                                         "max_seq_length, warmup_steps;"):
        state.verify(old, run)
