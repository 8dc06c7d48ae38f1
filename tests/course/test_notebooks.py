"""Every lesson notebook runs top to bottom, in its small configuration, without an error.

The notebooks read MINIDIST_SMALL=1 in their first cell and shrink the model and the run. Each is
executed by nbclient in a fresh `python3` kernel of this environment, from notebooks/ (where its
workers_NN.py lives), with the tiny model cached under pytest's temporary folder. The executed
copy stays in memory: the committed notebook keeps the outputs of a full run (re-run them all with
the command in notebooks/README.md).

Time is reported, not asserted. Each notebook's seconds go into its test report
(`record_property`), and `tests/conftest.py` prints them all at the end of the session, with
`-s` or without. `BUDGET_S` is a budget in the benchmark sense: the summary marks a notebook above
it, for a person to look into, and the test still passes; a loaded machine makes every run slower,
and a timed assertion would fail there with nothing wrong in the notebook. What does fail is a
cell that hangs: nbclient's per-cell timeout, `HANG_GUARD_S`, far above any cell's normal time.
"""

import time
from pathlib import Path

import pytest

import nbclient
import nbformat

# The full suite only: the lesson notebooks, each run top to bottom under a Jupyter kernel.
pytestmark = pytest.mark.slow

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
BUDGET_S = 90  # seconds per notebook on the 2-core CI machine, kernel start included: reported, never asserted
HANG_GUARD_S = 600  # seconds per cell before nbclient gives up on it: a hang, not a slow machine


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom_in_its_small_configuration(path, tmp_path, monkeypatch, record_property):
    # The kernel inherits this process's environment: small configuration, a private cache.
    monkeypatch.setenv("MINIDIST_SMALL", "1")
    monkeypatch.setenv("MINIDIST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MPLBACKEND", "agg")  # figures are rendered to PNG outputs, no display needed
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=HANG_GUARD_S,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    started = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
    # For the session's summary (conftest.py): how long it took, against the budget; no assert.
    record_property("notebook_seconds", time.perf_counter() - started)
    record_property("notebook_budget_s", BUDGET_S)


def test_the_summary_reports_each_notebook_time_and_marks_the_ones_over_budget():
    """The summary lists every notebook that recorded a time, passed or failed, and marks those over
    the budget without failing anything; a session without notebooks prints nothing."""
    from types import SimpleNamespace

    from session_summary import notebook_times

    def report(name, seconds, outcome="passed"):
        return SimpleNamespace(nodeid=f"tests/course/test_notebooks.py::test_x[{name}]", outcome=outcome,
                               user_properties=[("notebook_seconds", seconds), ("notebook_budget_s", 90)])

    other = SimpleNamespace(nodeid="tests/chess/test_data.py::test_y", outcome="passed", user_properties=[])
    stats = {"passed": [report("00_memory", 31.42), report("05_fsdp", 123.0), other],
             "failed": [report("02_ddp", 12.0, "failed")]}
    lines = notebook_times(stats)
    assert lines == ["00_memory   31.4 s",
                     "02_ddp      12.0 s  (failed)",
                     "05_fsdp    123.0 s  over the 90 s budget (a benchmark: reported, not a failure)",
                     "3 notebooks, 166.4 s in all"]
    assert notebook_times({"passed": [other]}) == []
