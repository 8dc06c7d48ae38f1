"""Checkpoints of a pipeline (issue 33, point 7; `minidist/parallel/pipeline/checkpoint.py`).

Sharded: a pp 2 run saved at step 2 and resumed from there ends bitwise where an uninterrupted run
ends (the losses of steps 3 and 4, every final weight), for the hand-written DDP (also pp 2 x tp 2),
ZeRO-1 and PyTorch's FSDP2 (pp 2 x 2 data-parallel ranks). A DDP stage's tensors are whole and keyed
by the whole model's names, so DCP reshards its checkpoint by itself: resumed without a pipeline it
ends within 1e-5 of the uninterrupted run. Full: the stages joined on rank 0, as a run without a
pipeline writes them, so a pp 2 checkpoint resumes at pp 1 and a pp 1 checkpoint at pp 2, within
1e-5 (not bitwise: pp 1 accumulates the micro-batches' gradients in another order), for DDP and for
ZeRO-1, whose full checkpoint lays the moments out in the buckets of a run without a pipeline. With
--tp_size 2: a pp 2 x tp 2 checkpoint resumes at pp 1 x tp 2, and a pp 2 one at pp 2 x tp 2; and
PyTorch's FSDP2: a pp 2 checkpoint, the stages joined, resumes at pp 1. The hand-written FSDP (pp 2
x 2 data-parallel ranks): sharded, bitwise; full, its stages' units laid out again as a pp 1 run's,
resumed at pp 1 and at pp 2. PyTorch's pp 2 x tp 2 x FSDP2 1: sharded, bitwise; full, resumed at pp
1 x tp 2, saved there at step 3 and resumed from that at pp 2 x tp 2. The hand FSDP at pp 2 x tp 2:
sharded, bitwise, and within 1e-5 of PyTorch's; full (each stage's flats of slices joined over tp,
then over the stages, laid out as a pp 1 x tp 1 run's units), resumed at pp 1 x tp 1 (4 data-parallel
ranks) and at pp 2 x tp 2, both within 1e-5 (4 micro-batches: the same global batch of 4). A sharded
ZeRO-1 checkpoint's flats are its stage's buckets: another layout is refused in one line. No
pipeline checkpoint is refused by `finetune._check_pipeline` any more.

One launch per world size, the runs one after the other (the tiny 2-layer model: pp 2 is one layer
per stage): 2 ranks, where pp 1 runs are 2 data-parallel ranks of 1 sequence and pp 2 runs 2
micro-batches of 1; then 4 ranks (`runs4`), for pp 2 x tp 2 and FSDP (by hand, FSDP2) over 2
data-parallel ranks.
"""

import shutil
from types import SimpleNamespace

import pytest
import torch
from interrupted import few_games
from test_tensor_parallel_checkpoints import assert_same  # losses and weights: bitwise, or within 1e-5
from train_workers import run_finetunes, run_finetunes_then_refusal

from minidist.strategy.state.pipeline import check_layout
from minidist.runtime.errors import UsageError
from minidist.runtime.launch import launch

# The full suite only: checkpoints of every pipeline layout, saved and loaded in several launches.
pytestmark = pytest.mark.slow


def args(model, games, out, strategy, pp, *extra, impl="minidist", tp=1):
    """4 steps of the strategy at pp size `pp` (and tp size `tp`), micro-batches of 1 sequence, `pp`
    of them: global batch 2 on 2 ranks (and on 4 with --tp_size 2), 4 on 4 ranks without it."""
    return ["--model", model, "--data", games, "--output_dir", str(out), "--impl", impl, "--strategy", strategy,
            "--max_steps", "4", "--max_seq_length", "48", "--eval_prefixes", "0", "--batch_size_per_device", "1",
            "--gradient_accumulation_steps", str(pp), "--learning_rate", "3e-3", "--warmup_steps", "2", "--seed", "3",
            *(["--pp_size", str(pp)] if pp > 1 else []), *(["--tp_size", str(tp)] if tp > 1 else []), *extra]


