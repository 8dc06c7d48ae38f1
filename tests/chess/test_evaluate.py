"""The legal-move rate: prefixes, greedy decoding with left padding, python-chess's verdict."""

import subprocess
import sys

import chess
import torch

from minidist.chess import jsonl, legal_moves

from minidist.chess.games import bundled_games
from minidist.runtime.launch import launch
from minidist.hf.models import load_model, load_tokenizer
from train_workers import evaluate_sharded


class AlwaysSays(torch.nn.Module):
    """A stand-in language model that always predicts one token, whatever it is shown."""

    def __init__(self, token_id, vocab_size):
        super().__init__()
        self.token_id, self.vocab_size = token_id, vocab_size
        self.seen_positions = []

    def forward(self, input_ids, attention_mask, position_ids, use_cache):
        self.seen_positions.append(position_ids)
        logits = torch.zeros(*input_ids.shape, self.vocab_size)
        logits[..., self.token_id] = 1.0
        return type("Output", (), {"logits": logits})


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
    tokenizer = load_tokenizer(tiny_model)
    games = jsonl.load_games(bundled_games("test"))
    prefixes = legal_moves.game_prefixes(games, 40, seed=2)
    model = AlwaysSays(tokenizer.convert_tokens_to_ids("g8f6"), len(tokenizer))
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
    first_call = model.seen_positions[0]
    lengths = [len(tokenizer(" ".join(p))["input_ids"]) for p in prefixes[:7]]
    assert first_call[:, -1].tolist() == [n - 1 for n in lengths]


def test_sharded_evaluation_agrees_with_one_process(tiny_model):
    tokenizer, model = load_tokenizer(tiny_model), load_model(tiny_model)
    prefixes = legal_moves.game_prefixes(jsonl.load_games(bundled_games("test")), 5)
    alone = legal_moves.legal_move_rate(model, tokenizer, prefixes, "cpu")
    # 5 prefixes on 2 ranks: one rank has 3, the other 2 plus one uncounted pad, so under FSDP
    # both run the same number of forward passes and neither waits forever.
    for rank_result in launch(evaluate_sharded, 2, tiny_model, "fsdp", 5, timeout_s=120):
        assert (rank_result["legal"], rank_result["total"]) == (alone["legal"], alone["total"]) and alone["total"] == 5


def test_the_command_prints_the_rate(tiny_model):
    done = subprocess.run([sys.executable, "-m", "minidist.evaluate", "--model", tiny_model, "--num_prefixes", "6"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("legal-move rate ") and "/6 prefixes)" in done.stdout
