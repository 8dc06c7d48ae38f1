"""The legal-move rate of a saved model, from the command line (the metric is `chess/legal_moves.py`).

    python -m minidist.evaluate --model runs/laptop/model --data minidist/chess/data/test.jsonl
    python -m minidist.evaluate --model tiny --num_prefixes 50   # the untrained tiny Llama: about 0
"""

import torch

from minidist.chess.games import bundled_games
from minidist.chess.jsonl import load_games
from minidist.chess.legal_moves import game_prefixes, legal_move_rate
from minidist.hf import model_folder
from minidist.hf.models import load_model, load_tokenizer
from minidist.runtime.errors import ArgumentParser, one_line_errors


def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m minidist.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="hub name, local folder, or `tiny`")
    parser.add_argument("--data", default=str(bundled_games("test")), help="held-out games (jsonl)")
    parser.add_argument("--num_prefixes", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.num_prefixes < 1:
        parser.error("--num_prefixes must be at least 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with one_line_errors("minidist.evaluate", FileNotFoundError, ValueError):  # the data first: it is cheap
        prefixes = game_prefixes(load_games(args.data), args.num_prefixes, args.seed)
        model_folder.check_folder(args.model)
        tokenizer, model = load_tokenizer(args.model), load_model(args.model, device=device)
    result = legal_move_rate(model, tokenizer, prefixes, device)
    print(f"legal-move rate {result['legal_move_rate']:.1%} ({result['legal']}/{result['total']} prefixes)")


if __name__ == "__main__":
    main()
