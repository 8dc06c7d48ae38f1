"""Launch variables no launcher writes are refused at once, in one line; ranks that wait for a peer
say every period which ranks are missing, and a rendezvous that times out names them in one line."""

import pytest
from in_process import said

from minidist import finetune
from minidist.runtime import distributed
from minidist.runtime.errors import UsageError

LAUNCH_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "SLURM_PROCID", "SLURM_NTASKS", "TORCHELASTIC_USE_AGENT_STORE"]

REFUSED = [  # (the environment, the line must contain this)
    ({"WORLD_SIZE": "2"}, "error: WORLD_SIZE=2 in the environment without RANK: start the ranks with torchrun"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "error: RANK=2 in the environment must be less than WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "abc"}, "error: WORLD_SIZE='abc' in the environment is not a whole number"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "error: RANK='-1' in the environment is not a whole number 0 or more"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "error: WORLD_SIZE=0 in the environment: a world has at least 1 process"),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
     "error: LOCAL_RANK=2 in the environment must be less than LOCAL_WORLD_SIZE=2"),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4", "MASTER_ADDR": "127.0.0.1"},
     "error: RANK=4 in the environment must be less than WORLD_SIZE=4"),
]


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MINIDIST_TIMEOUT_S", "5")  # on the code before, a rendezvous that waits ends in a traceback
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return monkeypatch


def _named(environ: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in environ.items())


@pytest.mark.parametrize("environ,expected", REFUSED, ids=[_named(e) for e, _ in REFUSED])
def test_inconsistent_launch_variables_are_refused_in_one_line(clean_env, tiny_model, tmp_path, capsys, environ,
                                                              expected):
    for name, value in environ.items():
        clean_env.setenv(name, value)
    argv = ["--model", tiny_model, "--impl", "torch", "--output_dir", str(tmp_path), "--eval_prefixes", "0",
            "--max_steps", "1", "--no_save"]
    assert expected in said(finetune.main, argv, capsys)
    assert not (tmp_path / "metrics.jsonl").exists()


def _wait_alone(clean_env, capsys, rank: int) -> tuple[str, list[str]]:
    """Rank `rank` of a world of 2 whose peer never comes: its one-line error and the lines it said meanwhile."""
    clean_env.setenv("RANK", str(rank))
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(distributed.find_free_port()))
    capsys.readouterr()
    with pytest.raises(UsageError) as refused:
        distributed.init_distributed(timeout_s=3.5, device_type="cpu", wait_line_every_s=1.0)
    return str(refused.value), capsys.readouterr().err.splitlines()


def test_rank_0_names_the_missing_rank_every_period_then_ends_in_one_line(clean_env, capsys):
    error, lines = _wait_alone(clean_env, capsys, rank=0)
    assert error.startswith("rank 1 never joined in 4 s (rank 0 of WORLD_SIZE=2 at 127.0.0.1:"), error
    waiting = [line for line in lines if line.startswith("minidist: waiting for rank 1 to join (1 of 2 joined, ")]
    assert len(waiting) >= 2, lines  # one a second over 3.5 s


def test_a_rank_without_rank_0_says_so_every_period(clean_env, capsys):
    error, lines = _wait_alone(clean_env, capsys, rank=1)
    assert error.startswith("the other ranks never joined in 4 s (rank 1 of WORLD_SIZE=2"), error
    waiting = [line for line in lines if line.startswith("minidist: rank 1 waiting for rank 0's store at 127.0.0.1:")]
    assert len(waiting) >= 2, lines