SAVE = ("--save_steps", "2")
FULL = ("--save_steps", "2", "--checkpoint_format", "full")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The runs' folders, shared by the two launches: the 4-rank one resumes a 2-rank checkpoint."""
    root = tmp_path_factory.mktemp("pp-checkpoints")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def resume(root, name):
    """--resume from step 2 of run `name`."""
    return ("--resume", str(root / name / "checkpoint-2"))


@pytest.fixture(scope="module")
def runs(tiny_model, root):
    """Every 2-rank run, by name, and the line the last one (refused) says on each rank."""
    games = str(few_games(root))  # 64 games: 4 steps of 2 (runs4: 4) draw 8 (16)

    def run(name, strategy, pp, *extra):
        return args(tiny_model, games, root / name, strategy, pp, *extra)

    batch = {
        "ddp pp 2 full": run("ddp-pp2-full", "ddp", 2, *FULL),  # uninterrupted: the reference
        "ddp pp 1 full": run("ddp-pp1-full", "ddp", 1, *FULL),
        "ddp pp 2 sharded": run("ddp-pp2-sharded", "ddp", 2, *SAVE),
        "ddp pp 2 sharded resumed": run("ddp-pp2-sharded", "ddp", 2, *SAVE, *resume(root, "ddp-pp2-sharded")),
        "ddp sharded pp 2 at pp 1": run("ddp-sharded-at-pp1", "ddp", 1, *resume(root, "ddp-pp2-sharded")),
        "ddp full pp 2 at pp 1": run("ddp-full-at-pp1", "ddp", 1, *resume(root, "ddp-pp2-full")),
        "ddp full pp 1 at pp 2": run("ddp-full-at-pp2", "ddp", 2, *resume(root, "ddp-pp1-full")),
        "zero1 pp 2 sharded": run("zero1-pp2-sharded", "zero1", 2, *SAVE),
        "zero1 pp 2 sharded resumed": run("zero1-pp2-sharded", "zero1", 2, *SAVE, *resume(root, "zero1-pp2-sharded")),
        "zero1 pp 2 full": run("zero1-pp2-full", "zero1", 2, *FULL),
        "zero1 pp 1 full": run("zero1-pp1-full", "zero1", 1, *FULL),
        "zero1 full pp 2 at pp 1": run("zero1-full-at-pp1", "zero1", 1, *resume(root, "zero1-pp2-full")),
        "zero1 full pp 1 at pp 2": run("zero1-full-at-pp2", "zero1", 2, *resume(root, "zero1-pp1-full")),
    }
    refused = run("zero1-at-pp1", "zero1", 1, *resume(root, "zero1-pp2-sharded"))  # last, on the same ranks
    by_rank = launch(run_finetunes_then_refusal, 2, list(batch.values()), refused, timeout_s=600)
    results = dict(zip(batch, by_rank[0][0]))
    results["zero1 sharded pp 2 at pp 1"] = [line for _, line in by_rank]
    return results


