"""Chess games as training data: where they come from, as text.

The model learns to continue a chess game written as text: space-separated UCI moves, then the
result, exactly as in the hub dataset `laion/strategic_game_chess`:

    e2e4 c7c5 g1f3 d7d6 ... d1h5 1-0

Three ways to get such text, all ending in the same jsonl file (one `{"text": ...}` per line; the
format, written and read with a check of every line, is `jsonl.py`'s):

1. `generate_games`: play games with python-chess and a weak policy (no engine, no network).
   A sample of ~3000 train and 300 held-out games ships in `minidist/chess/data/`.
2. `convert_parquet`: turn the real dataset's parquet shards into jsonl, streaming.
3. `download_dataset`: on a machine with internet, stream the first shards from the hub with
   `datasets` and write them as jsonl, so offline compute nodes only read jsonl.

    python -m minidist.chess.games generate --num_games 100 --out games.jsonl
    python -m minidist.chess.games convert SHARD.parquet --out games.jsonl
    python -m minidist.chess.games download --out data/ --num_shards 1

What happens to the text next (tokens, padding, which rank trains on which game) knows nothing
of chess: it is `minidist/batches.py`.
"""
import pathlib
import random
import sys

import chess

from minidist.chess.jsonl import write_games
from minidist.runtime.errors import ArgumentParser, one_line_errors

GAMES_DIR = pathlib.Path(__file__).parent / "data"
HUB_DATASET = "laion/strategic_game_chess"
PIECE_VALUE = {chess.PAWN: 1, chess.KNIGHT: 3, chess.BISHOP: 3, chess.ROOK: 5, chess.QUEEN: 9}


# ---------------------------------------------------------------- generating games
def _capture_gain(board, move):
    """Material won by a capture, minus the capturing piece if the square is defended."""
    gain = PIECE_VALUE.get(board.piece_type_at(move.to_square), 1)  # en passant: a pawn
    if board.is_attacked_by(not board.turn, move.to_square):
        # (A king is never this capturer: taking a defended piece with it is illegal.)
        gain -= PIECE_VALUE.get(board.piece_type_at(move.from_square), 0)
    return gain


def _weak_move(board, rng, capture_prob):
    """Mate in one if there is one, else often the best winning capture, else a random move.

    Pure random play wanders for hundreds of plies into a draw; capturing anything trades all
    pieces into a draw by insufficient material. Taking only material that is free (or worth more
    than the capturer) leaves one side ahead, and spotting mate lets it win: most games end in
    checkmate, at varied lengths, and every game is still a legal one.
    """
    moves = list(board.legal_moves)
    for move in moves:
        if board.gives_check(move):  # only a checking move can mate
            board.push(move)
            mate = board.is_checkmate()
            board.pop()
            if mate:
                return move
    if rng.random() < capture_prob:
        scored = [(_capture_gain(board, m), m) for m in moves if board.is_capture(m)]
        best = max((gain for gain, _ in scored), default=0)
        if best > 0:
            return rng.choice([m for gain, m in scored if gain == best])
    return rng.choice(moves)


def generate_games(num_games, seed=0, max_plies=200, capture_prob=0.9):
    """`num_games` legal games, each ended by the rules, as "m1 m2 ... result"; seed -> same games.

    A game still running after `max_plies` is thrown away: inventing a result would teach lies.
    """
    rng = random.Random(seed)
    games = []
    while len(games) < num_games:
        board = chess.Board()
        # Fivefold repetition and the 75-move rule end a game without any claim, as in the rules.
        while not board.is_game_over() and board.ply() < max_plies:
            board.push(_weak_move(board, rng, capture_prob))
        if board.is_game_over():
            games.append(" ".join(m.uci() for m in board.move_stack) + " " + board.result())
    return games


# ---------------------------------------------------------------- jsonl files
def bundled_games(split):
    """Path of the sample shipped in minidist/chess/data: "train" (3000 games) or "test" (300 unseen)."""
    if split not in ("train", "test"):
        raise ValueError(f"Unknown split {split!r}: use 'train' or 'test'.")
    return GAMES_DIR / f"{split}.jsonl"


# ---------------------------------------------------------------- the hub dataset
def _iter_parquet_games(shards):
    """Yield game texts from parquet shards in the hub's schema, in order, through `datasets`.

    `datasets`' parquet loader in streaming mode reads a shard batch by batch (a shard never sits
    in memory whole) and writes no Arrow copy of it. It takes local paths and the hub's own
    `hf://datasets/...` URLs alike, so the converter and the download share this one reader.
    """
    from datasets import load_dataset  # only the converter and the download need datasets
    stream = load_dataset("parquet", data_files=[str(s) for s in shards], split="train", streaming=True)
    for batch in stream.select_columns(["Moves", "Result"]).iter(batch_size=4096):
        for moves, result in zip(batch["Moves"], batch["Result"]):
            if moves:  # a few rows have no moves: nothing to learn from
                yield " ".join(moves) + " " + result


def _check_shard(shard):
    """ValueError unless `shard` is a parquet file with the hub dataset's `Moves` and `Result` columns."""
    import pyarrow as pa  # reading the footer alone: told before anything is streamed or written
    import pyarrow.parquet as pq

    try:
        columns = set(pq.ParquetFile(shard).schema_arrow.names)
    except (pa.ArrowException, IsADirectoryError) as err:
        raise ValueError(f"{shard} is not a parquet file ({err})") from None
    if not {"Moves", "Result"} <= columns:
        raise ValueError(f"{shard} has no Moves and Result columns: it is not a shard of {HUB_DATASET}")


