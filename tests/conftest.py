"""Shared fixtures: a tiny Llama written once per test session, loaded like any hub model; a weightier
one and long games for the memory measurements (tests/memory, tests/parallel's LoRA). The `slow`
marker, which splits the suite in two tiers. And the session's summary of each notebook's time and
of the long modules. (The real SLURM cluster's fixture is `cluster/conftest.py`'s.)

And one setting for every process the session starts: OpenMP threads that wait sleep
(`OMP_WAIT_POLICY=PASSIVE`, unless the environment sets it). By default a thread of torch's pool that
has run out of work spins for a while before it sleeps, which costs nothing on an idle machine; the
suite runs ranks, notebooks and SLURM jobs side by side on two cores, where every spin takes a core
from another process. Measured on the 2-core machine, 20 steps of the 4.15M-parameter Llama on
torch's 2 threads beside one busy process: 5.5 CPU s (4.4 s of wall) spinning, 1.3-1.6 CPU s (as
many of wall) sleeping. It changes no result: which thread waits how is not arithmetic. Set here, before
torch is imported: OpenMP reads it when it loads, and every process the tests start inherits it."""

import os
import sys

assert "torch" not in sys.modules, "tests/conftest.py must set OMP_WAIT_POLICY before torch is imported"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

from minidist.chess import jsonl
from minidist.chess.games import bundled_games
from minidist.hf.models import write_tiny_llama
from session_summary import long_modules, notebook_times


def pytest_configure(config):
    """Two tiers: `python -m pytest tests -m "not slow"` is the fast one a newcomer runs first (the
    layout rules, the pipeline's schedules and their NCCL-order model, the byte formulas, the memory
    estimate, bad input in one line, and one 2-rank parity run of each hand-written strategy,
    tests/parallel/test_fast_parity.py); `python -m pytest tests` is the whole suite, what CI runs.
    A module or a test is slow when it runs notebooks, SLURM, fault injection or benchmarks,
    launches ranks more than once, or is long otherwise (lessons/reference/tests.md says which)."""
    config.addinivalue_line("markers", "slow: the full suite only (notebooks, SLURM, fault injection, benchmarks, "
                                       "repeated launches, long runs); deselect with -m \"not slow\"")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 2-layer, 64-wide Llama with the chess tokenizer: small enough for many short runs."""
    return str(write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", hidden_size=64, num_layers=2))


@pytest.fixture(scope="session")
def weighty_model(tmp_path_factory):
    """The 4.15M-parameter tiny Llama (4 layers, 256 wide): as at 7B, a layer's activations weigh
    about as much as the logits, and the embedding and output layer a small part of the weights.
    (In the 64-wide conftest model the logits outweigh a layer's activations three times over.)
    Written once per session, as `tiny_model`: three modules read it, and none writes into it."""
    return str(write_tiny_llama(tmp_path_factory.mktemp("weighty") / "llama"))


@pytest.fixture(scope="session")
def long_games(tmp_path_factory):
    """64 held-out games of more than 40 moves: at 32 tokens a sequence (tests/memory) every
    micro-batch is full, with no padding, so its bytes are the same from step to step."""
    games = [g for g in jsonl.load_games(bundled_games("test")) if len(g.split()) > 40][:64]
    path = tmp_path_factory.mktemp("games") / "long.jsonl"
    jsonl.write_games(games, path)
    return str(path)


def pytest_terminal_summary(terminalreporter):
    """Print each notebook's time, and the modules over 300 code lines, at the end of the session,
    whether or not `-s` is given."""
    lines = notebook_times(terminalreporter.stats)
    if lines:
        terminalreporter.write_sep("-", "notebook times, small configuration (budget: reported, not asserted)")
        for line in lines:
            terminalreporter.write_line(line)
    lines = long_modules(terminalreporter.stats)
    if lines:
        terminalreporter.write_sep("-", "modules over 300 code lines, docstrings and comments apart (not failed)")
        for line in lines:
            terminalreporter.write_line(line)
