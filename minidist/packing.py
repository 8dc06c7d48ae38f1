"""Sequence packing: several whole games in one row, a block-diagonal causal mask between them.

Right padding (`batches.collate`) pads every game of a micro-batch to the longest one. Chess games
vary in length, so a large share of a batch's tokens are padding (metrics.jsonl's `padding_share`
says how much, step by step), and every rank computes attention, the MLPs and the logits over
them. Packing puts games
end to end in rows of at most `--max_seq_length` tokens instead, and pads only what is left at the
end of each row.

Three things make a packed row train exactly as its games would one at a time:

1. **Each game its own positions** (`position_ids` from 0 for each game): the rotary embedding
   sees a game at the positions it would have alone.
2. **A block-diagonal causal mask** (`document_mask`): token i attends to token j only if both
   belong to the same game and j <= i. Resetting the position ids alone is not enough: without the
   mask, a game's tokens attend to the games before it in the row, and its logits change with
   them (tests/loop/test_packing.py shows both: with the mask, changing one game leaves the
   others' logits equal bit for bit; with the position ids alone, they change).
3. **No target crosses a game boundary** (`labels`): the loss compares position t's logits with
   the label at t + 1 (`step.token_loss_sum`), so the label at a game's first token is -100:
   otherwise the last token of the game before it would be taught to predict it. A game of n
   tokens keeps its n - 1 targets, as unpacked, so the global batch's target count, by which the
   loss is divided (lesson 03's rule), is the same packed or not.

`document_ids` say which game of its row each token belongs to: 1 for the row's first game, 2 for
its second, ..., and 0 for padding. Padding tokens attend to themselves only: a query row of the
mask with no True in it would be a softmax over nothing, 0/0 in the formula, and what a kernel
returns for it is the kernel's choice (PyTorch 2.13's CPU SDPA returns zeros); a padding token
that sees itself is defined in every kernel. Their labels are -100, so they add neither loss nor
gradient.

On a GPU with flash-attention installed the mask need not exist at all: transformers finds the
games from the position ids (each reset to 0 starts one) and calls flash-attention's variable-
length kernel on the rows flattened into one (`flatten_for_varlen`). `attention_path` says which
path a run takes.
"""

import functools

import torch

IGNORE = -100  # cross_entropy's ignore_index: no loss, no gradient
PADDING = 0  # the document id of padding tokens


def pack_rows(lengths: list[int], max_seq_length: int) -> list[list[int]]:
    """The indices of the games in each row, every game whole, by first-fit decreasing.

    The rule: take the games longest first (ties by index, so the result depends on the lengths
    alone), and put each into the first row that still has room for it, or into a new row. It is
    the classic bin-packing heuristic: never more than 11/9 of the fewest rows possible plus one
    (Dósa 2007), with one pass over the open rows per game. Games are placed whole, never cut
    across rows: a cut game would lose the context of its first half, and
    its second half would start at a position it never has in generation. A game longer than
    `max_seq_length` cannot be placed (`tokenize_games` truncates every game to it first)."""
    if any(n > max_seq_length for n in lengths):
        raise ValueError(f"a game of {max(lengths)} tokens does not fit a row of {max_seq_length}: truncate it first")
    rows, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(max_seq_length - lengths[i])
    return rows


def balance_ranks(lengths: list[int], world_size: int) -> list[list[int]]:
    """The indices of the games each data-parallel rank computes, about the same number of tokens
    on each: the longest game first (ties by index), each to the rank with the fewest tokens so far
    (ties: the lowest rank). A rank at a collective waits for the slowest; greedy this way, no rank
    holds more than the mean plus one game's tokens (the game that made it the largest went to it
    while it held the fewest). Deterministic, so every rank computes every rank's share
    without communication."""
    shares, tokens = [[] for _ in range(world_size)], [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (tokens[r], r))
        shares[r].append(i)
        tokens[r] += lengths[i]
    return shares


def split_rows(rows: list, parts: int) -> list[list]:
    """`rows` cut into `parts` consecutive groups of sizes differing by at most one (the first ones
    larger); a group may be empty when there are fewer rows than parts."""
    size, extra = divmod(len(rows), parts)
    starts = [a * size + min(a, extra) for a in range(parts + 1)]
    return [rows[starts[a]:starts[a + 1]] for a in range(parts)]


