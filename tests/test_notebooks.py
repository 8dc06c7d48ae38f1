"""Every lesson notebook runs top to bottom, in its small configuration, in under 90 s.

The notebooks read MINIDIST_SMALL=1 in their first cell and shrink the model and the run. Each is
executed by nbclient in a fresh `python3` kernel of this environment, from notebooks/ (where its
workers_NN.py lives), with the tiny model cached under pytest's temporary folder. The executed
copy stays in memory: the committed notebook keeps the outputs of a full run (re-run them all with
the command in notebooks/README.md).
"""

import os
import time
from pathlib import Path

import pytest

import nbclient
import nbformat

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
BUDGET_S = 90  # on the 2-core CI machine, kernel start included


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom_in_its_small_configuration(path, tmp_path, monkeypatch):
    # The kernel inherits this process's environment: small configuration, a private cache.
    monkeypatch.setenv("MINIDIST_SMALL", "1")
    monkeypatch.setenv("MINIDIST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MPLBACKEND", "agg")  # figures are rendered to PNG outputs, no display needed
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=BUDGET_S,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    started = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
    seconds = time.perf_counter() - started
    assert seconds < BUDGET_S, f"{path.name} took {seconds:.0f} s in its small configuration (budget {BUDGET_S} s)"
    print(f"{path.name}: {seconds:.1f} s")
