"""Start many short training runs and count the ones that do not exit cleanly.

    python tests/checkpoint/exit_loop.py --runs 200                  # 200 runs of each strategy, under torchrun
    python tests/checkpoint/exit_loop.py --runs 200 --launcher fork  # the same, ranks forked: a quarter faster
    python tests/checkpoint/exit_loop.py --runs 200 --jobs 4         # on a machine with 8 or more cores
    python tests/checkpoint/exit_loop.py --runs 200 --minutes 60      # as many as an hour allows, counted

A finished run must exit 0. An abort at process exit ("terminate called without an active
exception", SIGABRT) comes after the run's work is done, in a few runs out of a hundred, so one
run proves nothing. This command starts `--runs` runs of every strategy, each on 2 CPU ranks
(gloo, bf16, one or two steps, no evaluation, no saving), interleaving the strategies so that
each sees the same machine load. It prints a table per strategy: runs, clean exits, aborts
(SIGABRT, or "terminate called" in the output) and other failures (an error, or a run still going
after 5 minutes). It exits 1 if any run failed, and keeps the output of the first failures of
each kind under `--keep`.

Two launchers start the two rank processes of a run:

- `torchrun` (the default): `torchrun --standalone --nproc_per_node 2 -m minidist.finetune`, as
  a learner types it. It caught the abort before the fix (1 run in 60, once, on a machine busy
  with other work).
- `fork`: this process imports `minidist.finetune` once, as a rank would, and forks both ranks
  from it. Each rank then runs `minidist.finetune.main` and leaves through the interpreter's
  ordinary shutdown, as under torchrun. It saves the interpreter start, the imports of
  `minidist.finetune` and torchrun's agent; nothing else is imported before the fork, so each
  rank still sees the import order of a real run. (Not yet run against the code before the fix.)

It is a maintainer's command, not part of the test suite. On 2 cores one run takes about 7 s
with `fork` and 10 s with `torchrun` (mostly each rank's imports), so 200 runs of six strategies
take 2.5 to 3.5 hours there; `--jobs` spreads them over more cores.
"""

import argparse
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: minidist is imported from here
STRATEGIES = ["minidist/ddp", "minidist/zero1", "minidist/zero2", "minidist/fsdp", "torch/ddp", "torch/fsdp"]
ABORT_MARK = "terminate called"
RUN_TIMEOUT_S = 300


def run_arguments(strategy: str, index: int, data: Path, out: Path) -> list[str]:
    impl, name = strategy.split("/")
    steps = 1 + index % 2  # 1 or 2 steps: a run that ends on its first step, and one that goes on
    return ["--impl", impl, "--strategy", name, "--mixed_precision", "bf16", "--max_steps", str(steps),
            "--batch_size_per_device", "2", "--max_seq_length", "32", "--data", str(data),
            "--eval_prefixes", "0", "--no_save", "--log_every", "100", "--output_dir", str(out)]


def start_torchrun(argv: list[str], log: Path) -> list:
    """torchrun with 2 ranks, its output into `log`; returns its process."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "minidist.finetune", *argv]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=dict(os.environ, PYTHONWARNINGS="ignore"))
    return [proc]  # the Popen, not its pid: subprocess reaps the children of Popens it no longer sees


def start_forked(argv: list[str], log: Path) -> list:
    """Fork the 2 ranks of one run from this process; returns their pids."""
    from minidist.runtime.distributed import find_free_port

    port = find_free_port()
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            rank_process(rank, port, argv, log.with_suffix(f".rank{rank}.log"))  # never returns
        pids.append(pid)
    return pids


def rank_process(rank: int, port: int, argv: list[str], log: Path) -> None:
    """Body of a forked rank: become rank `rank` as torchrun would make it, train, and exit through
    the interpreter's shutdown (sys.exit, not os._exit, which would skip the very thing we test)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    from minidist import finetune

    code = 0
    try:
        finetune.main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.exit(code)  # up through the parent's frames (none of which has a `finally`), then shutdown


def wait_all(procs: list, deadline: float) -> list[int | None]:
    """Exit codes of forked pids or Popens (negative: killed by that signal; None: killed here
    after the deadline)."""
    def poll(proc):
        if isinstance(proc, subprocess.Popen):
            return proc.poll()
        done, status = os.waitpid(proc, os.WNOHANG)
        return os.waitstatus_to_exitcode(status) if done else None

    def kill(proc):
        if isinstance(proc, subprocess.Popen):
            proc.kill()
            proc.wait()
        else:
            os.kill(proc, signal.SIGKILL)
            os.waitpid(proc, 0)

    codes = {}
    while len(codes) < len(procs):
        for i, proc in enumerate(procs):
            if i not in codes and (code := poll(proc)) is not None:
                codes[i] = code
        if len(codes) < len(procs):
            if time.monotonic() > deadline:
                for i in set(range(len(procs))) - set(codes):
                    kill(procs[i])
                    codes[i] = None
            time.sleep(0.05)
    return [codes[i] for i in range(len(procs))]


