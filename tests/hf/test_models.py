"""The tiny Llama and its chess tokenizer load like any hub model, and cover every legal move."""

import random
import subprocess
import sys

import chess
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from minidist.hf import models

# The full suite only: the model command in processes of their own, and a model of a few million parameters.
pytestmark = pytest.mark.slow


def test_every_legal_move_of_random_games_is_one_token():
    tokenizer = models.build_chess_tokenizer()
    rng = random.Random(0)
    legal = set()  # every move legal somewhere in 30 random games: promotions, castling (e1g1), en passant
    for _ in range(30):
        board = chess.Board()
        while not board.is_game_over() and board.ply() < 300:
            moves = [move.uci() for move in board.legal_moves]
            legal.update(moves)
            board.push_uci(rng.choice(moves))
    moves = sorted(legal)  # tokenized at once: one call per move took seconds
    for move, ids in zip(moves, tokenizer(moves, add_special_tokens=False)["input_ids"], strict=True):
        assert len(ids) == 1 and ids[0] != tokenizer.unk_token_id, move
    assert len(models.uci_vocabulary()) == len(set(models.uci_vocabulary())) == 1968


def test_the_tiny_model_round_trips_through_from_pretrained(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    text = "e2e4 e7e5 g1f3 b8c6 1-0"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 6
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert isinstance(model, LlamaForCausalLM) and type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"
    again = models.load_model(tiny_model)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    assert models.load_model(tiny_model, dtype=torch.bfloat16).model.embed_tokens.weight.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer))


def test_the_cli_writes_a_model_of_a_few_million_parameters(tmp_path):
    done = subprocess.run([sys.executable, "-m", "minidist.hf.models", "tiny", "--out", str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "LlamaForCausalLM, 4.15M parameters" in done.stdout
    assert 2e6 < models.num_parameters(models.load_model(str(tmp_path / "m"))) < 1e7


def test_tiny_is_written_once_and_then_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIDIST_CACHE", str(tmp_path))
    folder = models.resolve(models.TINY)
    assert folder == str(tmp_path / "tiny-llama") and (tmp_path / "tiny-llama" / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llama"]  # no temporary copy left
    stamp = (tmp_path / "tiny-llama" / "model.safetensors").stat().st_mtime_ns
    models.resolve(models.TINY)
    assert (tmp_path / "tiny-llama" / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.parametrize("name", ["/no/such/folder", "./missing", "a/b/c"])
def test_a_missing_local_folder_is_named(name):
    with pytest.raises(FileNotFoundError, match="not found"):
        models.resolve(name)


def test_hub_names_pass_through_untouched():
    assert models.resolve("codellama/CodeLlama-7b-hf") == "codellama/CodeLlama-7b-hf"


def test_a_bare_hub_name_goes_to_the_hub():
    assert models.resolve("gpt2") == "gpt2"


CONNECTS = """
import socket, sys
tries = []
real = socket.socket.connect
def connect(self, address):
    tries.append(address)
    return real(self, address)
socket.socket.connect = connect
from minidist.checkpoint import final_model, state
from minidist.memory import estimator
name = "some-org/cached"
print(state.model_fingerprint(name)["hidden_size"], final_model.saved_dtype("auto", name),
      estimator.load_config(name).num_hidden_layers, len(tries))
"""


def test_a_cached_name_is_read_from_the_cache_alone_without_the_hub(tmp_path):
    """No HF_HUB_OFFLINE, the hub out of reach (a refused port), the name in the hub cache: the
    config reads that the checkpoint, the final model and the estimator make go to the cache at
    once, after one connection attempt (`hub.reachable`), not to the hub client, which tries the hub
    first for each (three more attempts here, before they used `models.load_config`; where a
    connection hangs instead of being refused, each retries with back-off: `hub.py`)."""
    import os

    from transformers import LlamaConfig

    snapshot = tmp_path / "hub" / "models--some-org--cached" / "snapshots" / ("0" * 40)
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4).save_pretrained(snapshot)
    (tmp_path / "hub" / "models--some-org--cached" / "refs").mkdir()
    (tmp_path / "hub" / "models--some-org--cached" / "refs" / "main").write_text("0" * 40)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", CONNECTS], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["64", "torch.float32", "3", "1"]