@pytest.fixture(scope="module")
def runs4(tiny_model, root, runs):
    """Every 4-rank run, by name: pp 2 x tp 2 with the hand-written DDP (global batch 2, as the 2-rank
    runs, whose pp 2 full checkpoint it resumes at tp 2), and pp 2 x PyTorch's FSDP2 over 2 ranks
    (global batch 4)."""
    games = str(root / "games.jsonl")
    torch_tp = {"impl": "torch", "tp": 2}  # PyTorch's pp 2 x tp 2 x FSDP2 1 (global batch 2)
    m4 = ("--gradient_accumulation_steps", "4")  # pp 2 x tp 2 with global batch 4, as pp 1 on 4 ranks

    def run(name, strategy, pp, *extra, impl="minidist", tp=1):
        return args(tiny_model, games, root / name, strategy, pp, *extra, impl=impl, tp=tp)

    batch = {
        "ddp pp 2 x tp 2 full": run("ddp-pp2-tp2-full", "ddp", 2, *FULL, tp=2),  # uninterrupted: the reference
        "ddp pp 2 x tp 2 sharded": run("ddp-pp2-tp2-sharded", "ddp", 2, *SAVE, tp=2),
        "ddp pp 2 x tp 2 sharded resumed": run("ddp-pp2-tp2-sharded", "ddp", 2, *SAVE, *resume(root, "ddp-pp2-tp2-sharded"),
                                               tp=2),
        "ddp full pp 2 x tp 2 at pp 1 x tp 2": run("ddp-full-at-tp2", "ddp", 1, *resume(root, "ddp-pp2-tp2-full"), tp=2),
        "ddp full pp 2 at pp 2 x tp 2": run("ddp-full-at-pp2-tp2", "ddp", 2, *resume(root, "ddp-pp2-full"), tp=2),
        "fsdp pp 2 full": run("fsdp-pp2-full", "fsdp", 2, *FULL, impl="torch"),  # uninterrupted: the reference
        "fsdp pp 2 sharded": run("fsdp-pp2-sharded", "fsdp", 2, *SAVE, impl="torch"),
        "fsdp pp 2 sharded resumed": run("fsdp-pp2-sharded", "fsdp", 2, *SAVE, *resume(root, "fsdp-pp2-sharded"),
                                         impl="torch"),
        "fsdp full pp 2 at pp 1": run("fsdp-full-at-pp1", "fsdp", 1, *resume(root, "fsdp-pp2-full"), impl="torch"),
        "minidist fsdp pp 2 full": run("hfsdp-pp2-full", "fsdp", 2, *FULL),  # uninterrupted: the reference
        "minidist fsdp pp 2 sharded": run("hfsdp-pp2-sharded", "fsdp", 2, *SAVE),
        "minidist fsdp pp 2 sharded resumed": run("hfsdp-pp2-sharded", "fsdp", 2, *SAVE,
                                                  *resume(root, "hfsdp-pp2-sharded")),
        "minidist fsdp full pp 2 at pp 1": run("hfsdp-full-at-pp1", "fsdp", 1, *resume(root, "hfsdp-pp2-full")),
        "minidist fsdp full pp 2 at pp 2": run("hfsdp-full-at-pp2", "fsdp", 2, *resume(root, "hfsdp-pp2-full")),
        "fsdp pp 2 x tp 2 full": run("fsdp-pp2-tp2-full", "fsdp", 2, *FULL, **torch_tp),  # uninterrupted
        "fsdp pp 2 x tp 2 sharded": run("fsdp-pp2-tp2-sharded", "fsdp", 2, *SAVE, **torch_tp),
        "fsdp pp 2 x tp 2 sharded resumed": run("fsdp-pp2-tp2-sharded", "fsdp", 2, *SAVE,
                                                *resume(root, "fsdp-pp2-tp2-sharded"), **torch_tp),
        "minidist fsdp pp 2 x tp 2 sharded": run("hfsdp-pp2-tp2-sharded", "fsdp", 2, *SAVE, tp=2),
        "minidist fsdp pp 2 x tp 2 sharded resumed": run("hfsdp-pp2-tp2-sharded", "fsdp", 2, *SAVE,
                                                         *resume(root, "hfsdp-pp2-tp2-sharded"), tp=2),
        # the hand FSDP's full form under pp x tp: resumed at pp 1 x tp 1 (4 data-parallel ranks) and pp 2 x tp 2
        "minidist fsdp pp 2 x tp 2 full": run("hfsdp-pp2-tp2-full", "fsdp", 2, *FULL, *m4, tp=2),  # uninterrupted
        "minidist fsdp full pp 2 x tp 2 at pp 1": run("hfsdp-full-tp2-at-pp1", "fsdp", 1,
                                                      *resume(root, "hfsdp-pp2-tp2-full")),
        "minidist fsdp full pp 2 x tp 2 at pp 2 x tp 2": run("hfsdp-full-tp2-at-pp2-tp2", "fsdp", 2, *m4,
                                                             *resume(root, "hfsdp-pp2-tp2-full"), tp=2),
        # at pp 1 x tp 2 (2 data-parallel ranks), saved full at step 3 there, resumed from it at pp 2 x tp 2
        "fsdp full pp 2 x tp 2 at pp 1 x tp 2": run("fsdp-full-at-tp2", "fsdp", 1, "--save_steps", "3",
                                                    "--checkpoint_format", "full",
                                                    *resume(root, "fsdp-pp2-tp2-full"), **torch_tp),
        "fsdp full pp 1 x tp 2 at pp 2 x tp 2": run("fsdp-full-at-pp2-tp2", "fsdp", 2,
                                                    "--resume", str(root / "fsdp-full-at-tp2" / "checkpoint-3"),
                                                    **torch_tp),
    }
    return dict(zip(batch, launch(run_finetunes, 4, list(batch.values()), timeout_s=600)[0]))


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_a_sharded_checkpoint_of_a_pipeline_resumes_bitwise(runs, strategy):
    reference = runs["ddp pp 2 full"] if strategy == "ddp" else runs["zero1 pp 2 sharded"]  # uninterrupted
    assert runs[f"{strategy} pp 2 sharded resumed"]["losses"][:2] == reference["losses"][:2]  # the checkpoint's records
    assert_same(runs[f"{strategy} pp 2 sharded"], reference)
    assert_same(runs[f"{strategy} pp 2 sharded resumed"], reference)


