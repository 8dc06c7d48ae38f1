"""Tests of minidist.chess.games: legal games, files, the parquet converter, tokens, batches, sampler."""
import json
import random

import chess
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from minidist import batches
from minidist.chess import games, jsonl
from minidist.chess.games import bundled_games


def replay(text):
    """Play a game text on a board; fail on any illegal move; return (board, stated result)."""
    *moves, result = text.split()
    board = chess.Board()
    for uci in moves:
        move = chess.Move.from_uci(uci)
        assert move in board.legal_moves, f"illegal {uci} in {text[:60]}..."
        board.push(move)
    return board, result


def assert_finished_legally(text):
    board, result = replay(text)
    assert board.is_game_over(), "game stops before the rules end it"
    assert board.result() == result


# ---------------------------------------------------------------- games
@pytest.fixture(scope="module")
def generated():
    return games.generate_games(12, seed=7)


def test_generated_games_are_legal_and_finished(generated):
    assert len(generated) == 12
    for text in generated:
        assert_finished_legally(text)
        assert len(text.split()) - 1 <= 200


def test_generation_is_deterministic_per_seed(generated):
    assert games.generate_games(12, seed=7) == generated
    assert games.generate_games(12, seed=8) != generated


def test_max_plies_discards_long_games():
    played = games.generate_games(5, seed=1, max_plies=40)
    assert all(len(g.split()) - 1 <= 40 for g in played)
    for g in played:
        assert_finished_legally(g)


def test_bundled_games_legal_varied_and_disjoint():
    train = jsonl.load_games(bundled_games("train"))
    test = jsonl.load_games(bundled_games("test"))
    assert len(train) >= 2500 and len(test) >= 250
    assert not set(train) & set(test), "held-out games occur in train"
    for text in random.Random(0).sample(train, 40) + test[:20]:
        assert_finished_legally(text)
    results = {t.rsplit(" ", 1)[1] for t in train}
    assert results == {"1-0", "0-1", "1/2-1/2"}
    with pytest.raises(ValueError):
        bundled_games("validation")


# ---------------------------------------------------------------- files
def test_write_load_round_trip(tmp_path, generated):
    path = tmp_path / "sub" / "games.jsonl"
    jsonl.write_games(generated, path)
    assert jsonl.load_games(path) == generated
    assert json.loads(path.read_text().splitlines()[0]) == {"text": generated[0]}


def test_missing_file_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="bundled sample") as info:
        jsonl.load_games(tmp_path / "nope.jsonl")
    assert "\n" not in str(info.value) and "python -m minidist.chess.games" in str(info.value)


def write_shard(path, rows):
    table = pa.table({
        "Moves": pa.array([r[0] for r in rows], type=pa.list_(pa.string())),
        "Termination": [r[1] for r in rows],
        "Result": [r[2] for r in rows],
    })
    pq.write_table(table, path, row_group_size=2)  # several row groups: exercise streaming
    return path


ROWS = [
    (["e2e4", "e7e5"], "NORMAL", "1-0"),
    ([], "NORMAL", "1/2-1/2"),  # empty: skipped
    (["f2f3", "e7e5", "g2g4", "d8h4"], "CHECKMATE", "0-1"),
    (["d2d4"], "NORMAL", "1/2-1/2"),
    (["c2c4", "c7c5"], "NORMAL", "1-0"),
]
TEXTS = ["e2e4 e7e5 1-0", "f2f3 e7e5 g2g4 d8h4 0-1", "d2d4 1/2-1/2", "c2c4 c7c5 1-0"]


def test_convert_parquet(tmp_path):
    a = write_shard(tmp_path / "a.parquet", ROWS[:3])
    b = write_shard(tmp_path / "b.parquet", ROWS[3:])
    assert games.convert_parquet([a, b], tmp_path / "all.jsonl") == 4
    assert jsonl.load_games(tmp_path / "all.jsonl") == TEXTS
    assert games.convert_parquet([a, b], tmp_path / "three.jsonl", max_games=3) == 3
    assert jsonl.load_games(tmp_path / "three.jsonl") == TEXTS[:3]