def classify(codes: list[int | None], output: str) -> str:
    if ABORT_MARK in output or "SIGABRT" in output or any(c in (-6, 134) for c in codes):
        return "abort"
    return "clean" if all(c == 0 for c in codes) else "other"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tests/checkpoint/exit_loop.py", description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=200, help="runs per strategy")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (each has 2 rank processes)")
    p.add_argument("--launcher", choices=("torchrun", "fork"), default="torchrun")
    p.add_argument("--strategies", nargs="+", default=STRATEGIES, choices=STRATEGIES)
    p.add_argument("--keep", default="exit_loop_failures", help="folder for the output of failed runs")
    p.add_argument("--minutes", type=float, help="start no run after this many minutes; finish and count the "
                                                 "ones started (the table then says how many each strategy got)")
    args = p.parse_args(argv)
    if args.runs < 1 or args.jobs < 1:
        p.error("--runs and --jobs must be at least 1")

    sys.path.insert(0, str(ROOT))
    from minidist.chess import jsonl
    from minidist.chess.games import bundled_games

    if args.launcher == "fork":
        # What a rank imports before it runs (and nothing more); see the module docstring.
        import minidist.finetune  # noqa: F401
    start = {"fork": start_forked, "torchrun": start_torchrun}[args.launcher]
    parent = os.getpid()
    work = Path(tempfile.mkdtemp(prefix="exit_loop_"))  # not a `with`: forked ranks must not remove it
    games = work / "games.jsonl"  # a few games: tokenizing 3,000 would dominate a one-step run
    jsonl.write_games(jsonl.load_games(bundled_games("train"))[:64], games)
    keep = Path(args.keep)
    counts = {s: {"clean": 0, "abort": 0, "other": 0} for s in args.strategies}
    plan = [(s, i) for i, s in itertools.product(range(args.runs), args.strategies)]
    running, t0 = [], time.monotonic()
    while plan or running:
        if args.minutes is not None and time.monotonic() - t0 > 60 * args.minutes:
            plan = []  # out of time: let the running ones finish, start no more
        while plan and len(running) < args.jobs:
            strategy, i = plan.pop(0)
            name = f"{strategy.replace('/', '-')}-{i}"
            log = work / f"{name}.log"
            procs = start(run_arguments(strategy, i, games, work / name), log)
            running.append((strategy, log, procs, time.monotonic() + RUN_TIMEOUT_S))
        if not running:  # out of time between two runs: nothing left to wait for
            break
        strategy, log, procs, deadline = running.pop(0)
        codes = wait_all(procs, deadline)
        logs = sorted(work.glob(log.stem + "*.log"))
        output = "".join(f.read_text(errors="replace") for f in logs)
        kind = classify(codes, output)
        counts[strategy][kind] += 1
        if kind != "clean" and counts[strategy][kind] <= 3:
            keep.mkdir(exist_ok=True)
            (keep / f"{strategy.replace('/', '-')}-{kind}-{counts[strategy][kind]}.log").write_text(
                f"exit codes {codes}\n{output}")
        for f in logs:
            f.unlink()
        done = sum(sum(c.values()) for c in counts.values())
        if done % 30 == 0:
            print(f"{done}/{done + len(plan) + len(running)} runs, {time.monotonic() - t0:.0f} s, "
                  f"{sum(c['abort'] for c in counts.values())} aborts", file=sys.stderr, flush=True)

    assert os.getpid() == parent
    shutil.rmtree(work)
    print(f"{args.launcher}: up to {args.runs} runs per strategy, 2 ranks, {time.monotonic() - t0:.0f} s")
    print(f"{'strategy':<16}{'runs':>6}{'clean':>7}{'aborts':>8}{'other':>7}")
    for strategy, c in counts.items():
        print(f"{strategy:<16}{sum(c.values()):>6}{c['clean']:>7}{c['abort']:>8}{c['other']:>7}")
    failed = sum(c["abort"] + c["other"] for c in counts.values())
    if failed:
        print(f"{failed} runs did not exit cleanly; the output of the first ones is in {keep}/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
