"""Checkpoints: a run killed by a real signal resumes exactly; a broken checkpoint is refused.

The interrupted runs are stopped by real signals sent to their processes: SIGKILL (a crash, an
OOM kill, a node gone) in the middle of a save, or SIGTERM (what a scheduler sends before it
kills). One of them is started with torchrun, as on a cluster, and its SIGTERM goes to torchrun,
which forwards it to its workers (`TORCHRUN`); the others run in the ranks of a
`minidist.runtime.launch` (forked from its fork server, without the fresh interpreters that a
torchrun costs), and the test sends the signal to every rank itself, as SLURM signals every task
of a job step. Either way each rank runs the training script's `main`, as a torchrun worker does.
The fault hook MINIDIST_PAUSE_AT holds every rank at a chosen point until the signal comes, so the
tests do not race the training. The resumed runs go through `minidist.runtime.launch`, which
returns what each rank measured, and are compared with an uninterrupted run of the same strategy:
bitwise.
"""

import json
import os
import random
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from interrupted import few_games, interrupt_with_torchrun, wait_until_gone
from signalled_workers import run_until_signalled
from train_workers import run_finetunes

from minidist import finetune
from minidist.checkpoint import preemption, state
from minidist.hf.models import load_model, load_tokenizer, write_tiny_llama
from minidist.strategy.options import ParallelOptions
from minidist.strategy import get_strategy
from minidist.runtime.distributed import cleanup, init_distributed
from minidist.runtime.launch import RankFailed, launch

# The full suite only: fault injection: real runs killed and resumed, in several launches.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# How each strategy's first run ends, and the checkpoint form it writes. Every run saves at
# step 4; SIGKILL comes in the middle of step 8's save, SIGTERM after step 6.
CASES = {
    ("torch", "ddp"): ("full", signal.SIGTERM),
    ("torch", "fsdp"): ("sharded", signal.SIGKILL),
    ("minidist", "ddp"): ("sharded", signal.SIGKILL),
    # The hand-written sharded strategies hand out flat shards (minidist/parallel/flat_state.py).
    ("minidist", "fsdp"): ("sharded", signal.SIGKILL),
    ("minidist", "zero2"): ("full", signal.SIGTERM),
}
# The first run that torchrun starts (`interrupted.interrupt_with_torchrun`): its SIGTERM goes to
# torchrun, which forwards it to its 2 workers. The others' ranks are a launch's, each signalled by
# the test (`signal_launched_ranks`): a fresh torchrun costs its 3 interpreters' imports.
TORCHRUN = [("torch", "ddp")]


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    """64 of the bundled games for every run here (8 steps of 4 draw 32 of them): otherwise each rank
    of each of the module's 30-odd runs tokenizes all 3,000."""
    return str(few_games(tmp_path_factory.mktemp("games")))


def finetune_args(model, games, out, impl="torch", strategy="fsdp", *extra):
    return ["--model", model, "--data", games, "--output_dir", str(out), "--impl", impl, "--strategy", strategy,
            "--max_steps", "8", "--max_seq_length", "48", "--eval_prefixes", "0", "--batch_size_per_device", "2",
            "--learning_rate", "3e-3", "--warmup_steps", "2", "--seed", "3", *extra]


def metrics_steps(out: Path) -> list:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def saved_by(out: Path, checkpoint: str) -> int:
    """The world size that wrote `checkpoint` in `out`."""
    return json.loads((out / checkpoint / "checkpoint.json").read_text())["world_size"]


# The runs that resume FSDP's sharded checkpoint at another world size, 2 ranks -> 4 -> 2
# (test_a_sharded_checkpoint_resumes_at_another_world_size), by implementation.
ELSEWHERE = ("torch", "minidist")


