"""Evaluation: does the model play legal chess? The share of legal next moves.

Loss says how surprised the model is by real games; it does not say whether the model has
learnt the rules. This metric does. For held-out games we cut each at a random move, show the
model the moves so far, let it continue greedily, read the first word it writes, and ask
python-chess whether that word is a legal move in the position. A random model scores about 0;
a model that has learnt chess notation but not chess scores a little; one that tracks the board
scores near 1.

It reads text, not tokens, so the tiny Llama (one token per move) and CodeLlama (several
sub-word tokens per move) are judged the same way.

The model continues through Hugging Face's `model.generate` (greedy, with the key/value cache),
the call a learner meets everywhere else. Every rank runs the same number of forward passes,
even if it has fewer prefixes: under FSDP a forward pass is a collective (each unit all-gathers
its parameters), so a rank that stopped early would leave the others waiting forever. So every
rank runs as many batches (the short ones padded with uncounted copies), and within a batch
`generate(synced_gpus=True)` keeps every rank stepping until all are done.

The command that runs it on a saved model is `python -m minidist.evaluate` (`minidist/evaluate.py`).
"""

import math
import random
import statistics
from contextlib import contextmanager

import chess
import torch
import torch.distributed as dist

from minidist.batches import left_padded

RESULTS = ("1-0", "0-1", "1/2-1/2", "*")  # the last word of every game: python-chess's board.result()


def game_prefixes(games: list[str], num_prefixes: int, seed: int = 0) -> list[list[str]]:
    """Cut up to `num_prefixes` games after a random move (at least one move, never the last).

    Each game used must be legal, or the judge below has no position to judge in: a ValueError
    names the first game and move that is not (a typo, another notation, a file of something
    else). The whole game is checked, not just the prefix, so that a file passes or fails
    whatever the seed."""
    rng = random.Random(seed)
    prefixes = []
    for number, text in enumerate(games[:num_prefixes], 1):
        moves = _legal(text.split()[:-1], number)  # the last word is the result
        if len(moves) >= 2:
            prefixes.append(moves[: rng.randint(1, len(moves) - 1)])
    return prefixes


def _legal(moves: list[str], number: int) -> list[str]:
    why = _first_illegal_move(moves)
    if why:
        raise ValueError(f"held-out game {number} is not a legal game: {why} (write held-out games with "
                         f"`python -m minidist.chess.games generate`)")
    return moves


def _first_illegal_move(moves: list[str]) -> str | None:
    """What is wrong with the first move python-chess refuses ("its move 3, 'e1e3', ..."), or None."""
    board = chess.Board()
    for ply, word in enumerate(moves, 1):
        try:
            move = chess.Move.from_uci(word)
        except ValueError:  # not UCI at all ("Nf3", "hello")
            move = None
        if move is None or not board.is_legal(move):
            return f"its move {ply}, {word!r}, is not a legal UCI move there"
        board.push(move)
    return None


def why_not_a_game(text: str) -> str | None:
    """Why `text` is not a legal chess game in the dataset's form ("m1 m2 ... result"), or None."""
    words = text.split()
    if not words or words[-1] not in RESULTS:
        return f"it does not end in a result ({', '.join(RESULTS)})"
    return _first_illegal_move(words[:-1])


def check_training_games(games: list[str], path, policy: str, used=None) -> tuple[list[str], int]:
    """The training games as `--illegal_games` says, and how many were skipped.

    A file of something else (prose, another notation) or games with illegal moves would train
    without complaint, and the model would learn them. "refuse": a ValueError names the first such
    game among those at the indices `used` (the games the run trains on: python-chess checks a few
    hundred games a second, so all 3,000 bundled ones would cost seconds on every start); None: all.
    "skip": every game is checked, and only the legal ones are kept."""
    if policy == "skip":
        kept = [text for text in games if why_not_a_game(text) is None]
        if not kept:
            raise ValueError(f"{path} holds no legal chess game ({len(games)} skipped with --illegal_games skip)")
        return kept, len(games) - len(kept)
    for index in sorted(range(len(games)) if used is None else used):
        why = why_not_a_game(games[index])
        if why:
            raise ValueError(f"game {index + 1} of {path} is not a legal chess game: {why}; fix or remove it, or "
                             f"pass --illegal_games skip")
    return games, 0


def first_word_is_legal(prefix: list[str], continuation: str) -> bool:
    board = chess.Board()
    for move in prefix:
        board.push_uci(move)
    words = continuation.split()
    if not words:
        return False
    try:
        return chess.Move.from_uci(words[0]) in board.legal_moves
    except ValueError:  # not a move at all: a result, half a word, punctuation
        return False


