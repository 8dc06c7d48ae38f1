"""The legal-move rate: prefixes, greedy decoding through `generate` with left padding, python-chess's verdict."""

import subprocess
import sys

import chess
import pytest
import torch
from train_workers import evaluate_sharded

from minidist.chess import jsonl, legal_moves
from minidist.chess.games import bundled_games
from minidist.hf.models import load_model, load_tokenizer
from minidist.runtime.launch import launch

# The full suite only: the legal-move rate under every strategy, in several launches.
pytestmark = pytest.mark.slow


class AlwaysSays(torch.nn.Module):
    """A stand-in output layer: whatever the model computed, one token is the most likely."""

    def __init__(self, token_id, vocab_size):
        super().__init__()
        self.token_id, self.vocab_size = token_id, vocab_size

    def forward(self, hidden):
        logits = torch.zeros(*hidden.shape[:-1], self.vocab_size)
        logits[..., self.token_id] = 1.0
        return logits


@torch.no_grad()
def by_hand(model, tokenizer, prompts, max_new_tokens):
    """The reference: the decoding by hand that `generate` replaced, kept here to check it. Left
    padding, positions counting real tokens only, the whole sequence re-read at every step (no
    key/value cache), exactly `max_new_tokens` written."""
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    width = max(len(ids) for ids in encoded)
    ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(encoded):
        ids[row, width - len(seq):], mask[row, width - len(seq):] = torch.tensor(seq), 1
    for _ in range(max_new_tokens):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return [tokenizer.decode(row[width:], skip_special_tokens=True) for row in ids.tolist()]


def rate_of(prefixes, continuations) -> int:
    return sum(legal_moves.first_word_is_legal(p, text) for p, text in zip(prefixes, continuations))


def test_game_prefixes_cut_inside_the_game():
    games = jsonl.load_games(bundled_games("test"))
    prefixes = legal_moves.game_prefixes(games, 50, seed=1)
    assert len(prefixes) == 50 and prefixes == legal_moves.game_prefixes(games, 50, seed=1)
    for prefix, game in zip(prefixes, games):
        moves = game.split()[:-1]
        assert 1 <= len(prefix) < len(moves) and moves[: len(prefix)] == prefix


def test_first_word_is_judged_by_python_chess():
    assert legal_moves.first_word_is_legal(["e2e4"], " e7e5 g1f3")
    assert not legal_moves.first_word_is_legal(["e2e4"], "e2e4")  # white's move again: illegal
    assert not legal_moves.first_word_is_legal(["e2e4"], "1-0 e7e5")
    assert not legal_moves.first_word_is_legal(["e2e4"], "")


def test_the_rate_counts_exactly_the_positions_where_the_move_is_legal(tiny_model):
    tokenizer, model = load_tokenizer(tiny_model), load_model(tiny_model)
    games = jsonl.load_games(bundled_games("test"))
    prefixes = legal_moves.game_prefixes(games, 40, seed=2)
    model.lm_head = AlwaysSays(tokenizer.convert_tokens_to_ids("g8f6"), len(tokenizer))
    seen = []  # the positions of each forward
    model.model.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs["position_ids"]), with_kwargs=True)
    result = legal_moves.legal_move_rate(model, tokenizer, prefixes, "cpu", batch_size=7)
    expected = 0
    for prefix in prefixes:
        board = chess.Board()
        for move in prefix:
            board.push_uci(move)
        expected += chess.Move.from_uci("g8f6") in board.legal_moves
    assert 0 < expected < len(prefixes)
    assert (result["legal"], result["total"]) == (expected, len(prefixes))
    # Left padding: the last real token of every prompt sits at position len(prompt) - 1.
    lengths = [len(tokenizer(" ".join(p))["input_ids"]) for p in prefixes[:7]]
    assert seen[0][:, -1].tolist() == [n - 1 for n in lengths]


def test_generate_writes_what_the_decoding_by_hand_wrote(tiny_model):
    """The same greedy choice, so the same rate: `generate` with its key/value cache against the
    decoding by hand it replaced, on the bundled held-out games, in batches with left padding."""
    tokenizer, model = load_tokenizer(tiny_model), load_model(tiny_model)
    prefixes = legal_moves.game_prefixes(jsonl.load_games(bundled_games("test")), 24, seed=3)
    prompts, new = [" ".join(p) for p in prefixes], legal_moves.tokens_per_move(tokenizer) + 1
    expected = by_hand(model, tokenizer, prompts, new)
    widths = []  # the tokens each forward reads
    model.model.register_forward_pre_hook(lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                          with_kwargs=True)
    assert legal_moves.greedy_continue(model, tokenizer, prompts, new, "cpu") == expected
    assert widths[1:] == [1] * (new - 1)  # the key/value cache: after the prompt, one token per forward
    result = legal_moves.legal_move_rate(model, tokenizer, prefixes, "cpu", batch_size=5)
    assert (result["legal"], result["total"]) == (rate_of(prefixes, expected), 24)


def test_generate_keeps_writing_after_the_end_of_sequence_token(tiny_model):
    """As by hand: exactly the new tokens asked for, `</s>` skipped in the text, not a stop."""
    tokenizer, model = load_tokenizer(tiny_model), load_model(tiny_model)
    model.lm_head = AlwaysSays(tokenizer.eos_token_id, len(tokenizer))
    assert legal_moves.greedy_continue(model, tokenizer, ["e2e4"], 3, "cpu") == by_hand(model, tokenizer, ["e2e4"], 3)
    seen = []
    model.model.register_forward_pre_hook(lambda *_: seen.append(1))
    legal_moves.greedy_continue(model, tokenizer, ["e2e4"], 3, "cpu")
    assert len(seen) == 3  # one forward per new token: `generate` did not stop at the first `</s>`


@pytest.mark.parametrize("impl", ["minidist", "torch"])
def test_sharded_evaluation_agrees_with_one_process(tiny_model, impl):
    """FSDP by hand and FSDP2 on 2 ranks write, through `generate`, what one process writes by hand."""
    tokenizer, model = load_tokenizer(tiny_model), load_model(tiny_model)
    prefixes = legal_moves.game_prefixes(jsonl.load_games(bundled_games("test")), 5)
    new = legal_moves.tokens_per_move(tokenizer) + 1
    expected = by_hand(model, tokenizer, [" ".join(p) for p in prefixes], new)
    # 5 prefixes on 2 ranks: one rank has 3, the other 2 plus one uncounted pad, so under FSDP
    # both run the same number of forward passes and neither waits forever.
    for rank_result in launch(evaluate_sharded, 2, tiny_model, "fsdp", 5, impl, timeout_s=120):
        assert (rank_result["legal"], rank_result["total"]) == (rate_of(prefixes, expected), 5)
        assert rank_result["continuations"] == expected


def test_the_command_prints_the_rate(tiny_model):
    done = subprocess.run([sys.executable, "-m", "minidist.evaluate", "--model", tiny_model, "--num_prefixes", "6"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("legal-move rate ") and "/6 prefixes)" in done.stdout