def test_dcp_reshards_a_ddp_pipeline_checkpoint_to_pp_1(runs):
    assert_same(runs["ddp sharded pp 2 at pp 1"], runs["ddp pp 2 full"], exact=False)


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
@pytest.mark.parametrize("saved, resumed", [(2, 1), (1, 2)])
def test_a_full_checkpoint_resumes_at_another_pp_size(runs, strategy, saved, resumed):
    run, written = runs[f"{strategy} full pp {saved} at pp {resumed}"], runs[f"{strategy} pp {saved} full"]
    assert run["losses"][:2] == written["losses"][:2]  # the checkpoint's own records
    assert_same(run, runs[f"{strategy} pp 2 full"], exact=False)
    assert_same(runs[f"{strategy} pp 2 full"], runs["ddp pp 2 full"], exact=False)  # ZeRO-1: the same run as DDP


@pytest.mark.parametrize("layout", ["ddp pp 2 x tp 2", "fsdp pp 2", "minidist fsdp pp 2", "fsdp pp 2 x tp 2"])
def test_a_sharded_checkpoint_of_pp_x_tp_or_fsdp_resumes_bitwise(runs4, layout):
    reference = runs4[f"{layout} full"]  # uninterrupted
    assert runs4[f"{layout} sharded resumed"]["losses"][:2] == reference["losses"][:2]  # the checkpoint's records
    assert_same(runs4[f"{layout} sharded"], reference)
    assert_same(runs4[f"{layout} sharded resumed"], reference)


@pytest.mark.parametrize("resumed, written, reference", [
    ("ddp full pp 2 x tp 2 at pp 1 x tp 2", "ddp pp 2 x tp 2 full", "ddp pp 2 x tp 2 full"),  # another pp size
    ("ddp full pp 2 at pp 2 x tp 2", "ddp pp 2 full", "ddp pp 2 full"),  # another tp size (a 2-rank checkpoint)
    ("fsdp full pp 2 at pp 1", "fsdp pp 2 full", "fsdp pp 2 full"),  # FSDP2: the stages joined, loaded without them
    # the hand FSDP: its stages' units laid out again as a pp 1 run's (the roots joined), loaded at pp 1 and pp 2
    ("minidist fsdp full pp 2 at pp 1", "minidist fsdp pp 2 full", "minidist fsdp pp 2 full"),
    ("minidist fsdp full pp 2 at pp 2", "minidist fsdp pp 2 full", "minidist fsdp pp 2 full"),
    # PyTorch's pp x tp: the stages joined over tp and dp, loaded at pp 1 x tp 2; saved there, loaded at pp 2 x tp 2
    ("fsdp full pp 2 x tp 2 at pp 1 x tp 2", "fsdp pp 2 x tp 2 full", "fsdp pp 2 x tp 2 full"),
    ("fsdp full pp 1 x tp 2 at pp 2 x tp 2", "fsdp full pp 2 x tp 2 at pp 1 x tp 2", "fsdp pp 2 x tp 2 full"),
    # the hand FSDP's pp x tp: each stage's flats of slices joined over tp and the stages, laid out as a pp 1 x tp 1
    # run's units; loaded at pp 1 x tp 1 (4 data-parallel ranks) and at pp 2 x tp 2 (each rank its slices' shards)
    ("minidist fsdp full pp 2 x tp 2 at pp 1", "minidist fsdp pp 2 x tp 2 full", "minidist fsdp pp 2 x tp 2 full"),
    ("minidist fsdp full pp 2 x tp 2 at pp 2 x tp 2", "minidist fsdp pp 2 x tp 2 full",
     "minidist fsdp pp 2 x tp 2 full"),
])
def test_a_full_checkpoint_of_pp_x_tp_or_fsdp_resumes_at_another_layout(runs, runs4, resumed, written, reference):
    every = {**runs, **runs4}
    assert every[resumed]["losses"][:2] == every[written]["losses"][:2]  # the checkpoint's own records
    assert_same(every[resumed], every[reference], exact=False)