def test_cli_convert_and_one_line_error(tmp_path, capsys):
    shard = write_shard(tmp_path / "a.parquet", ROWS)
    assert games.main(["convert", str(shard), "--out", str(tmp_path / "o.jsonl")]) == 0
    assert jsonl.load_games(tmp_path / "o.jsonl") == TEXTS
    out = tmp_path / "x.jsonl"
    with pytest.raises(SystemExit) as stop:
        games.main(["convert", str(tmp_path / "missing.parquet"), "--out", str(out)])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert err.startswith("minidist.chess.games: error:") and err.count("\n") == 1 and "missing.parquet" in err
    assert not out.exists()


def test_cli_generate_held_out(tmp_path, monkeypatch):
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    args = ["generate", "--num_games", "6", "--seed", "3", "--out", str(train),
            "--test_games", "3", "--test_out", str(test)]
    assert games.main(args) == 0
    assert len(jsonl.load_games(train)) == 6 and len(jsonl.load_games(test)) == 3
    # Short games repeat: a held-out game that also occurs in train (or twice) is skipped.
    fake = ["a 1-0", "b 1-0", "c 0-1", "d 1-0", "e 1-0", "f 0-1",
            "a 1-0", "g 0-1", "g 0-1", "c 0-1", "h 1-0", "i 1-0"]
    monkeypatch.setattr(games, "generate_games", lambda n, seed, max_plies: fake[:n])
    assert games.main(args) == 0
    assert jsonl.load_games(test) == ["g 0-1", "h 1-0", "i 1-0"]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No network at all: every socket connect fails, and `datasets` and the hub client are told offline
    (both read HF_HUB_OFFLINE when imported, so their flags are set too); `datasets`' cache in tmp_path."""
    import datasets.config
    import huggingface_hub.constants

    def refuse(*args, **kwargs):
        raise OSError("the test forbids the network")

    monkeypatch.setattr("socket.socket.connect", refuse)
    monkeypatch.setattr("socket.create_connection", refuse)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets_cache")


def hub_copy(folder, shards):
    """A folder laid out like the hub repository: data/train-0000k-of-0000n.parquet, written in its schema."""
    (folder / "data").mkdir(parents=True)
    for k, rows in reversed(list(enumerate(shards))):  # written last first: they are read in name order
        write_shard(folder / "data" / f"train-{k:05d}-of-{len(shards):05d}.parquet", rows)
    return folder


def test_download_streams_the_shards_through_datasets_offline(tmp_path, offline, capsys, monkeypatch):
    repo = hub_copy(tmp_path / "strategic_game_chess", [ROWS[:3], ROWS[3:]])
    assert games.hub_shards(str(repo), num_shards=1) == [str(repo / "data" / "train-00000-of-00002.parquet")]

    counts = games.download_dataset(tmp_path / "one", num_shards=1, test_games=1, dataset=str(repo))
    assert counts == {"test": 1, "train": 1}  # shard 0 holds two games (its empty row is skipped)
    assert jsonl.load_games(tmp_path / "one" / "test.jsonl") == TEXTS[:1]
    assert jsonl.load_games(tmp_path / "one" / "train.jsonl") == TEXTS[1:2]

    # Two shards, one stream: train starts where test stops, and max_games bounds it.
    counts = games.download_dataset(tmp_path / "two", num_shards=2, max_games=2, test_games=1, dataset=str(repo))
    assert counts == {"test": 1, "train": 2}
    assert jsonl.load_games(tmp_path / "two" / "train.jsonl") == TEXTS[1:3]

    out = tmp_path / "cli"
    monkeypatch.chdir(repo)  # a folder named as a learner would, from inside it
    assert games.main(["download", "--out", str(out), "--num_shards", "2", "--test_games", "2",
                      "--dataset", "."]) == 0
    assert capsys.readouterr().out == f"wrote 2 train and 2 test games to {out}\n"
    assert jsonl.load_games(out / "test.jsonl") + jsonl.load_games(out / "train.jsonl") == TEXTS


