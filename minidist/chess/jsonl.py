"""The games file: jsonl, one game a line, `{"text": "e2e4 e7e5 ... 1-0"}`, and how it is read.

Every way of getting games (`games.py`: generated, converted from the hub's parquet shards,
downloaded) ends in this one format, the one the hub dataset's text form uses and the one the
training script, the evaluation and the notebooks read.

Reading checks every line, because a games file is something a learner writes by hand or by a
script of their own: an empty file, a line that is not JSON, or an object without `text` would
otherwise surface much later as an `IndexError` deep inside the tokenizer; a line of 500 MB
would make the tokenizer ask for gigabytes at once, and a FIFO would be waited on forever. The
error names the file and the line, in one sentence (`ValueError`; the commands print it as one line,
`runtime/errors.py`).
"""

import itertools
import json
import pathlib
import stat

MAX_LINE_BYTES = 1 << 20  # 1 MiB: the longest games of the hub's dataset are a few kB
FORMAT = 'each line must be a JSON object such as {"text": "e2e4 e7e5 g1f3 ... 1-0"}'


def write_games(texts, path, max_games=None):
    """Write game texts (any iterable, read lazily) as jsonl; return the count (<= max_games)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(path, "w") as f:
        for text in itertools.islice(texts, max_games):  # islice takes no more than it writes
            f.write(json.dumps({"text": text}) + "\n")
            count += 1
    return count


def _text_of(line: str, number: int, path) -> str:
    """The game on one line of the file, or a ValueError that names the line and what is wrong."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"line {number} of {path} is not JSON ({err.msg}): {FORMAT}") from None
    except RecursionError:  # [[[[...: nested deeper than Python's parser goes
        raise ValueError(f"line {number} of {path} is not a game (JSON nested too deeply): {FORMAT}") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise ValueError(f'line {number} of {path} has no "text" string: {FORMAT}')
    return record["text"]


def _lines(path):
    """(number, text) of each line, read with a bound: a line longer than `MAX_LINE_BYTES` is refused
    before it is decoded, parsed or tokenized. (One 500 MB line once made the tokenizer ask for 4-8 GB
    at once and the process died of SIGABRT; a game is a few hundred bytes.)"""
    with open(path, "rb") as f:
        for number in itertools.count(1):
            line = f.readline(MAX_LINE_BYTES + 1)
            if not line:
                return
            if len(line) > MAX_LINE_BYTES:
                raise ValueError(f"line {number} of {path} is longer than {MAX_LINE_BYTES:,} bytes, not a game: "
                                 f"{FORMAT}")
            yield number, line.decode("utf-8")


def load_games(path):
    """The games of a jsonl file, as texts; blank lines are skipped, anything else must be a game."""
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"No games file at {path}: use the bundled sample "
                                "(minidist.chess.games.bundled_games('train')), or create it with "
                                "`python -m minidist.chess.games generate|convert|download`.")
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not a games file: name the .jsonl file itself.")
    if path.suffix != ".jsonl":
        raise ValueError(f"{path} is not a .jsonl file: convert parquet shards first with "
                         f"`python -m minidist.chess.games convert SHARD.parquet --out FILE.jsonl`.")
    if not stat.S_ISREG(path.stat().st_mode):  # opening a FIFO waits for a writer forever; a device never ends
        raise ValueError(f"{path} is not a regular file (a pipe, a socket or a device): name a .jsonl file")
    try:
        games = [_text_of(line, n, path) for n, line in _lines(path) if line.strip()]
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a text file: {FORMAT}") from None
    except PermissionError as err:
        raise ValueError(f"cannot read {path} ({err.strerror}): check its permissions.") from None
    if not games:
        raise ValueError(f"{path} holds no games: {FORMAT}")
    return games
