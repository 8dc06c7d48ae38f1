"""Checkpoints of tensor-parallel runs (issue 32, point 6; `minidist/parallel/tensor/checkpoint.py`).

Sharded: a run saved at step 2 and resumed from there, at the same layout, ends bitwise where an
uninterrupted run ends (the losses of steps 3 and 4, every final weight), for the hand-written DDP
and FSDP over a 2 x 2 grid (data-parallel 2, tp 2), and PyTorch's FSDP2 x tensor parallelism (with
and without sequence parallelism). Full: the checkpoint of a tp 2 run holds whole weights and
moments, so it resumes at tp 1 (a run without --tp_size, the code it always had) and at tp 4, within
1e-5 of the uninterrupted run (not bitwise: other tp sizes sum the slices' partial products in
another order); PyTorch's at tp 1.

The runs go through the loop (`train_workers.run_finetunes`), all in one launch of 4 ranks, one
after the other: starting the ranks costs more than the 4 steps of the tiny model.
"""

import shutil
from types import SimpleNamespace

import pytest
import torch
from interrupted import few_games
from train_workers import run_finetunes_then_refusal

from minidist.strategy.state.tensor import check_layout
from minidist.runtime.errors import UsageError
from minidist.runtime.launch import launch

# The full suite only: tensor-parallel checkpoints, saved and loaded in several launches.
pytestmark = pytest.mark.slow


def args(model, games, out, strategy, tp, batch, *extra):
    """4 steps of the minidist strategy over `tp` tensor-parallel ranks, global batch 4."""
    return ["--model", model, "--data", games, "--output_dir", str(out), "--impl", "minidist", "--strategy", strategy,
            "--max_steps", "4", "--max_seq_length", "48", "--eval_prefixes", "0", "--batch_size_per_device",
            str(batch), "--learning_rate", "3e-3", "--warmup_steps", "2", "--seed", "3",
            *(["--tp_size", str(tp)] if tp > 1 else []), *extra]


SAVE = ("--save_steps", "2")
FULL = ("--save_steps", "2", "--checkpoint_format", "full")


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """Every run, by name."""
    root = tmp_path_factory.mktemp("tp-checkpoints")
    # 64 games (4 steps of 4 draw 16): otherwise each of the 4 ranks of each of the 11 runs tokenizes all 3,000.
    games = str(few_games(root))

    def resume(name):  # --resume from step 2 of run `name`, into a folder of its own
        return ("--resume", str(root / name / "checkpoint-2"))

    # All on one 2 x 2 grid of 4 ranks, in one launch: a global batch of 4 is 2 sequences per
    # data-parallel rank at tp 2, 4 at tp 4, 1 at tp 1 (4 data-parallel ranks, no --tp_size at all).
    batch = {
        "ddp full": args(tiny_model, games, root / "ddp-full", "ddp", 2, 2, *FULL),  # uninterrupted: the references
        "fsdp full": args(tiny_model, games, root / "fsdp-full", "fsdp", 2, 2, *FULL),
    }
    for strategy in ("ddp", "fsdp"):
        out = root / f"{strategy}-sharded"
        batch[f"{strategy} sharded"] = args(tiny_model, games, out, strategy, 2, 2, *SAVE)
        batch[f"{strategy} sharded resumed"] = args(tiny_model, games, out, strategy, 2, 2, *SAVE, *resume(out.name))
        for tp, per_rank in ((4, 4), (1, 1)):
            batch[f"{strategy} tp {tp}"] = args(tiny_model, games, root / f"{strategy}-tp{tp}", strategy, tp, per_rank,
                                                *resume(f"{strategy}-full"))
    # PyTorch's tensor parallelism under FSDP2 (`--impl torch`, a later --impl wins): its checkpoints are PyTorch's
    # own helpers (DCP, full state dicts) on DTensors, sharded with and without sequence parallelism, and full.
    torch_tp = ("--impl", "torch")
    batch["torch full"] = args(tiny_model, games, root / "torch-full", "fsdp", 2, 2, *FULL, *torch_tp)
    for name, extra in (("torch sharded", ()), ("torch sp sharded", ("--sequence_parallel",))):
        out = root / name.replace(" ", "-")
        batch[name] = args(tiny_model, games, out, "fsdp", 2, 2, *SAVE, *torch_tp, *extra)
        batch[f"{name} resumed"] = args(tiny_model, games, out, "fsdp", 2, 2, *SAVE, *torch_tp, *extra,
                                        *resume(out.name))
    batch["torch tp 1"] = args(tiny_model, games, root / "torch-tp1", "fsdp", 1, 1, *torch_tp, *resume("torch-full"))
    # Last, on the same ranks: FSDP's sharded tp 2 checkpoint resumed at tp 4, which DCP's planner refuses.
    refused = args(tiny_model, games, root / "fsdp-at-tp4", "fsdp", 4, 4, *resume("fsdp-sharded"))
    by_rank = launch(run_finetunes_then_refusal, 4, list(batch.values()), refused, timeout_s=600)
    results = dict(zip(batch, by_rank[0][0]))
    results["fsdp sharded at tp 4"] = [line for _, line in by_rank]
    yield results
    shutil.rmtree(root, ignore_errors=True)