def positions(lengths: list[int], micro_batches: list[list[list[int]]], multiple: int = 1) -> int:
    """The positions a rank computes for these micro-batches (rows of indices into `lengths`): each
    micro-batch is its rows times the width of its longest row (`packed_width`, rounded up to a
    multiple of `multiple`), an empty one a row of padding (`collate_packed`)."""
    total = 0
    for rows in micro_batches:
        row_lengths = [sum(lengths[i] for i in row) for row in rows]
        total += max(1, len(rows)) * packed_width(row_lengths, multiple)
    return total


CAPACITIES = 64  # row capacities tried per rank and step (`rows_for`)


def rows_for(lengths: list[int], accumulation: int, max_seq_length: int) -> list[list[list[int]]]:
    """One rank's games (their `lengths`) packed into rows and cut into `accumulation` micro-batches,
    with the row capacity that computes the fewest positions.

    A micro-batch is as wide as its longest row, so filling rows to `max_seq_length` is not always
    best when a rank holds a few games: games of 6, 5, 4 and 3 tokens by first-fit decreasing into
    rows of 10 are [6, 4] and [5, 3], both padded to 10 (20 positions), where rows of 9 hold [6, 3]
    and [5, 4] with no padding at all (18). So the capacity is searched: every width from the longest game up to `max_seq_length`
    (and no more than all the games together, which fit one row), or `CAPACITIES` of them evenly
    spaced when there are more, each packed by first-fit decreasing (`pack_rows`) and cut into the
    micro-batches (`split_rows`), and the one with the fewest positions (`positions`) kept (ties:
    the narrowest). A row never exceeds `max_seq_length`, and the result depends on the lengths
    alone, so every rank computes every rank's rows without communication. (Wider rows cost more
    attention, quadratic in the row's width; counting positions leaves that out, as at these
    lengths the MLPs and the output layer dominate.)"""
    if not lengths:
        return split_rows([], accumulation)
    low, high = max(lengths), min(max_seq_length, sum(lengths))
    if high - low + 1 <= CAPACITIES:
        capacities = range(low, high + 1)
    else:
        capacities = sorted({low + round(k * (high - low) / (CAPACITIES - 1)) for k in range(CAPACITIES)})
    best = None
    for capacity in capacities:
        micro_batches = split_rows(pack_rows(lengths, capacity), accumulation)
        cost = positions(lengths, micro_batches)
        if best is None or cost < best[0]:
            best = (cost, micro_batches)
    return best[1]


def layout(lengths: list[int], world_size: int, accumulation: int, max_seq_length: int) -> list[list[list[list[int]]]]:
    """How a global batch of games (their `lengths`, in the sampler's order) is computed packed: for
    each data-parallel rank, its `accumulation` micro-batches, each a list of rows, each a list of
    positions in the global batch. The games are balanced over the ranks by tokens
    (`balance_ranks`), and each rank packs its own into rows of the capacity that leaves the least
    padding, cut into the micro-batches (`rows_for`). Every rank runs the same number of
    micro-batches, as the pipeline's schedule and no_sync need: a rank with fewer rows than that
    gets empty micro-batches (one row of padding each: `collate_packed`).

    The loop asks twice a step, for its micro-batches (`step.assemble_micro_batches`) and for the
    step's record (`step.step_token_counts`); the answer for the same step is kept, not searched again."""
    kept = _layout(tuple(lengths), world_size, accumulation, max_seq_length)
    return [[[list(row) for row in rows] for rows in rank] for rank in kept]  # a copy: the kept one stays as found


@functools.lru_cache(maxsize=2)
def _layout(lengths: tuple, world_size: int, accumulation: int, max_seq_length: int) -> list:
    per_rank = []
    for share in balance_ranks(list(lengths), world_size):
        micro_batches = rows_for([lengths[i] for i in share], accumulation, max_seq_length)
        per_rank.append([[[share[k] for k in row] for row in rows] for rows in micro_batches])
    return per_rank


