"""`--pack` with every kind of strategy, on 2 ranks, against the single-process packed reference.

Each run trains a few steps of the tiny Llama through the training script's command line with
`--pack`, all in one launch of 2 ranks (as test_fast_parity.py: a start-up costs more than a run):
DDP, ZeRO-2 and FSDP by hand, PyTorch's FSDP2, tensor parallelism 2 by hand with sequence parallelism
(the residual stream cut into chunks of the sequence, gathered for attention, which takes the whole
row's mask and position ids), PyTorch's tensor parallelism 2, and a pipeline of 2 stages, by hand
and PyTorch's.
The games are short ones (fewer than 60 moves) in rows of 96 tokens, so that rows hold two games
or more. With 4 games a step, some micro-batches hold no game and run one row of padding
(`packing.layout`): ZeRO-2's second on each rank at steps 1 and 3, and the pipeline's last one or two
of its 4. Each must give the losses, gradient norms and final weights of
one process training on the whole global batch packed (`tests/reference.py`, `pack=True`)."""

import json
from pathlib import Path

import pytest
import torch

from minidist.chess import jsonl
from minidist.chess.games import bundled_games
from minidist.runtime.launch import launch
from pipeline_launches import run_planned
from reference import assert_parameters_match, run_reference
from train_workers import run_finetunes

# The full suite only: a second launch of 2 ranks beside test_fast_parity.py's, some 35 s on 2 cores.
pytestmark = pytest.mark.slow

STEPS, SEQ, LR, SEED, WORLD, GLOBAL_BATCH = 3, 96, 3e-3, 3, 2, 4

STRATEGIES = {  # name -> the flags that choose it, 2 ranks, a global batch of 4 games
    "ddp": ["--impl", "minidist", "--strategy", "ddp", "--batch_size_per_device", "2"],
    "zero2": ["--impl", "minidist", "--strategy", "zero2", "--batch_size_per_device", "1",
              "--gradient_accumulation_steps", "2"],
    "fsdp": ["--impl", "minidist", "--strategy", "fsdp", "--batch_size_per_device", "2"],
    "fsdp2": ["--impl", "torch", "--strategy", "fsdp", "--batch_size_per_device", "2"],
    "tp": ["--impl", "minidist", "--strategy", "ddp", "--tp_size", "2", "--sequence_parallel",
           "--batch_size_per_device", "4"],
    "tp_torch": ["--impl", "torch", "--strategy", "fsdp", "--tp_size", "2", "--batch_size_per_device", "4"],
    # 1F1B over 4 micro-batches on the one data-parallel rank, of which 1 or 2 are empty each step
    "pp": ["--impl", "minidist", "--strategy", "ddp", "--pp_size", "2", "--batch_size_per_device", "1",
           "--gradient_accumulation_steps", "4"],
    # PyTorch's 1F1B on the same stages: its micro-batches brought to one shape (pipeline/reference.py)
    "pp_torch": ["--impl", "torch", "--strategy", "fsdp", "--pp_size", "2", "--batch_size_per_device", "1",
                 "--gradient_accumulation_steps", "4"],
}


def argv(model, out, name):
    return ["--model", model, "--pack", *STRATEGIES[name], "--max_steps", str(STEPS), "--max_seq_length", str(SEQ),
            "--learning_rate", str(LR), "--warmup_steps", "1", "--seed", str(SEED), "--eval_prefixes", "0",
            "--output_dir", str(out / name), "--data", str(out / "games.jsonl")]


@pytest.fixture(scope="module")
def launched(tiny_model, tmp_path_factory):
    """Rank 0's results: {strategy: (what `finetune.train` returned, its metrics.jsonl records)}."""
    out = tmp_path_factory.mktemp("packed")
    short = [game for game in jsonl.load_games(bundled_games("train")) if len(game.split()) < 60][:64]
    jsonl.write_games(short, out / "games.jsonl")
    ranks = launch(run_planned, WORLD, [(run_finetunes, ([argv(tiny_model, out, name) for name in STRATEGIES],))],
                   timeout_s=600)
    runs = {}
    for name, result in zip(STRATEGIES, ranks[0][0]):
        lines = (out / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = result, [json.loads(line) for line in lines]
    return out, runs


@pytest.fixture(scope="module")
def reference(tiny_model, launched):
    """The single-process packed run on the whole global batch, at the learning rates the runs logged."""
    out, runs = launched
    lrs = [record["lr"] for record in runs["ddp"][1]]
    ref = run_reference(tiny_model, steps=STEPS, global_batch=GLOBAL_BATCH, seq_len=SEQ, lr=LR, seed=SEED,
                        lr_lambda=lambda step: lrs[min(step, STEPS - 1)] / LR, data=Path(out, "games.jsonl"),
                        pack=True)
    return ref


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_strategy_with_pack_matches_the_packed_reference(launched, reference, name):
    """Losses and gradient norms to 1e-5 relative; the weights in `assert_parameters_match`'s three
    classes (tests/reference.py), the others to 1e-5 relative plus 1% of one step. (Tensor parallelism
    with sequence parallelism sums a gradient in another order: one element of an MLP weight in AdamW's
    eps regime ends 4e-5 from the reference, which one tolerance for all elements would not admit.)"""
    result, records = launched[1][name]
    ref_losses, ref_norms = reference.losses, reference.grad_norms
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                               msg=lambda m: f"{name}, losses: {m}")
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in records]), torch.tensor(ref_norms), rtol=1e-5,
                               atol=0, msg=lambda m: f"{name}, gradient norms: {m}")
    assert_parameters_match(result["parameters"], reference, rtol=1e-5, atol=LR / 100, where=f"{name}: ")


def test_the_records_count_real_and_padded_tokens(launched):
    """Every record holds the step's real tokens (the games' own, as `tokens`) and the padding the
    ranks computed; packed rows of 96 holding about two short games leave less than half of them padding."""
    for name, (_, records) in launched[1].items():
        for r in records:
            assert r["real_tokens"] == r["tokens"] and r["padded_tokens"] >= 0, (name, r)
            assert r["padding_share"] == pytest.approx(r["padded_tokens"] / (r["real_tokens"] + r["padded_tokens"]))
