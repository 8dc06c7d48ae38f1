"""Checkpoints of a pipeline (issue 33, point 7; `minidist/parallel/pipeline/checkpoint.py`).

Sharded: a pp 2 run saved at step 2 and resumed from there ends bitwise where an uninterrupted run
ends (the losses of steps 3 and 4, every final weight), for the hand-written DDP and ZeRO-1. A DDP
stage's tensors are whole and keyed by the whole model's names, so DCP reshards its checkpoint by
itself: resumed without a pipeline it ends within 1e-5 of the uninterrupted run. Full: the stages
joined on rank 0, as a run without a pipeline writes them, so a pp 2 checkpoint resumes at pp 1 and
a pp 1 checkpoint at pp 2, within 1e-5 (not bitwise: pp 1 accumulates the micro-batches' gradients
in another order). ZeRO-1's flats are its stage's buckets: another layout is refused in one line.

All runs in one launch of 2 ranks, one after the other (the tiny 2-layer model: pp 2 is one layer
per stage); pp 1 runs are 2 data-parallel ranks of 1 sequence, pp 2 runs 2 micro-batches of 1.
"""

import shutil
from types import SimpleNamespace

import pytest
import torch
from interrupted import few_games
from test_tensor_parallel_checkpoints import assert_same  # losses and weights: bitwise, or within 1e-5
from train_workers import run_finetunes_then_refusal

from minidist.parallel.pipeline.checkpoint import check_layout
from minidist.runtime.errors import UsageError
from minidist.runtime.launch import launch


def args(model, games, out, strategy, pp, *extra):
    """4 steps of the minidist strategy at pp size `pp` on 2 ranks, global batch 2."""
    return ["--model", model, "--data", games, "--output_dir", str(out), "--impl", "minidist", "--strategy", strategy,
            "--max_steps", "4", "--max_seq_length", "48", "--eval_prefixes", "0", "--batch_size_per_device", "1",
            "--gradient_accumulation_steps", str(pp), "--learning_rate", "3e-3", "--warmup_steps", "2", "--seed", "3",
            *(["--pp_size", str(pp)] if pp > 1 else []), *extra]


SAVE = ("--save_steps", "2")
FULL = ("--save_steps", "2", "--checkpoint_format", "full")


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """Every run, by name, and the line the last one (refused) says on each rank."""
    root = tmp_path_factory.mktemp("pp-checkpoints")
    games = str(few_games(root))  # 64 games: 4 steps of 2 draw 8

    def run(name, strategy, pp, *extra):
        return args(tiny_model, games, root / name, strategy, pp, *extra)

    def resume(name):  # --resume from step 2 of run `name`
        return ("--resume", str(root / name / "checkpoint-2"))

    batch = {
        "ddp pp 2 full": run("ddp-pp2-full", "ddp", 2, *FULL),  # uninterrupted: the reference
        "ddp pp 1 full": run("ddp-pp1-full", "ddp", 1, *FULL),
        "ddp pp 2 sharded": run("ddp-pp2-sharded", "ddp", 2, *SAVE),
        "ddp pp 2 sharded resumed": run("ddp-pp2-sharded", "ddp", 2, *SAVE, *resume("ddp-pp2-sharded")),
        "ddp sharded pp 2 at pp 1": run("ddp-sharded-at-pp1", "ddp", 1, *resume("ddp-pp2-sharded")),
        "ddp full pp 2 at pp 1": run("ddp-full-at-pp1", "ddp", 1, *resume("ddp-pp2-full")),
        "ddp full pp 1 at pp 2": run("ddp-full-at-pp2", "ddp", 2, *resume("ddp-pp1-full")),
        "zero1 pp 2 sharded": run("zero1-pp2-sharded", "zero1", 2, *SAVE),
        "zero1 pp 2 sharded resumed": run("zero1-pp2-sharded", "zero1", 2, *SAVE, *resume("zero1-pp2-sharded")),
    }
    refused = run("zero1-at-pp1", "zero1", 1, *resume("zero1-pp2-sharded"))  # last, on the same ranks
    by_rank = launch(run_finetunes_then_refusal, 2, list(batch.values()), refused, timeout_s=600)
    results = dict(zip(batch, by_rank[0][0]))
    results["zero1 sharded pp 2 at pp 1"] = [line for _, line in by_rank]
    yield results
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_a_sharded_checkpoint_of_a_pipeline_resumes_bitwise(runs, strategy):
    reference = runs["ddp pp 2 full"] if strategy == "ddp" else runs["zero1 pp 2 sharded"]  # uninterrupted
    assert runs[f"{strategy} pp 2 sharded resumed"]["losses"][:2] == reference["losses"][:2]  # the checkpoint's records
    assert_same(runs[f"{strategy} pp 2 sharded"], reference)
    assert_same(runs[f"{strategy} pp 2 sharded resumed"], reference)


def test_dcp_reshards_a_ddp_pipeline_checkpoint_to_pp_1(runs):
    assert_same(runs["ddp sharded pp 2 at pp 1"], runs["ddp pp 2 full"], exact=False)


@pytest.mark.parametrize("saved, resumed", [(2, 1), (1, 2)])
def test_a_full_checkpoint_resumes_at_another_pp_size(runs, saved, resumed):
    run, written = runs[f"ddp full pp {saved} at pp {resumed}"], runs[f"ddp pp {saved} full"]
    assert run["losses"][:2] == written["losses"][:2]  # the checkpoint's own records
    assert_same(run, runs["ddp pp 2 full"], exact=False)


def test_a_sharded_zero1_checkpoint_of_another_layout_is_refused_in_one_line():
    check_layout(torch.tensor([2, 1]), SimpleNamespace(pp_size=2, size=1))
    with pytest.raises(UsageError, match=r"written at --pp_size 2 on 1 data-parallel ranks, and this run has 4 on 1"):
        check_layout(torch.tensor([2, 1]), SimpleNamespace(pp_size=4, size=1))
    with pytest.raises(UsageError, match=r"written at --pp_size 2 on 1 data-parallel ranks, and this run has 2 on 2"):
        check_layout(torch.tensor([2, 1]), SimpleNamespace(pp_size=2, size=2))


def test_a_sharded_zero1_checkpoint_resumed_without_a_pipeline_is_refused_in_one_line(runs):
    lines = runs["zero1 sharded pp 2 at pp 1"]
    assert len(set(lines)) == 1 and lines[0] is not None, lines  # every rank, the same line
    # DCP's planner stops first here: the pp 1 run's first flat holds the whole model's first bucket.
    assert "holds tensors of other shapes than this run's (Size mismatch between saved" in lines[0], lines[0]
    assert "\n" not in lines[0]


@pytest.mark.parametrize("impl, strategy, form", [("torch", "fsdp", "sharded"), ("minidist", "zero1", "full")])
def test_the_checkpoints_not_built_are_refused_in_one_line(impl, strategy, form):
    from minidist.finetune import _check_pipeline
    from minidist.hf.lora import LoraOptions

    built = SimpleNamespace(impl="minidist", strategy="ddp", tp_size=1, save_steps=2, resume=None, checkpoint_format=form)
    _check_pipeline(built, LoraOptions())
    with pytest.raises(ValueError, match=r"^checkpoints of a pipeline \(--pp_size\) are built for --impl minidist"):
        _check_pipeline(SimpleNamespace(**{**vars(built), "impl": impl, "strategy": strategy}), LoraOptions())
