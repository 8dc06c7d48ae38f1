"""`python -m minidist.bench packing` at the smallest sizes: the training loop with and without
`--pack` on 2 CPU ranks, its table's figures consistent with one another, and the padding arithmetic
against the same count made here from `packing.layout` and the sampler's batches alone; bad input
in one line. (No test asserts a time: the ratios are for people to read.)

The command's main runs in the test's own process; its ranks are forked from `launch`'s fork server,
started afresh under the test's captured descriptors, as in tests/bench/test_bench.py."""

import re
import statistics

import pytest

from in_process import exit_status, said
from minidist import packing
from minidist.batches import GlobalBatchSampler, tokenize_games
from minidist.bench import __main__ as bench_command
from minidist.bench import packing as bench_packing
from minidist.chess import jsonl
from minidist.chess.games import bundled_games
from minidist.hf import models
from minidist.runtime import launch

# The full suite only: a benchmark.
pytestmark = pytest.mark.slow

# The arithmetic's layout here: rows of 160 tokens cut some games and hold one or two, so both
# right padding and packing leave some.
LAYOUT = {"world_size": 2, "batch_size_per_device": 3, "accumulation": 2, "max_seq_length": 160, "steps": 40}


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.split("|")[1:-1]]


def number(text: str) -> float:
    """`2,532` -> 2532.0, `37.8%` -> 0.378, `1.18x` -> 1.18 (a median's range after it left out)."""
    text = text.split()[0]
    value = float(text.rstrip("%x").replace(",", ""))
    return value / 100 if text.endswith("%") else value


def padding_by_hand(tokenizer, texts, world_size, batch_size_per_device, accumulation, max_seq_length, steps):
    """The games' lengths, and the mean padding share right-padded and packed and the ratio of their
    positions, counted here: the global batch as world_size x accumulation micro-batches of consecutive
    games, each as wide as its longest; packed, each micro-batch of `packing.layout` as wide as its
    longest row (at least 2), at least one row."""
    whole = [len(ids) + 1 for ids in tokenizer(texts)["input_ids"]]  # and EOS
    sequences = tokenize_games(texts, tokenizer, max_seq_length)
    b = batch_size_per_device
    sampler = GlobalBatchSampler(len(sequences), world_size * b * accumulation, 0)
    shares, positions = ([], []), [0, 0]
    for step in range(steps):
        lengths = [len(sequences[i]) for i in sampler.global_batch(step)]
        padded = sum(b * max(lengths[k:k + b]) for k in range(0, len(lengths), b))
        packed = sum(max(1, len(rows)) * max([2, *(sum(lengths[i] for i in row) for row in rows)])
                     for rank in packing.layout(lengths, world_size, accumulation, max_seq_length) for rows in rank)
        for k, total in enumerate((padded, packed)):
            shares[k].append(1 - sum(lengths) / total)
            positions[k] += total
    return {"lengths": (statistics.median(whole), statistics.fmean(whole), max(whole)),
            "cut": sum(n > max_seq_length for n in whole) / len(whole),
            "padding": [statistics.fmean(s) for s in shares], "bound": positions[0] / positions[1]}


