"""The task: chess games as text, and the metric a learner can trust. A first reading may skip this
folder; nothing in `parallel/` knows it is chess.

- `games.py`: where games come from (generated with python-chess, converted from the hub
  dataset's parquet shards, downloaded) and the bundled sample in `data/`;
  `python -m minidist.chess.games generate|convert|download`.
- `jsonl.py`: the one file format every way of getting games ends in, read with a check per line.
- `legal_moves.py`: the share of legal next moves a model generates on held-out games
  (`python -m minidist.evaluate` runs it on a saved model).

Turning texts into batches is not chess-specific: `minidist/batches.py`.
"""
