"""Exercise 03, packing: the block-diagonal causal mask of packed rows (lesson 03, `lessons/03_accumulation.md`,
"Packing: the padding taken out").

Fill in `document_mask` below, then check it from the repository root:

    MINIDIST_EXERCISE=lessons/exercises/03_packing_mask.py python -m pytest -q tests/course/test_exercises.py

This is `minidist.packing.document_mask`, the mask `--pack` gives the model for every micro-batch
(`packing.collate_packed` builds it from the rows' document ids). The check needs no ranks: it
runs in one process, in well under a second. It compares your mask, cell by cell, with the
lesson's definition on six layouts of packed rows (one game; three games; games then padding; a
row of padding alone; a game of one token; three rows at once), then runs a tiny attention (torch
SDPA, 2 heads) over one packed row with your mask: changing the first game's tokens must leave the
other games' outputs unchanged, and each game's outputs must equal what the same game computes
alone. It passes, or names the row, the query and key positions, what was expected and what came,
with a hint at the usual mistake. minidist's own answer is `packing.document_mask`: read it after.
"""

import torch  # noqa: F401 (you will want it)

EXERCISE = "03_packing_mask"  # tells the check which exercise this file answers

PADDING = 0  # the document id of padding tokens


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """The block-diagonal causal mask of packed rows, [rows, 1, s, s] booleans (True: may attend):
    query i sees key j iff j <= i and both are tokens of the same game; a padding token sees itself
    alone (no softmax over nothing). The 1 is the heads' dimension, broadcast.

    - `document_ids`: [rows, s] integers (torch.long), which game of its row each token belongs to:
      1 for the row's first game, 2 for its second, ..., and 0 (`PADDING`) for the padding after
      the last game. For example three games of 3, 2 and 4 tokens and two padding tokens:
      `[[1, 1, 1, 2, 2, 3, 3, 3, 3, 0, 0]]`.
    - Return a new tensor of dtype torch.bool, of shape [rows, 1, s, s]: `mask[r, 0, i, j]` says
      whether, in row r, the token at position i (the query) may attend to the token at position j
      (the key). Leave `document_ids` as it came.

    Hints:
    - Two conditions, both needed: the causal one (j <= i: `torch.ones(s, s, dtype=torch.bool).tril()`)
      and the same-game one (compare every position's id with every other's: broadcasting
      `document_ids[:, :, None] == document_ids[:, None, :]` gives [rows, s, s]).
    - Padding (id 0) is no game, even though all of a row's padding shares one id: the same-game
      test must also ask that the query is a real token (`document_ids != PADDING`). Then give every
      padding token its own diagonal cell (`torch.eye`), so that its query row is not empty.
    - `.unsqueeze(1)` adds the heads' dimension at the end.

    The usual mistakes, each of which the check names:
    - forgetting causality: the same-game test alone lets a token see the later tokens of its own
      game, the very tokens it is trained to predict;
    - letting padding attend to nothing: a query row with no True in it is a softmax over nothing,
      0/0 in the formula, and what a kernel returns for it is the kernel's choice;
    - the position ids alone: resetting each game's positions to 0 and keeping one causal mask over
      the whole row lets every game attend to the games before it in the row (the rotary embedding
      does not separate them);
    - off by one on the diagonal: j < i (`tril(-1)`) instead of j <= i: a token must see itself, or
      a game's first token sees nothing.
    """
    raise NotImplementedError("document_mask is yours to write (its docstring says how)")
