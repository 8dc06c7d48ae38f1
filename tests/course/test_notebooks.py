"""Every lesson notebook runs top to bottom, in its small configuration, without an error, and so does
every widget it draws.

The notebooks read MINIDIST_SMALL=1 in their first cell and shrink the model and the run. Each is
executed by nbclient in a fresh `python3` kernel of this environment, from notebooks/ (where its
workers_NN.py lives). They share one cache (`MINIDIST_CACHE`: the session's own where it names
one, as CI's does, else a folder under pytest's temporary one): the tiny model is written once, and
a model's trace on fake tensors (CodeLlama-7b's, t5-base's: `minidist/memory/cache.py`) is computed
by the first notebook or test that needs it and read back by the others. The
executed copy stays in memory: the committed notebook keeps the outputs of a full run (re-run them
all with the command in notebooks/README.md).

Two notebooks run at a time (`AT_ONCE`), from the module's first test on, each driven by a worker
process of its own (a fresh interpreter: no event loop, socket or thread shared with pytest or the
other notebook) in a kernel of its own. A notebook alone keeps about one of CI's two cores busy
(0.54 of two, from /proc/stat over the 13 in one serial run: its kernel's imports, traces and
figures are one thread's), so a second one beside it fills the other. The workers return what the test asserts on;
a cell's error comes back as its text.

An error inside a widget never reaches nbclient as a cell error: an ipywidgets callback that raises
prints its traceback into its Output widget, and the cell that drew it still succeeds. What the
learner sees there, nbclient keeps, as a frontend would, in the widgets' state (`widget_state`, and
the notebook's `widgets` metadata): so the test reads every Output widget's outputs and fails on an
error among them. Then, in the same kernel, it turns each control of the notebook's calculator once
(`CONTROLS`: lesson 00's), as a learner clicking through it would, and checks after every change
that the calculator's output shows an estimate and no traceback.

Time is reported, not asserted. Each notebook's seconds (kernel start to last cell, beside the
other notebook running) go into its test report (`record_property`), and `tests/conftest.py`
prints them all at the end of the session, with `-s` or without. `BUDGET_S` is a budget in the benchmark sense: the summary marks a notebook above
it, for a person to look into, and the test still passes; a loaded machine makes every run slower,
and a timed assertion would fail there with nothing wrong in the notebook. What does fail is a
cell that hangs: nbclient's per-cell timeout, `HANG_GUARD_S`, far above any cell's normal time.
"""

import multiprocessing
import os
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

import nbclient
import nbformat

# The full suite only: the lesson notebooks, each run top to bottom under a Jupyter kernel.
pytestmark = pytest.mark.slow

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
AT_ONCE = 2  # notebooks executed side by side, each in its own worker process and kernel (module docstring)
# Seconds per notebook on the 2-core CI machine, kernel start included, beside another notebook:
# reported, never asserted.
BUDGET_S = 90
HANG_GUARD_S = 600  # seconds per cell before nbclient gives up on it: a hang, not a slow machine
# Notebook -> (the global dict of its interactive controls, its output widget, the text an estimate shows).
CONTROLS = {"00_memory": ("controls", "output", "peak per rank")}
# Run in the kernel after the notebook: give one control a value other than its own (the next option of a
# dropdown, the other state of a checkbox, twice a number), as a click or a keystroke would.
TURN = """\
_control = {controls}[{name!r}]
if hasattr(_control, "options"):
    _control.value = next(v for v in _control.options if v != _control.value)
elif isinstance(_control.value, bool):
    _control.value = not _control.value
else:
    _control.value = min(_control.value * 2, getattr(_control, "max", _control.value * 2))
print(repr(_control.value))
"""


def widget_errors(client: nbclient.NotebookClient) -> list[str]:
    """The error outputs nbclient holds in its Output widgets (what each shows a learner), as 'ename: evalue'."""
    return [f"{out['ename']}: {out['evalue']}" for state in client.widget_state.values()
            if state.get("_model_name") == "OutputModel"
            for out in state.get("outputs", []) if out.get("output_type") == "error"]