def test_download_of_the_hub_offline_is_one_line(tmp_path, offline, capsys):
    """Offline, the hub's own name cannot be listed: one line that says where to run it, no file written."""
    out = tmp_path / "dl"
    with pytest.raises(SystemExit) as stop:
        games.main(["download", "--out", str(out)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert err.startswith("minidist.chess.games: error: Could not list the files of laion/strategic_game_chess")
    assert "internet" in err and "--dataset FOLDER" in err
    assert not out.exists()


# ---------------------------------------------------------------- tokens and batches
@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    games = jsonl.load_games(bundled_games("train"))[:200]
    words = sorted({w for g in games for w in g.split()} | {"1-0", "0-1", "1/2-1/2"})
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


def test_tokenize_adds_bos_eos_and_honours_max_seq_length(tokenizer):
    texts = ["e2e4 e7e5 1-0", " ".join(["e2e4"] * 500) + " 1-0"]
    full = batches.tokenize_games(texts, tokenizer, max_seq_length=1024)
    assert full[0][0] == tokenizer.bos_token_id and full[0][-1] == tokenizer.eos_token_id
    assert len(full[0]) == 5 and len(full[1]) == 503
    cut = batches.tokenize_games(texts, tokenizer, max_seq_length=64)
    assert [len(s) for s in cut] == [5, 64]
    assert cut[1] == full[1][:64]
    games = jsonl.load_games(bundled_games("test"))
    assert max(len(s) for s in batches.tokenize_games(games, tokenizer, 32)) == 32


def test_collate_pads_right_and_masks_labels():
    batch = batches.collate([[1, 5, 6, 2], [1, 7]], pad_token_id=0)
    assert all(t.dtype == torch.long for t in batch.values())
    assert batch["input_ids"].tolist() == [[1, 5, 6, 2], [1, 7, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[1, 5, 6, 2], [1, 7, -100, -100]]
    # A real token equal to pad_token_id is still a label: masking follows length, not value.
    assert batches.collate([[0, 3], [4]], pad_token_id=0)["labels"].tolist() == [[0, 3], [4, -100]]


# ---------------------------------------------------------------- the sampler
def test_global_batches_are_deterministic_and_depend_on_seed():
    a, b = batches.GlobalBatchSampler(50, 8, seed=1), batches.GlobalBatchSampler(50, 8, seed=1)
    assert [a.global_batch(s) for s in range(20)] == [b.global_batch(s) for s in range(20)]
    c = batches.GlobalBatchSampler(50, 8, seed=2)
    assert [a.global_batch(s) for s in range(3)] != [c.global_batch(s) for s in range(3)]
    assert b.global_batch(13) == batches.GlobalBatchSampler(50, 8, seed=1).global_batch(13)


def test_micro_batches_partition_global_batch_for_every_world_size():
    sampler = batches.GlobalBatchSampler(100, 24, seed=0)
    for step in range(6):
        g = sampler.global_batch(step)
        for world_size, b in [(1, 24), (1, 3), (2, 4), (3, 2), (4, 3), (4, 6), (8, 1)]:
            per_rank = [sampler.micro_batches(step, r, world_size, b) for r in range(world_size)]
            assert all(len(m) == 24 // (world_size * b) for m in per_rank)
            assert all(len(mb) == b for m in per_rank for mb in m)
            # Accumulation step a, rank r: the (a*world_size + r)-th slice of the global batch.
            order = [per_rank[r][a][i] for a in range(len(per_rank[0]))
                     for r in range(world_size) for i in range(b)]
            assert order == g


def test_stream_is_concatenated_epoch_permutations_and_straddles():
    n, G = 10, 4
    sampler = batches.GlobalBatchSampler(n, G, seed=5)
    stream = [i for s in range(5) for i in sampler.global_batch(s)]  # 20 = two epochs
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
    assert stream[:10] != stream[10:]  # each epoch has its own permutation
    assert sampler.global_batch(2) == stream[8:12]  # straddles epochs 0 and 1
    assert sampler.position(2) == (0, 8) and sampler.position(3) == (1, 2)
    g = torch.Generator().manual_seed(5 * 1_000_003 + 1)
    assert stream[10:] == torch.randperm(n, generator=g).tolist()


def test_sampler_errors_are_clear():
    with pytest.raises(ValueError, match="larger than"):
        batches.GlobalBatchSampler(4, 8, seed=0)
    sampler = batches.GlobalBatchSampler(100, 24, seed=0)
    with pytest.raises(ValueError, match="not divisible"):
        sampler.micro_batches(0, 0, world_size=5, micro_batch_size=1)
    with pytest.raises(ValueError, match="not divisible"):
        sampler.micro_batches(0, 0, world_size=4, micro_batch_size=4)
    assert sampler.accumulation_steps(4, 3) == 2