def test_the_bench_times_the_loop_both_ways_and_counts_the_padding_as_the_loop_does(tiny_model, capfd):
    argv = ["packing", "--world_size", "2", "--model", tiny_model, "--max_steps", "2", "--warmup", "1", "--rounds", "1",
            "--max_seq_length", "64", "--tokenizer", tiny_model]
    argv += [arg for name, value in LAYOUT.items() for arg in (f"--layout_{name}", str(value))]
    launch._server_started_with = None  # the ranks' server starts under this test's descriptors (module doc)
    capfd.readouterr()
    try:
        code = exit_status(bench_command.main, argv)
    finally:
        launch._server_started_with = None  # the next launch starts one under the session's
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    assert "run 1/2: round 1/1, max_seq_length 64, unpacked" in err, err
    assert "run 2/2: round 1/1, max_seq_length 64, packed" in err, err
    lines = out.splitlines()

    header = cells(next(line for line in lines if line.startswith("| max_seq_length |")))
    assert header == ["max_seq_length", "unpacked tok/s", "padding", "packed tok/s", "padding", "packed / unpacked",
                      "bound"], header
    rows = [cells(line) for line in lines if line.startswith("| 64 |")]
    assert len(rows) == 1, out
    unpacked, padded, packed, packed_padding, ratio, bound = map(number, rows[0][1:])
    # One round: the ratio is the printed figures' own, to their printed precision.
    assert abs(ratio - packed / unpacked) <= 0.006, rows[0]
    assert bound > 1 and packed_padding < padded, rows[0]
    assert re.search(r"on 2 CPU ranks \(gloo, \d+ thread\(s\) each\).*steps 2-2 timed, 1 round\(s\)", out), out

    row = cells(next(line for line in lines if line.startswith(f"| {tiny_model} |")))
    expected = padding_by_hand(models.load_tokenizer(tiny_model), jsonl.load_games(bundled_games("train")),
                               *LAYOUT.values())
    median, mean, longest = map(number, row[1].split(", "))
    assert abs(median - expected["lengths"][0]) <= 0.5 and longest == expected["lengths"][2], row  # printed whole
    assert abs(mean - expected["lengths"][1]) <= 0.05 + 1e-9, row
    for printed, wanted in zip(map(number, row[2:5]), [expected["cut"], *expected["padding"]]):
        assert abs(printed - wanted) <= 0.0005 + 1e-9, (row, expected)
    assert abs(number(row[5]) - expected["bound"]) <= 0.005 + 1e-9, (row, expected)
    assert 0 < expected["cut"] and 0 < expected["padding"][1] < expected["padding"][0], expected  # both show


def test_several_rounds_give_the_median_of_the_rounds_ratios_and_one_bound():
    """Three rounds of made-up records: each round's figure is its steps' median, the ratio the median of
    the rounds' ratios (not of the medians' ratio), the bound the positions' ratio over every step;
    runs that trained on different tokens are refused."""
    def run(speeds, padded):  # two steps of 100 real tokens each
        return [{"step": n + 2, "tokens_per_s": v, "real_tokens": 100, "padded_tokens": padded,
                 "padding_share": padded / (100 + padded)} for n, v in enumerate(speeds)]

    rounds = [(run([100, 120], 60), run([150, 150], 10)), (run([90, 90], 60), run([200, 220], 10)),
              (run([110, 110], 60), run([120, 120], 10))]
    figures = bench_packing.setting(rounds)
    assert figures["speed"] == {"unpacked": [110, 90, 110], "packed": [150, 210, 120]}
    assert figures["ratios"] == pytest.approx([150 / 110, 210 / 90, 120 / 110])
    assert figures["bound"] == pytest.approx(160 / 110) and figures["padding"] == pytest.approx([60 / 160, 10 / 110])
    assert bench_packing.spread(figures["ratios"], ".2f", "x") == "1.36x (1.09-2.33)"
    assert bench_packing.spread([2254.0, 1236.0, 2486.0], ",.0f") == "2,254 (1,236-2,486)"
    rounds[1][1][0]["real_tokens"] = 99
    with pytest.raises(RuntimeError, match="different tokens"):
        bench_packing.setting(rounds)


@pytest.mark.parametrize("argv,line", [
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--max_steps", "3", "--warmup", "3"], "--warmup (3) must be less than --max_steps (3): no step would be timed"),
    (["--only", "arithmetic", "--tokenizer", "some-org/not-cached"],
     "could not load 'some-org/not-cached': it is not in the hub cache"),
])
def test_bad_input_is_one_line_before_any_rank_starts(argv, line, capsys, monkeypatch):
    monkeypatch.setattr("minidist.hf.hub.reachable", lambda: False)  # this machine may reach the hub: say it does not
    assert line in said(bench_command.main, ["packing", *argv], capsys)


def test_a_run_the_loop_refuses_is_its_one_line(tiny_model, capsys, monkeypatch):
    """A flag the loop refuses in its ranks (here `--pack` with a model whose attention cannot take the
    mask) ends the command with the loop's own line, not the ranks' traceback. The ranks are not
    started: `launch` fails as it does when they raise."""
    refusal = "--pack needs an attention that takes a block-diagonal mask (sdpa) ..."

    def refused(*args, **kwargs):
        raise launch.RankFailed(0, "Traceback (most recent call last):\n  ...\n"
                                   f"minidist.runtime.errors.UsageError: {refusal}")

    monkeypatch.setattr(launch, "launch", refused)
    line = said(bench_command.main, ["packing", "--only", "speed", "--model", tiny_model], capsys)
    assert line == f"python -m minidist.bench packing: error: minidist.finetune refused a run: {refusal}"