def packed_width(row_lengths: list[int], multiple: int = 1) -> int:
    """The width `collate_packed` gives rows of these token counts: the longest, at least 2 (a
    position and its target), rounded up to a multiple of `multiple`."""
    width = max([2, *row_lengths])
    return -(-width // multiple) * multiple


def collate_packed(rows: list[list[list[int]]], pad_token_id: int, multiple: int = 1) -> dict:
    """Rows of games (each a list of token id lists) as one micro-batch, right-padded to the longest
    row, rounded up to a multiple of `multiple` (sequence parallelism cuts the sequence into equal
    chunks). `rows == []` gives one empty row: a micro-batch of padding alone, which adds nothing to
    the loss or the gradients, for a rank with fewer rows than micro-batches (`layout`).

    Returns `input_ids`, `labels` (-100 on padding and on every game's first token: module doc),
    `position_ids` (from 0 in each game, 0 on padding), `document_ids` (module doc) and
    `attention_mask`, the 4-D boolean mask `document_mask` makes of them, which transformers takes
    as it is."""
    rows = rows or [[]]
    width = packed_width([sum(len(game) for game in row) for row in rows], multiple)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    document_ids = torch.full((len(rows), width), PADDING, dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for d, game in enumerate(row, start=1):
            end = start + len(game)
            input_ids[r, start:end] = torch.tensor(game, dtype=torch.long)
            labels[r, start + 1:end] = input_ids[r, start + 1:end]  # the first token is nobody's target
            position_ids[r, start:end] = torch.arange(len(game))
            document_ids[r, start:end] = d
            start = end
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "document_ids": document_ids,
            "attention_mask": document_mask(document_ids)}


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """The block-diagonal causal mask of packed rows, [rows, 1, s, s] booleans (True: may attend):
    query i sees key j iff j <= i and both are tokens of the same game; a padding token sees itself
    alone (module doc: no softmax over nothing). The 1 is the heads' dimension, broadcast."""
    s = document_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]
    real = (document_ids != PADDING)[:, :, None]
    itself = torch.eye(s, dtype=torch.bool, device=document_ids.device)
    return ((same & causal & real) | itself).unsqueeze(1)


def flatten_for_varlen(batch: dict) -> dict:
    """A packed micro-batch for flash-attention's variable-length path: its rows end to end in one
    row, and no mask. transformers reads the games from the position ids (a 0 starts one; each
    padding token is a game of its own) and only does so for a batch of one row. Nothing crosses a
    row's end: the next row starts at position 0 with a label of -100."""
    flat = {name: batch[name].reshape(1, -1) for name in ("input_ids", "labels", "position_ids", "document_ids")}
    return {**flat, "attention_mask": None}


def token_counts(micro_batches_by_rank: list[list[tuple[int, int]]]) -> dict:
    """What a step computes, for metrics.jsonl: `real_tokens` (the games' own), `padded_tokens` (the
    rest of the positions the data-parallel ranks compute) and `padding_share`, from every rank's
    micro-batches as (real tokens, rows x width) pairs."""
    real = sum(r for rank in micro_batches_by_rank for r, _ in rank)
    total = sum(t for rank in micro_batches_by_rank for _, t in rank)
    return {"real_tokens": real, "padded_tokens": total - real, "padding_share": (total - real) / total if total else 0.0}


ATTENTION_PATHS = {"sdpa": "mask", "flash_attention_2": "varlen"}


def attention_path(attn_implementation: str | None) -> str:
    """How a model with this attention implementation takes packed rows: "mask" (SDPA with the
    4-D boolean mask) or "varlen" (flash-attention 2 from the position ids). Any other raises
    ValueError: eager attention adds the mask to its scores as numbers, and the others are not
    checked here."""
    path = ATTENTION_PATHS.get(attn_implementation or "sdpa")
    if path is None:
        raise ValueError(f"--pack needs an attention that takes a block-diagonal mask (sdpa) or packed position "
                         f"ids (flash_attention_2), and this model's is {attn_implementation}: set "
                         f"\"attn_implementation\": \"sdpa\" in its config.json, or train without --pack")
    return path


def choose_attention(config, device: torch.device, half: bool) -> str:
    """The attention a packed run uses, switched in the model's `config` where it helps (transformers
    reads `config._attn_implementation` at every forward): on a GPU with flash-attention 2 installed
    and a half-precision compute dtype (`half`: flash-attention computes in bf16 or fp16 only), its
    variable-length kernel, which never builds the mask; otherwise the model's own, SDPA with the
    mask materialised (rows x s x s booleans per micro-batch)."""
    current = config._attn_implementation or "sdpa"
    if device.type == "cuda" and half and current == "sdpa":
        from transformers.utils import is_flash_attn_2_available

        if is_flash_attn_2_available():
            config._attn_implementation = "flash_attention_2"
            return "flash_attention_2"
    return current


def describe_attention(implementation: str) -> str:
    """The start's line about the attention of a packed run."""
    if ATTENTION_PATHS[implementation] == "varlen":
        return (f"--pack: {implementation}, variable-length: the games found from the position ids, each micro-batch's "
                f"rows flattened into one, no mask built")
    return ("--pack: sdpa with a block-diagonal causal mask of rows x s x s booleans per micro-batch (flash-attention "
            "2 would need none: it takes a GPU, bf16 or fp16, and the flash_attn package)")