def context_length(model) -> int | None:
    """How many positions the model can attend to: its config's `max_position_embeddings` (GPT-2's
    `n_positions`, by transformers' alias), found through wrappers' `.module`; None if it names none."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def tokens_per_move(tokenizer) -> int:
    """How many tokens the longest move takes after a space (1 for the tiny model, ~5 for Llama)."""
    return max(len(tokenizer(" " + m, add_special_tokens=False)["input_ids"]) for m in ("a7a8q", "h2h1n", "e2e4"))


@contextmanager
def unwrapped(model):
    """The model to call `generate` on, and whether it is sharded: the model inside any `.module`
    wrapper (DDP, ZeRO-1/2, one process), replicated. A strategy whose model is sharded gives its own
    (`Strategy.ready_to_generate`): then each forward is a collective, and `synced_gpus=True` keeps
    every rank stepping until the last rank's rows are done, as a rank that stopped early would
    leave the others waiting. (Here every rank writes exactly `max_new_tokens`, the end-of-sequence
    stop being off, so the ranks agree anyway; `synced_gpus` keeps the call safe if a stop is turned on.)"""
    while hasattr(model, "module"):
        model = model.module
    yield model, False


@torch.no_grad()
def greedy_continue(model, tokenizer, prompts: list[str], max_new_tokens: int, device,
                    max_length: int | None = None, ready=unwrapped) -> list[str]:
    """Greedy decoding for a batch through Hugging Face's `generate`, left-padded so every prompt
    ends at the last column (`generate` then numbers the positions from the attention mask, so a
    padded prompt sees the positions it was trained on), with the key/value cache: each new token
    costs one position's forward, not the whole sequence's.

    Exactly `max_new_tokens` are written: the end-of-sequence token does not stop a row
    (`eos_token_id=None`), and the text is read with special tokens skipped, as the decoding by
    hand that this replaced did, so the rate of a model that writes `</s>` first is unchanged.

    With `max_length` (the model's context), a prompt keeps only its last `max_length -
    max_new_tokens` tokens: the moves next to the one asked for matter most, and a model with
    learned positions (GPT-2) has no embedding for a position past its context at all.

    `ready(model)`: a context giving the model to call `generate` on and whether it is sharded
    (`unwrapped`, or the strategy's `ready_to_generate`)."""
    ids, mask = left_padded(tokenizer, prompts, max_new_tokens, max_length)
    with ready(model) as (generator, sharded):  # the model inside its wrapper, gathered where sharded
        out = generator.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                 max_new_tokens=max_new_tokens, use_cache=True, eos_token_id=None,
                                 pad_token_id=tokenizer.pad_token_id, synced_gpus=sharded)
    return [tokenizer.decode(row[ids.shape[1]:], skip_special_tokens=True) for row in out.tolist()]


def legal_move_rate(model, tokenizer, prefixes: list[list[str]], device, batch_size: int = 32, group=None,
                    continue_fn=None) -> dict:
    """The share of prefixes whose greedy next move is legal, over all ranks, or over `group`'s:
    the data-parallel ranks, when tensor- or pipeline-parallel ranks must judge the same prefixes
    together. `continue_fn` writes the continuations, with `greedy_continue`'s arguments (None: it);
    a pipeline stage passes `parallel/pipeline/generate.py`'s `continue_fn(stage, group)`, and its
    context is read from the stage's config."""
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
    mine = prefixes[rank::world]
    per_rank = -(-len(prefixes) // world)  # every rank loops this many times (see module doc)
    padded = mine + [prefixes[0]] * (per_rank - len(mine))
    new_tokens, context = tokens_per_move(tokenizer) + 1, context_length(model)
    was_training = model.training
    model.eval()
    legal, samples = 0, []
    for start in range(0, per_rank, batch_size):
        chunk = padded[start: start + batch_size]
        outputs = (continue_fn or greedy_continue)(model, tokenizer, [" ".join(p) for p in chunk], new_tokens, device,
                                                   context)
        for i, (prefix, text) in enumerate(zip(chunk, outputs)):
            if start + i < len(mine):  # the padding is not counted
                legal += first_word_is_legal(prefix, text)
                if len(samples) < 3:
                    samples.append((" ".join(prefix[-3:]), text.split()[0] if text.split() else ""))
    model.train(was_training)
    counts = torch.tensor([legal, len(mine)], dtype=torch.long, device=device)
    if dist.is_initialized():
        dist.all_reduce(counts, group=group)
    legal, total = counts.tolist()
    return {"legal_move_rate": legal / max(total, 1), "legal": legal, "total": total, "samples": samples}


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval for a rate measured as `successes` out of `trials`.

    A legal-move rate is a count out of n prefixes, so it carries sampling error: at n = 200 and
    a rate near 25%, the 95% interval is about 20-32%, wide enough that two runs (or two
    implementations) a few points apart cannot be ranked. Wilson's interval (Wilson 1927, "Probable
    inference, the law of succession, and statistical inference"; recommended over the textbook
    p +- z sqrt(p(1-p)/n) by Newcombe 1998, "Two-sided confidence intervals for the single
    proportion", and Brown, Cai and DasGupta 2001) inverts the normal test around the unknown
    rate instead of the measured one, so it stays inside [0, 1] and does not collapse to a point
    at 0 of n or n of n. Returns (low, high) as fractions."""
    if not (isinstance(trials, int) and trials >= 1):
        raise ValueError(f"a rate needs at least one trial, got trials={trials!r}")
    if not (isinstance(successes, int) and 0 <= successes <= trials):
        raise ValueError(f"successes must be a whole number from 0 to trials={trials}, got {successes!r}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be between 0 and 1 (0.95 for 95%), got {confidence!r}")
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)  # 1.96 for 95%
    p, n = successes / trials, trials
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)