def run_in_kernel(client: nbclient.NotebookClient, source: str) -> str:
    """Execute `source` as one more cell of the notebook, in its kernel; return what it printed."""
    cell = nbformat.v4.new_code_cell(source)
    client.nb.cells.append(cell)
    client.execute_cell(cell, len(client.nb.cells) - 1)  # raises CellExecutionError on an error
    return "".join(out.get("text", "") for out in cell.outputs)


def turn_every_control(client: nbclient.NotebookClient, notebook: str) -> list[str]:
    """Change each control of `notebook`'s calculator once; after each change its output must show
    an estimate (the report's text; the test's `agg` backend draws no figure into it) and no error.
    Returns the controls turned, by name."""
    controls, output, estimate = CONTROLS[notebook]
    names = eval(run_in_kernel(client, f"print(list({controls}))"))
    shown = client.widget_state[run_in_kernel(client, f"print({output}.model_id)").strip()]
    for name in names:
        value = run_in_kernel(client, TURN.format(controls=controls, name=name)).strip()
        outputs = shown["outputs"]
        assert not widget_errors(client), f"{notebook}: {name} = {value}: {widget_errors(client)}"
        text = "".join(out.get("text", "") for out in outputs)
        assert estimate in text, f"{notebook}: {name} = {value}: the calculator shows no estimate: {text[:300]!r}"
    return names


NOTEBOOK_PATHS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
TEST_NAME = "test_notebook_runs_top_to_bottom_in_its_small_configuration"


def execute(path: Path, cache: str) -> dict:
    """In a worker process: run one notebook top to bottom in a kernel of its own, in its small
    configuration, then turn its calculator's controls (`CONTROLS`). Returns its seconds, the errors
    its widgets show, the controls turned, and `error`: None, or the text of what failed (a cell's
    CellExecutionError names the cell and holds its traceback), as text because not every error
    nbclient raises survives the trip back to pytest's process."""
    env = {**os.environ, "MINIDIST_SMALL": "1",  # the small configuration
           "MINIDIST_CACHE": cache,  # the notebooks' shared cache (module docstring)
           "MPLBACKEND": "agg"}  # figures are rendered to PNG outputs, no display needed
    env.pop("MINIDIST_WRITE_FIGURES", None)  # a plain run: the lesson's figures untouched
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=HANG_GUARD_S,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    done = {"seconds": None, "widget_errors": [], "turned": [], "error": None}
    started = time.perf_counter()
    try:
        with client.setup_kernel(env=env):  # one kernel for the notebook and the controls turned after it
            client.execute(cleanup_kc=False)
            done["seconds"] = time.perf_counter() - started
            done["widget_errors"] = widget_errors(client)
            if path.stem in CONTROLS and not done["widget_errors"]:
                done["turned"] = turn_every_control(client, path.stem)
    except Exception:  # noqa: BLE001 - whatever it was, the test shows it whole
        done["error"] = traceback.format_exc()
    return done


@pytest.fixture(scope="module")
def executed(request, tmp_path_factory):
    """Notebook name -> a future of `execute`'s result. The notebooks this session selected start at
    the module's first test, `AT_ONCE` at a time, in order; each test waits for its own."""
    chosen = sorted({item.callspec.params["path"] for item in request.session.items
                     if getattr(item, "originalname", "") == TEST_NAME})
    cache = os.environ.get("MINIDIST_CACHE") or str(tmp_path_factory.mktemp("notebooks-cache"))
    workers = multiprocessing.get_context("spawn")  # fresh interpreters: nothing of pytest's carried over
    with ProcessPoolExecutor(AT_ONCE, mp_context=workers) as pool:
        yield {path.stem: pool.submit(execute, path, cache) for path in chosen}
        pool.shutdown(cancel_futures=True)  # a session cut short starts no more of them


@pytest.mark.parametrize("path", NOTEBOOK_PATHS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom_in_its_small_configuration(path, executed, record_property):
    done = executed[path.stem].result()
    if done["error"]:
        pytest.fail(f"{path.stem}:\n{done['error']}", pytrace=False)
    # For the session's summary (conftest.py): how long it took, against the budget; no assert.
    record_property("notebook_seconds", done["seconds"])
    record_property("notebook_budget_s", BUDGET_S)
    assert not done["widget_errors"], f"{path.stem}: an error inside a widget: {done['widget_errors']}"
    if path.stem in CONTROLS:
        assert len(done["turned"]) >= 8  # the calculator's eight controls, each turned


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
