"""What `--pack` buys: the real training loop with and without it, and the padding arithmetic of
any tokenizer at any layout (`python -m minidist.bench packing`).

**Measured.** `python -m minidist.finetune` itself, not a copy of its step, runs on `--world_size`
CPU ranks (`launch`) with and without `--pack`, at the laptop run's settings (the tiny Llama, 8
games per rank, the hand-written FSDP), without saving or evaluating, for `--max_steps` steps per
run, once per `--max_seq_length`. Each run writes `metrics.jsonl` as any run does, and the figures
come from it: `tokens_per_s` (the global batch's real tokens over the step's time), and the
positions the ranks computed, `real_tokens` plus `padded_tokens` (`step.step_token_counts`). The
first `--warmup` steps are left out: the first one also traces the step's peak memory, and the
first few touch memory that later steps reuse. Both runs of a setting take the same games, step
by step (checked: the same real tokens at every step), so their tokens per second compare like
with like.

**Why rounds, alternating.** A machine shared with anything else, or a CPU whose clock moves with
its temperature, is faster in one minute than the next. The runs take turns, unpacked then
packed, `--rounds` times, so a slow minute hurts both; each round gives one figure per run, the
median of its timed steps, and one ratio, packed over unpacked. The table gives the median over
the rounds and the spread, lowest to highest: a spread wider than the gain says the machine, not
packing, decided the figure.

**The bound.** Packing removes positions, not work per position: at the same real tokens, the
unpacked run computes (real + padded) positions, the packed run as many or fewer. If a step's time
followed its positions, packing would speed the step by unpacked positions / packed positions over
the same steps: the bound. What holds the measured ratio below it is the part of a step that does
not shrink with the batch's positions: the collectives (an FSDP step all-gathers and
reduce-scatters every weight, whatever the tokens), the optimizer step, the fixed cost of each
kernel's call; and, packed, finding the rows and building the block-diagonal mask. A ratio at or
above the bound says that the cost per position changed between the runs as well: the machine's
speed (the rounds' spread shows how much it moved), or the work itself (attention's grows with a
row's width, a small part of the step at these sizes).

**The arithmetic, no training.** For a tokenizer (`--tokenizer`, any the loop can load; `tiny`
is the chess tokenizer, one token per move) and a layout (by default the capstone's,
`slurm/chess_finetune.sh`: 4 ranks, 4 games each, 2 micro-batches, rows of 512 tokens), the
bundled training games are tokenized as the loop tokenizes them (`batches.tokenize_games`, cut to
the row length), dealt out over `--layout_steps` steps of the loop's sampler (seed 0), and every
step is counted by the loop's own `step.step_token_counts`, right-padded and packed: the padding's
share of each, and the bound. It is what packing promises a run whose step time follows its
positions: a large model on GPUs, where the weights' matrix products are nearly all of the step's
work (at 7B and a context of 512 tokens, attention's own products are 12·L·h·T = 0.8 GFLOPs per
token against the weights' 6P = 40 GFLOPs: 2%).

**What the measured figure cannot show.** It is a CPU with gloo: on gloo ranks the collectives
are a large, fixed part of a small model's step (NCCL over NVLink is another cost altogether), and
a tiny model's step is much of it the fixed cost of each kernel's call. On a GPU the attention differs
too: a packed run in bf16 with flash-attention installed takes its variable-length kernel, which
never builds the mask and computes each game's own triangle only (`packing.choose_attention`),
where the CPU builds rows x s x s booleans and computes every masked score. So the CPU's ratio
says how much of its step followed the positions here; what a GPU run gains is measured there
(`sbatch slurm/chess_finetune.sh --pack`, `metrics.jsonl`'s `tokens_per_s` against a run without).

    python -m minidist.bench packing                                  # 2 ranks, rows of 128 and 256, tiny
    python -m minidist.bench packing --only arithmetic --tokenizer tiny codellama/CodeLlama-7b-hf
"""

import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from minidist.batches import GlobalBatchSampler, tokenize_games
from minidist.step import Packing, step_token_counts

SEED = 0  # the loop's default --seed: its batch order


# ------------------------------------------------------------------------------------- measured
def plan(args, folder: Path) -> list[dict]:
    """The runs, in the order they run: each round, each row length, unpacked then packed. Each
    has its own output folder and log under `folder`, and the argument list of `minidist.finetune`."""
    runs = []
    for round_ in range(args.rounds):
        for length in args.max_seq_length:
            for packed in (False, True):
                name = f"round{round_ + 1}-{length}-{'packed' if packed else 'unpacked'}"
                argv = ["--model", args.model, "--output_dir", str(folder / name), "--max_steps", str(args.max_steps),
                        "--max_seq_length", str(length), "--no_save", "--eval_prefixes", "0"]
                runs.append({"round": round_, "length": length, "packed": packed, "argv": argv + ["--pack"] * packed,
                             "output_dir": str(folder / name), "log": str(folder / f"{name}.log"),
                             "label": f"round {round_ + 1}/{args.rounds}, max_seq_length {length}, "
                                      f"{'packed' if packed else 'unpacked'}"})
    return runs