def assert_same(run, reference, exact=True):
    if exact:
        assert run["losses"] == reference["losses"]  # floats compared exactly
    else:
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
    assert run["parameters"].keys() == reference["parameters"].keys()
    for name, tensor in reference["parameters"].items():
        if exact:
            assert torch.equal(run["parameters"][name], tensor), name
        else:  # 1e-5 of the weights, and well under one step's change (lr 3e-3)
            torch.testing.assert_close(run["parameters"][name], tensor, rtol=1e-5, atol=3e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "torch"])
def test_a_sharded_checkpoint_resumes_bitwise_at_the_same_layout(runs, strategy):
    reference = runs[f"{strategy} full"]  # uninterrupted (its saves only read the state)
    assert_same(runs[f"{strategy} sharded"], reference)
    assert_same(runs[f"{strategy} sharded resumed"], reference)


def test_pytorchs_sharded_checkpoint_under_sequence_parallelism_resumes_bitwise(runs):
    assert_same(runs["torch sp sharded resumed"], runs["torch sp sharded"])  # that one ran uninterrupted


def test_pytorchs_full_checkpoint_of_tp_2_resumes_without_tensor_parallelism(runs):
    resumed, reference = runs["torch tp 1"], runs["torch full"]
    assert resumed["losses"][:2] == reference["losses"][:2]  # the checkpoint's own records
    assert_same(resumed, reference, exact=False)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("tp", [1, 4])
def test_a_full_checkpoint_of_tp_2_resumes_at_another_tp_size(runs, strategy, tp):
    resumed, reference = runs[f"{strategy} tp {tp}"], runs[f"{strategy} full"]
    assert resumed["losses"][:2] == reference["losses"][:2]  # the checkpoint's own records
    assert_same(resumed, reference, exact=False)


def test_a_sharded_checkpoint_of_another_layout_is_refused_in_one_line():
    check_layout(torch.tensor([2, 1]), SimpleNamespace(tp_size=2, dp_size=1))
    with pytest.raises(UsageError, match=r"written at --tp_size 2 on 1 data-parallel ranks, and this run has 4 on 1"):
        check_layout(torch.tensor([2, 1]), SimpleNamespace(tp_size=4, dp_size=1))


def test_a_sharded_fsdp_checkpoint_resumed_at_another_tp_size_is_refused_in_one_line(runs):
    lines = runs["fsdp sharded at tp 4"]
    assert len(set(lines)) == 1 and lines[0] is not None, lines  # every rank, the same line
    assert "holds tensors of other shapes than this run's (Size mismatch between saved" in lines[0], lines[0]
    assert lines[0].endswith("resume it with the sizes that wrote it (--tp_size), or start afresh without --resume")
    assert "\n" not in lines[0]