def elsewhere_args(model, games, out, impl, world_size):
    """4 ranks resume the 2-rank run's checkpoint-4 (a global batch of 4 at 1 per rank); then 2 ranks
    resume the 4-rank run's checkpoint-6."""
    if world_size == 4:
        return finetune_args(model, games, out, impl, "fsdp", "--batch_size_per_device", "1",
                             "--resume", str(out / "checkpoint-4"), "--save_steps", "2")
    return finetune_args(model, games, out, impl, "fsdp", "--resume", str(out / "checkpoint-6"), "--save_steps", "2")


def signal_launched_ranks(argv, log: Path, how: signal.Signals, pause_at: str, timeout_s=240) -> dict:
    """Run the training script with ARGV on the 2 ranks of a `launch`, send `how` to both once both
    paused at `pause_at`, and wait until they are gone. `returncode`: after SIGKILL, the status
    `launch` found the first dead rank with; after SIGTERM, the status the script exited with on
    every rank (they must agree)."""
    ended = {}

    def run():  # in a thread: `launch` returns only when its ranks are gone
        try:
            ended["statuses"] = launch(run_until_signalled, 2, argv, pause_at, str(log), timeout_s=600)
        except RankFailed as failed:
            ended["returncode"], ended["report"] = failed.exitcode, failed.traceback

    log.touch()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    pids, deadline = [], time.monotonic() + timeout_s
    try:
        while len(pids) < 2:
            assert thread.is_alive(), f"the ranks ended before the pause: {ended}\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no pause within {timeout_s} s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
            pids = [int(pid) for pid in re.findall(r"\(pid (\d+)\) paused at", log.read_text())]
        for pid in pids:  # SIGKILL: everything dies at once, as in a crash
            os.kill(pid, how)
        thread.join(timeout=120)
        wait_until_gone(pids)
    finally:
        for pid in pids:  # nothing outlives the test, whatever failed
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not thread.is_alive(), "launch did not return after its ranks were signalled"
    assert how == signal.SIGKILL or "report" not in ended, ended.get("report")  # a stop, not a failure
    if "statuses" in ended:
        assert len(set(ended["statuses"])) == 1, ended["statuses"]
        ended["returncode"] = ended["statuses"][0]
    return {"returncode": ended.get("returncode"), "log": log.read_text(), "report": ended.get("report")}


@pytest.fixture(scope="module")
def runs(tiny_model, games, tmp_path_factory):
    """Per strategy, computed once: the uninterrupted run, and the interrupted-then-resumed one;
    for FSDP, also the runs resumed at another world size (key (impl, "elsewhere")).

    All the uninterrupted runs share one launch, and so do all the resumed ones (one after the
    other in the same two ranks), the 2-rank resumes at another world size included: starting the
    ranks costs more than 8 steps of the tiny model."""
    cache = {}

    def run_all():
        roots = {case: tmp_path_factory.mktemp("-".join(case)) for case in CASES}
        references = launch(run_finetunes, 2, [finetune_args(tiny_model, games, roots[case] / "reference", *case)
                                               for case in CASES], timeout_s=600)[0]
        argvs = {}
        for (impl, strategy), reference in zip(CASES, references):
            form, how = CASES[(impl, strategy)]
            root, out = roots[(impl, strategy)], roots[(impl, strategy)] / "out"
            argvs[(impl, strategy)] = argv = finetune_args(tiny_model, games, out, impl, strategy,
                                                           "--checkpoint_format", form, "--save_steps", "4")
            pause_at = "save:8" if how == signal.SIGKILL else "step:6"
            if (impl, strategy) in TORCHRUN:
                first = interrupt_with_torchrun(argv, root / "torchrun.log", how, pause_at)
            else:
                first = signal_launched_ranks(argv, root / "ranks.log", how, pause_at)
            first["latest"] = (out / "latest").read_text().strip()
            first["folders"] = sorted(p.name for p in out.glob("checkpoint-*"))
            first["metrics_steps"] = metrics_steps(out)
            cache[(impl, strategy)] = {"reference": reference, "first": first, "out": out, "form": form}
        # At another world size: from a copy of checkpoint-4 alone (no metrics.jsonl), 4 ranks, then 2 ranks.
        elsewhere = {impl: tmp_path_factory.mktemp(f"{impl}-elsewhere") / "out" for impl in ELSEWHERE}
        for impl, out in elsewhere.items():
            shutil.copytree(cache[(impl, "fsdp")]["out"] / "checkpoint-4", out / "checkpoint-4")
        four = launch(run_finetunes, 4, [elsewhere_args(tiny_model, games, out, impl, 4) for impl, out in elsewhere.items()],
                      timeout_s=600)[0]
        for (impl, out), result in zip(elsewhere.items(), four):  # what the 4 ranks left, before the 2 resume
            cache[(impl, "elsewhere")] = {"out": out, "four": result, "saved_by": saved_by(out, "checkpoint-6"),
                                          "after_four": sorted(p.name for p in out.glob("checkpoint-*"))}
        resumed = launch(run_finetunes, 2, [argvs[case] + ["--resume"] for case in CASES]
                         + [elsewhere_args(tiny_model, games, out, impl, 2) for impl, out in elsewhere.items()],
                         timeout_s=600)[0]
        for case, result in zip(CASES, resumed):
            cache[case]["resumed"] = result
        for impl, result in zip(ELSEWHERE, resumed[len(CASES):]):
            cache[(impl, "elsewhere")]["two"] = result

    def get(impl, strategy):
        if not cache:
            run_all()
        return cache[(impl, strategy)]

    return get


