"""A sharded checkpoint resumed at another layout is refused in one line, on every rank, before DCP
reads it: the layouts it recorded (`strategy/state/__init__.check_recorded_layouts`) are not this run's.

The three cases where one side records a layout and the other none: the hand-written FSDP saved at
--pp_size 2 and resumed at pp 1 (DCP stopped on the missing flats), the hand-written DDP saved
without --tp_size and resumed at --tp_size 2 (DCP stopped on the missing layout), and the same DDP
saved at --tp_size 2 and resumed at tp 1 (DCP read the slices as whole tensors, and trained on).
One launch of 2 ranks, 2 steps each; a full checkpoint is the way to change a layout
(tests/checkpoint/test_tensor_parallel_checkpoints.py and test_pipeline_checkpoints.py).
"""

import pytest
from interrupted import few_games
from train_workers import run_finetunes_then_refusals

from minidist.runtime.launch import launch

# The full suite only: runs that launch ranks, save and resume.
pytestmark = pytest.mark.slow


def args(model, games, out, strategy, pp=1, tp=1, *extra):
    """2 steps on 2 ranks, global batch 2 whatever the layout: micro-batches of 1 sequence, `pp` of
    them per step under a pipeline, 2 sequences per rank at tp 2 (one data-parallel rank)."""
    return ["--model", model, "--data", games, "--output_dir", str(out), "--impl", "minidist", "--strategy", strategy,
            "--max_steps", "2", "--max_seq_length", "48", "--eval_prefixes", "0", "--warmup_steps", "1",
            "--seed", "3", "--batch_size_per_device", str(tp), "--gradient_accumulation_steps", str(pp),
            *(["--pp_size", str(pp)] if pp > 1 else []), *(["--tp_size", str(tp)] if tp > 1 else []), *extra]


@pytest.fixture(scope="module")
def lines(tiny_model, tmp_path_factory):
    """The line each refused resume says on each rank, by case."""
    root = tmp_path_factory.mktemp("layouts")
    games = str(few_games(root))
    saves = {"fsdp pp 2": args(tiny_model, games, root / "fsdp-pp2", "fsdp", 2, 1, "--save_steps", "2"),
             "ddp": args(tiny_model, games, root / "ddp", "ddp", 1, 1, "--save_steps", "2"),
             "ddp tp 2": args(tiny_model, games, root / "ddp-tp2", "ddp", 1, 2, "--save_steps", "2")}
    resumed = {"fsdp pp 2 at pp 1": ("fsdp-pp2", "fsdp", 1, 1),
               "ddp at tp 2": ("ddp", "ddp", 1, 2),
               "ddp tp 2 at tp 1": ("ddp-tp2", "ddp", 1, 1)}
    refused = [args(tiny_model, games, root / f"{name}-again", strategy, pp, tp,
                    "--resume", str(root / name / "checkpoint-2"))
               for name, strategy, pp, tp in resumed.values()]
    by_rank = launch(run_finetunes_then_refusals, 2, list(saves.values()), refused, timeout_s=600)
    return {case: [rank[1][i] for rank in by_rank] for i, case in enumerate(resumed)}


@pytest.mark.parametrize("case, theirs, ours", [
    ("fsdp pp 2 at pp 1", "--pp_size above 1", "neither --tp_size nor --pp_size above 1"),
    ("ddp at tp 2", "neither --tp_size nor --pp_size above 1", "--tp_size above 1"),
    ("ddp tp 2 at tp 1", "--tp_size above 1", "neither --tp_size nor --pp_size above 1"),
])
def test_a_sharded_checkpoint_of_another_layout_is_refused_in_one_line_on_every_rank(lines, case, theirs, ours):
    said = lines[case]
    assert said[0] is not None and said[0] == said[1], said  # refused, on every rank, in the same words
    assert "\n" not in said[0]
    assert f"is a sharded checkpoint written with {theirs}, and this run has {ours}; a sharded checkpoint " \
           f"resumes at its own layout only" in said[0], said[0]