def test_a_sharded_checkpoint_of_pp_x_tp_x_the_hand_fsdp_resumes_bitwise(runs4):
    """Each stage's flats of slices on the stage's own (dp, tp) grid (`flat_state.stage_grid`)."""
    run, resumed = runs4["minidist fsdp pp 2 x tp 2 sharded"], runs4["minidist fsdp pp 2 x tp 2 sharded resumed"]
    assert resumed["losses"][:2] == run["losses"][:2]  # the checkpoint's records
    assert_same(resumed, run)
    assert_same(run, runs4["fsdp pp 2 x tp 2 full"], exact=False)  # PyTorch's pp 2 x tp 2: the same training


def test_a_sharded_zero1_checkpoint_of_another_layout_is_refused_in_one_line():
    check_layout(torch.tensor([2, 1]), SimpleNamespace(pp_size=2, dp_size=1))
    with pytest.raises(UsageError, match=r"written at --pp_size 2 on 1 data-parallel ranks, and this run has 4 on 1"):
        check_layout(torch.tensor([2, 1]), SimpleNamespace(pp_size=4, dp_size=1))
    with pytest.raises(UsageError, match=r"written at --pp_size 2 on 1 data-parallel ranks, and this run has 2 on 2"):
        check_layout(torch.tensor([2, 1]), SimpleNamespace(pp_size=2, dp_size=2))


def test_a_sharded_zero1_checkpoint_resumed_without_a_pipeline_is_refused_in_one_line(runs):
    lines = runs["zero1 sharded pp 2 at pp 1"]
    assert len(set(lines)) == 1 and lines[0] is not None, lines  # every rank, the same line
    # Refused before DCP reads anything: the checkpoint recorded a pipeline's layout, this run has none.
    assert "written with --pp_size above 1, and this run has neither --tp_size nor --pp_size above 1" in lines[0], \
        lines[0]
    assert "resumes at its own layout only" in lines[0], lines[0]
    assert "\n" not in lines[0]


BUILT = [("minidist", "ddp", 2, "full"), ("minidist", "zero1", 1, "full"), ("minidist", "fsdp", 1, "full"),
         ("minidist", "fsdp", 2, "sharded"), ("minidist", "fsdp", 2, "full"), ("torch", "fsdp", 2, "full")]


def test_no_checkpoint_of_a_pipeline_is_refused():
    """Every form is built, the hand FSDP's full one under pp x tp last (it was refused): each passes."""
    from minidist.finetune import _check_pipeline
    from minidist.hf.lora import LoraOptions

    def check(impl, strategy, tp, form):
        _check_pipeline(SimpleNamespace(impl=impl, strategy=strategy, tp_size=tp, checkpoint_format=form, save_steps=2,
                                        resume=None, pp_size=2, gradient_accumulation_steps=2), LoraOptions())

    for built in BUILT:
        check(*built)