@pytest.mark.parametrize("impl,strategy", list(CASES))
def test_a_run_killed_by_a_signal_resumes_bitwise(runs, impl, strategy):
    run = runs(impl, strategy)
    first, out = run["first"], run["out"]
    if CASES[(impl, strategy)][1] == signal.SIGKILL:
        # Killed while step 8's shards were on disk but unpublished: latest still names step 4,
        # and the half-written folder is only a .tmp that nothing reads.
        assert first["returncode"] == -signal.SIGKILL, first.get("report")
        assert first["latest"] == "checkpoint-4"
        assert first["folders"] == ["checkpoint-4", "checkpoint-8.tmp"]
        assert first["metrics_steps"] == list(range(1, 9))  # logged before the kill: 5..8 must go
    else:
        # SIGTERM: every rank finished step 6, saved it, and exited with the documented status.
        assert first["returncode"] != 0
        assert "stopped by SIGTERM after step 6: saved" in first["log"]
        assert f"exiting with status {preemption.EXIT_STOPPED}" in first["log"]
        assert first["latest"] == "checkpoint-6"
        assert first["folders"] == ["checkpoint-4", "checkpoint-6"]
        assert first["metrics_steps"] == list(range(1, 7))

    reference, resumed = run["reference"], run["resumed"]
    assert resumed["losses"] == reference["losses"]  # floats compared exactly
    assert resumed["parameters"].keys() == reference["parameters"].keys()
    for name, tensor in reference["parameters"].items():
        assert torch.equal(resumed["parameters"][name], tensor), name
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["loss"] for r in records] == reference["losses"]
    # The resumed run saved step 8 again and kept the newest two (--save_total_limit 2).
    assert (out / "latest").read_text() == "checkpoint-8\n"
    kept = sorted(p.name for p in out.glob("checkpoint-*"))
    assert kept == [first["latest"], "checkpoint-8"]
    if run["form"] == "full":  # a full checkpoint's model is a Hugging Face folder
        from transformers import AutoModelForCausalLM

        saved = AutoModelForCausalLM.from_pretrained(out / "checkpoint-8" / "model")
        for name, tensor in saved.state_dict().items():
            assert torch.equal(tensor, reference["parameters"][name]), name