def records(output_dir) -> list[dict]:
    """The records of a run's `metrics.jsonl`, one per step."""
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def timed(run_records: list[dict], warmup: int) -> list[dict]:
    """The records of the steps after the first `warmup`."""
    return [r for r in run_records if r["step"] > warmup]


@contextmanager
def _output_to(path: str):
    """This process's stdout and stderr, C++'s writes included, into the file at `path`: a run's
    own lines (its steps, its start) go to its log, the command's table stays readable."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as log:
        os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])


def run_in_turn(runs: list[dict], warmup: int) -> int:
    """In each rank of a `launch`: the fine-tunes of `runs`, one after the other, each as
    `torchrun ... -m minidist.finetune ARGV` trains, its output into its log; rank 0 says on stderr
    which run starts and how fast it went. Returns the CPU threads this rank computed on."""
    import torch
    import torch.distributed as dist

    from minidist import finetune

    say = dist.get_rank() == 0
    for n, run in enumerate(runs, start=1):
        if say:
            print(f"packing bench: run {n}/{len(runs)}: {run['label']} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        with _output_to(run["log"]):
            finetune.train(finetune.parse_args(run["argv"]))
        if say:
            steps = timed(records(run["output_dir"]), warmup)
            print(f"packing bench:   {statistics.median(r['tokens_per_s'] for r in steps):,.0f} tok/s (median of "
                  f"steps {steps[0]['step']}-{steps[-1]['step']}), {time.perf_counter() - start:.0f} s in all",
                  file=sys.stderr, flush=True)
    return torch.get_num_threads()


def setting(by_round: list[tuple[list[dict], list[dict]]]) -> dict:
    """One row length's figures from its timed records, (unpacked, packed) per round (module doc):
    tokens/s per round and their median, the mean padding shares, the ratios, and the bound."""
    for unpacked, packed in by_round:  # the same games, step by step, or the comparison means nothing
        if [r["real_tokens"] for r in unpacked] != [r["real_tokens"] for r in packed]:
            raise RuntimeError("the packed and unpacked runs trained on different tokens: the loop's --pack no "
                               "longer keeps the global batch's games")
    speed = {kind: [statistics.median(r["tokens_per_s"] for r in pair[k]) for pair in by_round]
             for k, kind in enumerate(("unpacked", "packed"))}
    ratios = [p / u for u, p in zip(speed["unpacked"], speed["packed"])]

    def positions(k):
        return sum(r["real_tokens"] + r["padded_tokens"] for pair in by_round for r in pair[k])

    return {"speed": speed, "ratios": ratios, "bound": positions(0) / positions(1),
            "padding": [statistics.fmean(r["padding_share"] for pair in by_round for r in pair[k]) for k in (0, 1)]}


def measure(args) -> tuple[dict, int]:
    """Every run of the plan in one launch of `--world_size` ranks, in turn; per row length, the
    figures (`setting`), and the CPU threads a rank had."""
    import importlib

    from minidist.runtime import launch
    from minidist.runtime.errors import UsageError

    with tempfile.TemporaryDirectory(prefix="minidist-bench-packing-") as folder:
        runs = plan(args, Path(folder))
        # By its module's name, not __main__'s: each rank imports the function it runs.
        worker = importlib.import_module("minidist.bench.packing").run_in_turn
        try:
            threads = launch.launch(worker, args.world_size, runs, args.warmup)[0]
        except launch.RankFailed as failed:  # the loop refused a flag (--pack with eager attention): its line
            kind, _, message = failed.traceback.strip().splitlines()[-1].partition(": ")
            if kind.rsplit(".", 1)[-1] != "UsageError":
                raise
            raise UsageError(f"minidist.finetune refused a run: {message}") from None
        steps = {(run["round"], run["length"], run["packed"]): timed(records(run["output_dir"]), args.warmup)
                 for run in runs}
    return {length: setting([(steps[r, length, False], steps[r, length, True]) for r in range(args.rounds)])
            for length in args.max_seq_length}, threads


def spread(values: list[float], form: str, unit: str = "") -> str:
    """The median of `values` and, from two on, their range: `1.34x (1.31-1.36)`."""
    middle = format(statistics.median(values), form) + unit
    return middle if len(values) == 1 else f"{middle} ({format(min(values), form)}-{format(max(values), form)})"


def speed_table(figures: dict, args, threads: int, load: float) -> str:
    """The measured table: a line on what ran, one on what the columns are, a row per row length."""
    from minidist import finetune

    run = finetune.parse_args(plan(args, Path("."))[0]["argv"])  # what the runs were told, defaults included
    lines = [f"measured: python -m minidist.finetune, --impl {run.impl} --strategy {run.strategy}, "
             f"on {args.world_size} CPU ranks (gloo, {threads} thread(s) each), --model {args.model}, "
             f"{run.batch_size_per_device} games per rank, steps {args.warmup + 1}-{args.max_steps} timed, "
             f"{args.rounds} round(s) of unpacked then packed; load average {load:.1f} at the start",
             "tok/s: real tokens per second, median over the rounds of each round's median step (min-max); padding: "
             "padded positions' mean share over the steps; bound: right-padded positions / packed positions, the gain "
             "if time followed positions", "",
             "| max_seq_length | unpacked tok/s | padding | packed tok/s | padding | packed / unpacked | bound |",
             "|" + " --- |" * 7]
    for length, f in figures.items():
        lines.append(f"| {length} | {spread(f['speed']['unpacked'], ',.0f')} | {f['padding'][0]:.1%} "
                     f"| {spread(f['speed']['packed'], ',.0f')} | {f['padding'][1]:.1%} "
                     f"| {spread(f['ratios'], '.2f', 'x')} | {f['bound']:.2f}x |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- arithmetic
def arithmetic(tokenizer, texts: list[str], world_size: int, batch_size: int, accumulation: int,
               max_seq_length: int, steps: int) -> dict:
    """The padding of `steps` steps of this layout, right-padded and packed, counted by the loop's
    `step_token_counts` on the games as the loop tokenizes them (module doc); and the games' lengths
    uncut (the tokenizer's tokens and EOS)."""
    whole = [len(s) for s in tokenize_games(texts, tokenizer, sys.maxsize)]
    sequences = tokenize_games(texts, tokenizer, max_seq_length)
    sampler = GlobalBatchSampler(len(sequences), world_size * batch_size * accumulation, SEED)
    counts = [[step_token_counts(sampler, sequences, step, world_size, batch_size, pack=pack) for step in range(steps)]
              for pack in (None, Packing(max_seq_length))]
    positions = [sum(c["real_tokens"] + c["padded_tokens"] for c in by_step) for by_step in counts]
    return {"median": statistics.median(whole), "mean": statistics.fmean(whole), "max": max(whole),
            "cut": sum(n > max_seq_length for n in whole) / len(whole),
            "padding": [statistics.fmean(c["padding_share"] for c in by_step) for by_step in counts],
            "bound": positions[0] / positions[1]}


def arithmetic_table(rows: dict, args, games: int) -> str:
    """The arithmetic's table: a line on the layout, a row per tokenizer."""
    L = args.layout_max_seq_length
    lines = [f"arithmetic, no training: the {games:,} bundled training games, {args.layout_steps} steps of the loop's "
             f"sampler (seed {SEED}), {args.layout_world_size} ranks x {args.layout_batch_size_per_device} games x "
             f"{args.layout_accumulation} micro-batches (global batch "
             f"{args.layout_world_size * args.layout_batch_size_per_device * args.layout_accumulation}), rows of {L} "
             f"tokens; padding: its mean share of the positions; bound: right-padded positions / packed positions",
             "", f"| tokenizer | tokens per game: median, mean, max | games cut at {L} | padding, right-padded "
                 f"| padding, packed | bound |", "|" + " --- |" * 6]
    for name, a in rows.items():
        lines.append(f"| {name} | {a['median']:,.0f}, {a['mean']:,.1f}, {a['max']:,} | {a['cut']:.1%} "
                     f"| {a['padding'][0]:.1%} | {a['padding'][1]:.1%} | {a['bound']:.2f}x |")
    return "\n".join(lines)


def main(args) -> None:
    """The command, after `bench/__main__.py` has checked its flags: the arithmetic first (every
    tokenizer loaded before any rank starts: a name that cannot be loaded is one line), then the runs."""
    from minidist.chess import jsonl
    from minidist.chess.games import bundled_games
    from minidist.hf import models
    from minidist.runtime.errors import one_line_errors

    prog = "python -m minidist.bench packing"
    with one_line_errors(prog, FileNotFoundError, ValueError):
        if args.only != "arithmetic":
            models.load_config(args.model)  # a folder that is not there, a hub name not cached: one line now
        tokenizers = {} if args.only == "speed" else {name: models.load_tokenizer(name) for name in args.tokenizer}
    if tokenizers:
        texts = jsonl.load_games(bundled_games("train"))
        layout = (args.layout_world_size, args.layout_batch_size_per_device, args.layout_accumulation,
                  args.layout_max_seq_length, args.layout_steps)
        print(arithmetic_table({name: arithmetic(tok, texts, *layout) for name, tok in tokenizers.items()}, args,
                               len(texts)), flush=True)
    if args.only != "arithmetic":
        load = os.getloadavg()[0]
        start = time.perf_counter()
        with one_line_errors(prog):
            figures, threads = measure(args)
        print(("\n" if tokenizers else "") + speed_table(figures, args, threads, load))
        print(f"took {time.perf_counter() - start:,.0f} s")
