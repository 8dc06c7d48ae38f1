"""The training script, or any command's main, run in the test's own process (no start-up of its own),
for what it says when it stops: used by tests/loop, tests/checkpoint, tests/parallel and tests/bench."""

import pytest

from minidist import finetune


def exit_status(main, argv) -> int:
    """Call a command's `main(argv)` as `python -m` would: the status it exits with (0: it returned)."""
    try:
        main(argv)
    except SystemExit as stop:
        return stop.code
    return 0


def run_here(argv, capsys) -> tuple[int, str]:
    """Run `python -m minidist.finetune ARGV` here: its exit status (0: it returned) and its stderr."""
    capsys.readouterr()  # only what the script writes counts
    code = exit_status(finetune.main, argv)
    return code, capsys.readouterr().err


def run_here_in_one_line(argv, capsys) -> tuple[int, str]:
    """`run_here`, where a run that fails must say why in one line without a traceback (besides the
    progress bars that transformers draws while it loads a model): its status and that line."""
    code, err = run_here(argv, capsys)
    if code:
        lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and "%|" not in line]
        assert len(lines) == 1 and "Traceback" not in err, err
        assert lines[0].startswith("minidist.finetune: error: "), lines[0]
        return code, lines[0]
    return code, err


def said(main, argv, capsys) -> str:
    """Run a command's main here: it must exit with status 2 and one error line, the last one printed
    (argparse's usage may come before it), and no traceback. Returns that line."""
    capsys.readouterr()  # only what the command writes counts
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert stop.value.code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert errors[0] == err.strip().splitlines()[-1], err
    return errors[0]