def convert_parquet(shard_paths, out_path, max_games=None):
    """Write the games of `laion/strategic_game_chess` parquet shards to jsonl; return the count."""
    missing = [str(p) for p in shard_paths if not pathlib.Path(p).exists()]
    if missing:  # before the output file is opened, so a typo leaves no empty jsonl behind
        raise FileNotFoundError(f"No parquet shard at {', '.join(missing)}: check the paths.")
    for shard in shard_paths:  # likewise: a shard of something else is told before anything is written
        _check_shard(shard)
    return write_games(_iter_parquet_games(shard_paths), out_path, max_games)


def hub_shards(dataset=HUB_DATASET, num_shards=1):
    """The first `num_shards` parquet files of the train split, as `datasets` resolves `dataset`: a hub
    name (`hf://datasets/...` URLs, listed through the hub's API) or a local copy of its repository."""
    from datasets import load_dataset_builder
    try:
        local = pathlib.Path(dataset)  # a folder by its absolute path: datasets cannot name the one "." is
        source = str(local.resolve()) if local.is_dir() else dataset
        return sorted(load_dataset_builder(source).config.data_files["train"])[:num_shards]
    except Exception as e:  # offline, no route, no such repository: many classes, one message
        raise ConnectionError(f"Could not list the files of {dataset} ({type(e).__name__}): run the download where "
                              f"there is internet, with HF_HUB_OFFLINE unset, or pass --dataset FOLDER, a local "
                              f"copy of it.") from None


def download_dataset(out_dir, num_shards=1, max_games=None, test_games=1000, dataset=HUB_DATASET):
    """Stream the games of the first `num_shards` shards of `dataset`; write out_dir/{train,test}.jsonl.

    Run it where there is internet (a login node): the shards are streamed, not kept, and the
    compute nodes then read only the jsonl. The first `test_games` games are held out as the test
    split; up to `max_games` follow as train, so a small `max_games` reads only what it needs.
    """
    games = _iter_parquet_games(hub_shards(dataset, num_shards))  # one stream: train starts where test stops
    out_dir = pathlib.Path(out_dir)
    test = write_games(games, out_dir / "test.jsonl", test_games)
    return {"test": test, "train": write_games(games, out_dir / "train.jsonl", max_games)}


# ---------------------------------------------------------------- command line
# The least each count can be. Below 10 plies games almost never end by the rules, and
# `generate_games` drops unfinished ones: it would search for ever.
AT_LEAST = {"num_games": 1, "max_plies": 10, "test_games": 0, "num_shards": 1, "max_games": 0}


def main(argv=None):
    parser = ArgumentParser(prog="python -m minidist.chess.games", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="play legal games with python-chess")
    gen.add_argument("--num_games", type=int, required=True)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--max_plies", type=int, default=200)
    gen.add_argument("--out", required=True)
    gen.add_argument("--test_games", type=int, default=0)
    gen.add_argument("--test_out")
    conv = sub.add_parser("convert", help="parquet shards of the hub dataset -> jsonl")
    conv.add_argument("shards", nargs="+")
    conv.add_argument("--out", required=True)
    conv.add_argument("--max_games", type=int)
    down = sub.add_parser("download", help="stream hub shards into train/test jsonl")
    down.add_argument("--out", required=True)
    down.add_argument("--num_shards", type=int, default=1)
    down.add_argument("--max_games", type=int)
    down.add_argument("--test_games", type=int, default=1000)
    down.add_argument("--dataset", default=HUB_DATASET, help="hub name, or a local copy of its repository")
    args = parser.parse_args(argv)
    for name, least in AT_LEAST.items():  # told before any game is played or file written
        value = getattr(args, name, None)  # None: not this subcommand's flag, or not given
        if value is not None and value < least:
            parser.error(f"--{name} must be at least {least}")
    # OSError: a file that cannot be read or written; ValueError: a file that is not what it claims
    # (pyarrow's ArrowInvalid is one); both are fixed by naming another file.
    with one_line_errors("minidist.chess.games", OSError, ValueError):
        if args.command == "generate":
            if args.test_games and not args.test_out:
                parser.error("--test_games needs --test_out FILE for the held-out games")
            # Extra games so that test keeps K distinct games after dropping any that occur in
            # train: short games, like a quick mate, can repeat, and a held-out game must be unseen.
            games = generate_games(args.num_games + 2 * args.test_games, args.seed, args.max_plies)
            train = games[:args.num_games]
            seen = set(train)
            test = [game for game in dict.fromkeys(games[args.num_games:]) if game not in seen]
            test = test[:args.test_games]
            if len(test) < args.test_games:
                raise ValueError("Too few distinct held-out games: ask for fewer --test_games.")
            write_games(train, args.out)
            if args.test_games:
                write_games(test, args.test_out)
            print(f"wrote {len(train)} games to {args.out}"
                  + (f" and {len(test)} to {args.test_out}" if args.test_games else ""))
        elif args.command == "convert":
            count = convert_parquet(args.shards, args.out, args.max_games)
            print(f"wrote {count} games to {args.out}")
        else:
            counts = download_dataset(args.out, args.num_shards, args.max_games, args.test_games, args.dataset)
            print(f"wrote {counts['train']} train and {counts['test']} test games to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
