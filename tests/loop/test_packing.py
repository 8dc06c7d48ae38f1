"""Sequence packing (`minidist/packing.py`), on one process: a packed batch trains exactly as its games
one at a time, no game sees another, the batches of a step keep every game once, and the inputs
`--pack` refuses. The 2-rank parity of every strategy with `--pack` is tests/parallel/test_pack_parity.py."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from minidist import packing
from minidist.batches import GlobalBatchSampler, tokenize_games
from minidist.chess import jsonl
from minidist.chess.games import bundled_games
from minidist.hf import models
from in_process import run_here, run_here_in_one_line
from minidist.step import Packing, assemble_micro_batches, step_token_counts, token_loss_sum


class _Plain:
    """The strategy's part of `token_loss_sum` for one process: no autocast, the whole vocabulary's loss."""

    def autocast(self):
        from contextlib import nullcontext

        return nullcontext()

    def cross_entropy_sum(self, logits, targets):
        return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")


@pytest.fixture(scope="module")
def games(tiny_model):
    tokenizer = models.load_tokenizer(tiny_model)
    return tokenizer, tokenize_games(jsonl.load_games(bundled_games("train"))[:40], tokenizer, 48)


def _gradients(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_a_packed_batch_trains_exactly_as_its_games_one_at_a_time(tiny_model, games):
    """The loss and every gradient of 7 games packed into rows of 64 tokens equal those of the 7 games
    run alone, unpadded, in fp32, to 1e-6; both divided by the batch's target count, as the loop
    divides them (lesson 03), so that the tolerance speaks of the gradients a step takes (summed,
    they are some 300 times larger, and the order of the sums shows at 2e-6)."""
    tokenizer, sequences = games
    chosen = sequences[:7]
    model = models.load_model(tiny_model)
    rows = packing.pack_rows([len(s) for s in chosen], 64)
    assert len(rows) < len(chosen) and sorted(i for row in rows for i in row) == list(range(7))
    batch = packing.collate_packed([[chosen[i] for i in row] for row in rows], tokenizer.pad_token_id)
    targets = sum(len(s) - 1 for s in chosen)
    packed = token_loss_sum(model, batch, _Plain()) / targets
    packed.backward()
    packed_grads = _gradients(model)
    model.zero_grad()
    alone = 0.0
    for seq in chosen:
        ids = torch.tensor([seq])
        logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum") / targets
        loss.backward()
        alone = alone + loss.detach()
    torch.testing.assert_close(packed.detach(), alone, rtol=1e-6, atol=1e-6)
    for name, grad in _gradients(model).items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert int((batch["labels"] != -100).sum()) == targets  # n - 1 targets a game, as unpacked


def test_rows_flattened_for_flash_attention_varlen_give_the_same_loss_and_gradients(tiny_model, games):
    """`flatten_for_varlen`, the GPU path's batch (rows end to end, no mask, the games told by the
    position ids), checked on CPU: given no mask, transformers' SDPA derives the same games from the
    position ids (`masking_utils.find_packed_sequence_indices`) as flash-attention's varlen does
    (`prepare_fa_kwargs_from_position_ids`), so the loss and gradients must equal the masked rows'."""
    tokenizer, sequences = games
    chosen = sequences[3:10]
    rows = packing.pack_rows([len(s) for s in chosen], 64)
    batch = packing.collate_packed([[chosen[i] for i in row] for row in rows], tokenizer.pad_token_id, multiple=4)
    model = models.load_model(tiny_model)
    results = []
    for b in (batch, packing.flatten_for_varlen(batch)):
        model.zero_grad()
        loss = token_loss_sum(model, b, _Plain()) / sum(len(s) - 1 for s in chosen)
        loss.backward()
        results.append((loss.detach(), _gradients(model)))
    assert packing.flatten_for_varlen(batch)["input_ids"].shape == (1, batch["input_ids"].numel())
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-6)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _logits_by_game(model, batch, mask=True):
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    if mask:
        inputs["attention_mask"] = batch["attention_mask"]
    else:  # position ids alone, every token real: the mistake the mask exists to prevent
        inputs["attention_mask"] = torch.ones_like(batch["input_ids"])
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits
    return logits, batch["document_ids"]


def _three_games_with_the_first_changed(tiny_model, games, mask):
    """The logits of a row of three games, and of the same row with the first game's tokens changed,
    and which game each position holds."""
    tokenizer, sequences = games
    a, b, c = sequences[0][:15], sequences[1][:20], sequences[2][:10]
    changed = [tokenizer.eos_token_id] * len(a)
    model = models.load_model(tiny_model)
    before, docs = _logits_by_game(model, packing.collate_packed([[a, b, c]], tokenizer.pad_token_id), mask)
    after, _ = _logits_by_game(model, packing.collate_packed([[changed, b, c]], tokenizer.pad_token_id), mask)
    assert int((docs[0] >= 2).sum()) == len(b) + len(c)
    return before[0], after[0], docs[0]


