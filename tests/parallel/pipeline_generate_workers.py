"""Worker functions for tests/parallel/test_pipeline_generate.py, run in each rank by `launch`.

Each rank cuts the same tiny float64 Llama (`pipeline_workers.tiny_llama`, over the project's real
chess tokenizer) into its stage and generates through the pipeline; the test compares what every
rank returns with the whole model in one process (`legal_moves`), computed once in the test.

A random model almost never writes a legal move (0 of 64 held-out prefixes for this one), and a
rate of 0 equals 0 whatever the pipeline computes. So `model` makes its head lean towards the
moves that are legal early in a game (every first move of either side: their output rows scaled
up, so that one of them wins the argmax, and the hidden states still choose which one), and the
prompts are the first few moves of held-out games: about half of the greedy moves are then legal,
and a wrong hidden state or position changes which.

A "sabotage" breaks one thing the generation does, to show that the equality the test asserts
depends on it."""

import functools

import chess
import pipeline_workers
import torch
import torch.distributed as dist

from minidist.chess import jsonl, legal_moves
from minidist.chess.games import bundled_games
from minidist.hf.models import build_chess_tokenizer
from minidist.parallel import comm
from minidist.parallel.pipeline import generate, stages

MOVES = [1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 6]  # the first moves of 11 held-out games: prompts of 2 to 10 tokens
MAX_LENGTH = 6  # with 2 new tokens a prompt keeps its last 4 tokens: cuts the 5 longest prompts
BATCH_SIZE = 4  # several batches per rank, the last one padded with uncounted copies
OPENING_BOOST = 5.0


def opening_moves() -> list[str]:
    """White's 20 first moves and Black's 20 replies (the same after each of White's): legal early on."""
    board = chess.Board()
    first = [move.uci() for move in board.legal_moves]
    board.push_uci("e2e4")
    return sorted(first + [move.uci() for move in board.legal_moves])


@functools.cache
def tokenizer():
    """The chess tokenizer, built once per process (seconds on a loaded CPU)."""
    return build_chess_tokenizer()


@functools.cache
def model():
    """The tiny Llama, its head leaning to the opening moves (module doc); the same in every process,
    built once per process: each case cuts its stage from it (a stage shares the model's modules,
    and nothing here changes their weights)."""
    whole = pipeline_workers.tiny_llama()
    tokens = tokenizer().convert_tokens_to_ids(opening_moves())
    with torch.no_grad():
        whole.lm_head.weight[tokens] *= OPENING_BOOST
    return whole.eval()


def prefixes() -> list[list[str]]:
    games = jsonl.load_games(bundled_games("test"))
    return [text.split()[:n] for text, n in zip(games, MOVES, strict=False)]


def prompts() -> list[str]:
    return [" ".join(p) for p in prefixes()]


def new_tokens(tok) -> int:
    return legal_moves.tokens_per_move(tok) + 1  # as legal_move_rate asks for: a move and a space


def reference() -> dict:
    """The whole model in one process, through Hugging Face's `generate` (`legal_moves`)."""
    whole, tok = model(), tokenizer()
    n = new_tokens(tok)
    return {"text": legal_moves.greedy_continue(whole, tok, prompts(), n, "cpu"),
            "cut": legal_moves.greedy_continue(whole, tok, prompts(), n, "cpu", MAX_LENGTH),
            "rate": legal_moves.legal_move_rate(whole, tok, prefixes(), "cpu", batch_size=BATCH_SIZE)}


def groups(pp: int):
    """This rank's pipeline group (pp consecutive ranks, in stage order) and its data-parallel group
    (the ranks at the same stage of each pipeline). Every rank creates every group, as `new_group` asks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    pipelines = [list(range(start, start + pp)) for start in range(0, world, pp)]
    pipeline_groups = [dist.new_group(ranks) for ranks in pipelines]
    data_groups = [dist.new_group(list(range(stage, world, pp))) for stage in range(pp)]
    return pipeline_groups[rank // pp], data_groups[rank % pp]


def zeros_sent(real):
    """Sabotage: every hidden state sent to the next stage is zeros (the shape stays right, nothing hangs)."""
    def send(tensor, *args, **kwargs):
        return real(torch.zeros_like(tensor), *args, **kwargs)
    return send


def run(what, pp, sabotage=None):
    """One case on this rank: the text ("text", "cut": with MAX_LENGTH) or the legal-move rate ("rate")
    through pipelines of `pp` stages (the world / pp pipelines side by side are data-parallel);
    "misplaced": each rank holds the stage of another rank (the error, before any message)."""
    pipeline, data = groups(pp)
    rank = dist.get_rank(pipeline)
    stage = stages.Stage(model(), pp - 1 - rank if what == "misplaced" else rank, pp)
    tok = tokenizer()
    if what == "misplaced":
        try:
            generate.greedy_continue(stage, stage, tok, prompts(), new_tokens(tok), "cpu", None, pipeline)
        except ValueError as error:
            return {"result": str(error)}
    real_send = dist.send
    if sabotage == "zeros":
        dist.send = zeros_sent(real_send)
    comm.counter.take()
    try:
        if what == "rate":
            result = legal_moves.legal_move_rate(stage, tok, prefixes(), "cpu", batch_size=BATCH_SIZE,
                                                 group=data, continue_fn=generate.continue_fn(stage, pipeline))
        else:
            max_length = MAX_LENGTH if what == "cut" else None
            result = generate.greedy_continue(stage, stage, tok, prompts(), new_tokens(tok), "cpu",
                                              max_length, pipeline)
    finally:
        dist.send = real_send
    return {"result": result, "counted": comm.counter.take()}


def cases(specs):
    """Every case of this launch, in order; a case's result on this rank."""
    return [run(**spec) for spec in specs]