@pytest.mark.parametrize("impl", ["torch", "minidist"])
def test_a_sharded_checkpoint_resumes_at_another_world_size(runs, impl):
    """2 ranks -> 4 -> 2 with the same global batch of 4: DCP reads each rank's slices (FSDP2's
    tensors, or minidist's flat shards, cut into other slices on 4 ranks than on 2).

    Not bitwise: the gradient is reduced in another order over 4 ranks than over 2. The losses
    must match the uninterrupted 2-rank run to 1e-5, which also shows each resume read the right
    next batch (another batch changes the loss in the second decimal), and the weights to 1% of
    one step, the tolerance of the parity tests in test_finetune.py."""
    run, elsewhere = runs(impl, "fsdp"), runs(impl, "elsewhere")  # the runs, in the fixture's shared launches
    out, four, two = elsewhere["out"], elsewhere["four"], elsewhere["two"]
    assert elsewhere["saved_by"] == 4
    assert elsewhere["after_four"] == ["checkpoint-6", "checkpoint-8"]  # kept 2
    # From step 6 again, while latest names step 8: saving step 8 replaced the 4-rank one.
    assert saved_by(out, "checkpoint-8") == 2
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-6", "checkpoint-8"]
    reference = run["reference"]
    assert four["losses"][:4] == reference["losses"][:4] == two["losses"][:4]  # from the checkpoints' metrics
    torch.testing.assert_close(torch.tensor(four["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
    assert two["losses"][:6] == four["losses"][:6]
    for name, tensor in reference["parameters"].items():
        torch.testing.assert_close(two["parameters"][name], tensor, rtol=1e-5, atol=3e-3 / 100, msg=lambda m: f"{name}: {m}")
    assert metrics_steps(out) == list(range(1, 9))


# ---------------------------------------------------------------- one process, in this one
def refuse(argv, capsys) -> str:
    """Run the training script here; it must stop with status 2 and one line, before the model loads."""
    capsys.readouterr()  # only what the script writes counts
    with pytest.raises(SystemExit) as stop:
        finetune.main(argv)
    assert stop.value.code == 2
    captured = capsys.readouterr()
    assert "parameters |" not in captured.out, "refused only after loading the model"
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


def test_a_broken_or_mismatched_checkpoint_is_refused_in_one_line(runs, tiny_model, games, tmp_path, capsys):
    source = runs("torch", "fsdp")["out"] / "checkpoint-8"  # written by 2 FSDP ranks, global batch 4
    # In one process a batch of 4 per device keeps the global batch of 4.
    args = lambda out, *extra: finetune_args(tiny_model, games, out, "torch", "fsdp", "--batch_size_per_device", "4",
                                             *extra)

    assert "--resume: no checkpoint in" in refuse(args(tmp_path / "empty", "--resume"), capsys)
    dangling = tmp_path / "dangling"
    dangling.mkdir()
    (dangling / "latest").write_text("checkpoint-99\n")
    assert "names checkpoint-99, which does not exist" in refuse(args(dangling, "--resume"), capsys)

    truncated = tmp_path / "truncated" / "checkpoint-8"
    shutil.copytree(source, truncated)
    shard = max((truncated / "dcp").glob("*.distcp"), key=lambda p: p.stat().st_size)
    os.truncate(shard, shard.stat().st_size // 2)
    line = refuse(args(tmp_path, "--resume", str(truncated)), capsys)
    assert f"is damaged: dcp/{shard.name} has" in line

    unfinished = tmp_path / "unfinished" / "checkpoint-8"
    shutil.copytree(source, unfinished)
    (unfinished / "checkpoint.json").unlink()
    assert "is not a complete checkpoint" in refuse(args(tmp_path, "--resume", str(unfinished)), capsys)

    resume = ["--resume", str(source)]
    assert "another strategy (torch/fsdp; this run: torch/ddp)" in refuse(
        finetune_args(tiny_model, games, tmp_path / "o", "torch", "ddp", "--batch_size_per_device", "4", *resume),
        capsys)
    assert "another global batch (4; this run: 2)" in refuse(
        finetune_args(tiny_model, games, tmp_path / "o", "torch", "fsdp", *resume), capsys)
    other = write_tiny_llama(tmp_path / "other-model", hidden_size=32, num_layers=2)
    line = refuse(args(tmp_path / "o", *resume, "--model", str(other)), capsys)
    # every size the config holds, head_dim too (model_fingerprint)
    assert ("another model (head_dim 16, hidden_size 64, intermediate_size 168; this run: head_dim 8, hidden_size 32, "
            "intermediate_size 80)") in line, line


@pytest.fixture
def world_of_one():
    env = init_distributed()
    yield env
    cleanup()


def test_rng_states_latest_pointer_and_the_last_k(tiny_model, tmp_path, world_of_one):
    """Random streams continue where they were; `latest` names the newest; only K are kept."""
    strategy = get_strategy(ParallelOptions("fsdp", "torch"), world_of_one)
    model = strategy.wrap(load_model(tiny_model))
    optimizer = strategy.build_optimizer(model, 1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 4)))
    checkpoints = state.Checkpointer(tmp_path, strategy, model, optimizer, scheduler, run={}, form="full", keep=2,
                                     tokenizer=load_tokenizer(tiny_model))
    drawn = {}
    for step in (1, 2, 3):
        torch.manual_seed(step)
        random.seed(step)
        checkpoints.save(step, (0, 4 * step), metrics, {"rate_before": None})
        drawn[step] = (torch.rand(3), random.random())  # what the run would have drawn next
    assert (tmp_path / "latest").read_text() == "checkpoint-3\n"
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]

    torch.manual_seed(99)
    random.seed(99)
    restored = checkpoints.load(tmp_path / "checkpoint-2")
    assert restored["step"] == 2 and restored["position"] == (0, 8)
    assert [r["step"] for r in restored["records"]] == [1, 2]
    assert torch.equal(torch.rand(3), drawn[2][0]) and random.random() == drawn[2][1]


def test_a_signal_stops_the_run_at_a_step_boundary_with_status_75(tiny_model, games, tmp_path, monkeypatch, capsys):
    """SIGUSR1, as SLURM sends it, to this very process while it trains in one rank."""
    monkeypatch.setenv("MINIDIST_PAUSE_AT", "step:2")
    out = tmp_path / "out"
    before = signal.getsignal(signal.SIGUSR1)

    def send_when_step_2_is_logged():
        log = out / "metrics.jsonl"
        while not log.exists() or log.read_text().count("\n") < 2:  # whole lines only
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)

    threading.Thread(target=send_when_step_2_is_logged, daemon=True).start()
    with pytest.raises(SystemExit) as stop:
        finetune.main(finetune_args(tiny_model, games, out, "torch", "ddp", "--batch_size_per_device", "4"))
    assert stop.value.code == preemption.EXIT_STOPPED == 75
    assert f"stopped by SIGUSR1 after step 2: saved {out / 'checkpoint-2'}" in capsys.readouterr().err
    assert (out / "latest").read_text() == "checkpoint-2\n" and metrics_steps(out) == [1, 2]
    assert signal.getsignal(signal.SIGUSR1) is before  # the handlers are put back


def test_the_stop_file_stops_the_run_like_a_signal(tiny_model, games, tmp_path, monkeypatch, capsys):
    """srun drops a warning that comes before its tasks started; the batch script's stop file
    (MINIDIST_STOP_FILE) stands in for it. Here it exists from the start: the run stops after step 1."""
    out, stop_file = tmp_path / "out", tmp_path / "stop-requested"
    stop_file.touch()
    monkeypatch.setenv(preemption.STOP_FILE, str(stop_file))
    with pytest.raises(SystemExit) as stop:
        finetune.main(finetune_args(tiny_model, games, out, "torch", "ddp", "--batch_size_per_device", "4"))
    assert stop.value.code == preemption.EXIT_STOPPED
    assert f"stopped by the stop file {stop_file} after step 1: saved {out / 'checkpoint-1'}" in capsys.readouterr().err
    assert (out / "latest").read_text() == "checkpoint-1\n" and metrics_steps(out) == [1]