def test_changing_one_game_leaves_the_others_logits_bitwise_unchanged(tiny_model, games):
    """Three games in one row; the first game's tokens changed: the logits of the second and third
    are equal bit for bit, the first's are not."""
    before, after, docs = _three_games_with_the_first_changed(tiny_model, games, mask=True)
    assert torch.equal(before[docs >= 2], after[docs >= 2])
    assert not torch.equal(before[docs == 1], after[docs == 1])


def test_position_ids_alone_let_the_games_see_each_other(tiny_model, games):
    """The same rows with the position ids reset but a plain padding mask instead of the block-diagonal
    one (the mistake of nanoVLM #204 and LlamaFactory #2289): the later games' logits change with the
    first game's tokens. (With no mask at all, transformers derives the games from the position ids
    itself: `masking_utils.find_packed_sequence_indices`; a 2-D mask, as the loop's collate gives,
    turns that off.)"""
    before, after, docs = _three_games_with_the_first_changed(tiny_model, games, mask=False)
    assert not torch.equal(before[docs >= 2], after[docs >= 2])


def test_the_mask_is_block_diagonal_causal_and_padding_sees_itself():
    docs = torch.tensor([[1, 1, 2, 2, 2, 0, 0]])
    mask = packing.document_mask(docs)[0, 0]
    want = torch.tensor([[1, 0, 0, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0, 0, 0],
                         [0, 0, 1, 0, 0, 0, 0],
                         [0, 0, 1, 1, 0, 0, 0],
                         [0, 0, 1, 1, 1, 0, 0],
                         [0, 0, 0, 0, 0, 1, 0],
                         [0, 0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask, want)


def test_first_fit_decreasing_places_games_whole_and_refuses_a_longer_one():
    assert packing.pack_rows([5, 9, 3, 6, 4], 10) == [[1], [3, 4], [0, 2]]
    with pytest.raises(ValueError, match="does not fit a row of 10"):
        packing.pack_rows([11], 10)


def test_the_row_capacity_is_the_one_with_the_fewest_positions():
    """Rows filled to --max_seq_length are not always best: [6, 5, 4, 3] by first-fit decreasing into
    rows of 10 is [6, 4] and [5, 3], two rows padded to 10 (20 positions); rows of 9 hold [6, 3] and
    [5, 4], no padding at all (18). Over random games, the capacity found never computes more
    positions than rows of --max_seq_length, and no row is longer than it."""
    assert packing.layout([6, 5, 4, 3], 1, 1, 10) == [[[[0, 3], [1, 2]]]]
    generator = torch.Generator().manual_seed(0)
    for case in range(50):
        lengths = torch.randint(2, 60, (int(torch.randint(1, 24, (), generator=generator)),), generator=generator).tolist()
        accumulation, longest = 1 + case % 3, 60 + 7 * (case % 10)
        for rank in packing.layout(lengths, 2, accumulation, longest):
            mine = sorted(i for rows in rank for row in rows for i in row)
            filled = packing.split_rows(packing.pack_rows([lengths[i] for i in mine], longest), accumulation)
            widths = [[sum(lengths[mine[k]] for k in row) for row in rows] for rows in filled]
            assert all(sum(lengths[i] for i in row) <= longest for rows in rank for row in rows)
            assert packing.positions(lengths, rank) <= sum(max(1, len(w)) * packing.packed_width(w) for w in widths)


@pytest.mark.parametrize("world, micro, accumulation", [(2, 1, 4), (1, 2, 2), (4, 1, 2)])
def test_a_step_keeps_every_game_once_balanced_and_the_same_micro_batches_on_every_rank(games, world, micro,
                                                                                            accumulation):
    """Every game of the global batch is in exactly one row of one rank, whole; every rank runs the
    same number of micro-batches (empty ones, a row of padding, where a rank has fewer rows: here with
    4 ranks); the real token counts of the ranks differ by at most the longest game; the counts the
    record takes agree with the tensors."""
    tokenizer, sequences = games
    sampler = GlobalBatchSampler(len(sequences), world * micro * accumulation, seed=1)
    pack = Packing(max_seq_length=96)
    seen, real, counted = [], [], []
    for rank in range(world):
        batches, targets = assemble_micro_batches(sampler, sequences, 0, rank, world, micro, tokenizer.pad_token_id,
                                                  torch.device("cpu"), pack=pack)
        assert len(batches) == accumulation
        assert targets == sum(len(sequences[i]) - 1 for i in sampler.global_batch(0))
        real.append(sum(int((b["document_ids"] != 0).sum()) for b in batches))
        counted.append(sum(b["input_ids"].numel() for b in batches))
        for b in batches:
            for row, docs in zip(b["input_ids"], b["document_ids"]):
                for d in docs.unique().tolist():
                    if d:
                        seen.append(row[docs == d].tolist())
    assert sorted(seen) == sorted(sequences[i] for i in sampler.global_batch(0))
    assert max(real) - min(real) <= max(len(s) for s in sequences)
    counts = step_token_counts(sampler, sequences, 0, world, micro, pack=pack)
    assert counts["real_tokens"] == sum(real) and counts["padded_tokens"] == sum(counted) - sum(real)


@pytest.mark.parametrize("pack", [None, Packing(max_seq_length=96)], ids=["padded", "packed"])
def test_the_records_token_counts_are_the_positions_the_ranks_compute(games, pack):
    """`step_token_counts`, which metrics.jsonl records without building a tensor, against the
    micro-batches every rank builds: real tokens (labels or not, every game's own) and padding,
    with sequence parallelism's rounding to a multiple of 4."""
    tokenizer, sequences = games
    sampler = GlobalBatchSampler(len(sequences), 8, seed=2)
    real = total = 0
    for rank in range(2):
        batches, _ = assemble_micro_batches(sampler, sequences, 1, rank, 2, 2, tokenizer.pad_token_id,
                                            torch.device("cpu"), multiple=4, pack=pack)
        for b in batches:
            total += b["input_ids"].numel()
            real += int((b["document_ids"] != 0).sum()) if pack else int(b["attention_mask"].sum())
    counts = step_token_counts(sampler, sequences, 1, 2, 2, multiple=4, pack=pack)
    assert counts["real_tokens"] == real == sum(len(sequences[i]) for i in sampler.global_batch(1))
    assert counts["padded_tokens"] == total - real and counts["padding_share"] == (total - real) / total


def test_an_empty_micro_batch_adds_no_loss_and_no_gradient(tiny_model, games):
    tokenizer, _ = games
    model = models.load_model(tiny_model)
    batch = packing.collate_packed([], tokenizer.pad_token_id, multiple=4)
    assert batch["input_ids"].shape == (1, 4) and (batch["labels"] == -100).all()
    loss = token_loss_sum(model, batch, _Plain())
    loss.backward()
    assert loss.item() == 0 and all(not p.grad.any() for p in model.parameters())


def test_pack_refuses_an_attention_that_cannot_take_the_mask(tiny_model, tmp_path, capsys):
    """A model whose config asks for eager attention (it adds the mask to its scores as numbers):
    one line naming it, exit 2, before the model loads."""
    folder = tmp_path / "eager"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attn_implementation": "eager"}))
    code, line = run_here_in_one_line(["--model", str(folder), "--pack", "--max_steps", "1", "--eval_prefixes", "0",
                                       "--output_dir", str(tmp_path / "out")], capsys)
    assert code == 2 and "--pack needs an attention" in line and "this model's is eager" in line, line


@pytest.mark.slow  # three runs of the loop
def test_a_packed_run_resumes_exactly(tiny_model, tmp_path, monkeypatch, capsys):
    """A step's batch with --pack is the sampler's global batch of games, packed: a run stopped after
    step 1 (the stop file) and resumed logs, for steps 2 and 3, the very losses and token counts of
    the run that was not stopped."""
    data = tmp_path / "games.jsonl"
    jsonl.write_games(jsonl.load_games(bundled_games("train"))[:64], data)

    def argv(out, *extra):
        return ["--model", tiny_model, "--pack", "--data", str(data), "--output_dir", str(out), "--max_steps", "3",
                "--max_seq_length", "64", "--eval_prefixes", "0", "--batch_size_per_device", "4",
                "--gradient_accumulation_steps", "2", "--warmup_steps", "1", "--seed", "3", "--no_save", *extra]

    assert run_here(argv(tmp_path / "whole"), capsys)[0] == 0
    stop_file = tmp_path / "stop"
    stop_file.touch()
    monkeypatch.setenv("MINIDIST_STOP_FILE", str(stop_file))
    assert run_here(argv(tmp_path / "stopped"), capsys)[0] == 75
    monkeypatch.delenv("MINIDIST_STOP_FILE")
    code, err = run_here(argv(tmp_path / "stopped", "--resume"), capsys)
    assert code == 0, err

    def records(out):
        return [{k: r[k] for k in ("step", "loss", "grad_norm", "real_tokens", "padded_tokens")}
                for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]

    assert records(tmp_path / "stopped") == records(tmp_path / "whole")


@pytest.mark.parametrize("impl, varlen, refused", [("torch", True, True), ("torch", False, False),
                                                   ("minidist", True, False)])
def test_only_pytorchs_pipeline_refuses_flash_attentions_flattened_rows(impl, varlen, refused):
    """The pipeline axis says what it cannot take (`Axis.check_packing`): PyTorch's schedules cut one
    batch into micro-batches by rows, and flash-attention's varlen micro-batches are one row each."""
    from types import SimpleNamespace

    from minidist.strategy.options import ParallelOptions
    from minidist.strategy.pipeline import PipelineAxis

    axis = PipelineAxis(ParallelOptions(impl=impl, pp_size=2), SimpleNamespace(is_main=True),
                        SimpleNamespace(pp_size=2, pp_group=None))
    if refused:
        with pytest.raises(ValueError, match="flash-attention and PyTorch's pipeline"):
            axis.check_packing(varlen)
    else:
        axis.check_packing(varlen)
