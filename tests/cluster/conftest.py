"""The real single-host SLURM cluster (slurm_cluster.py beside this file), started once per session,
and the order that lets its jobs run in the background of the whole session."""

import pytest

QUEUE_FIRST = "test_the_jobs_are_queued_first"


@pytest.hookimpl(trylast=True)  # after `-m` and `-k` have deselected what they deselect
def pytest_collection_modifyitems(items):
    """When test_slurm.py's queueing test is in the session, run it first and the module's other
    tests last: its jobs then have the whole session to run in (test_slurm.py's docstring says how)."""
    first = [item for item in items if item.path.name == "test_slurm.py" and item.name == QUEUE_FIRST]
    if not first:
        return
    last = [item for item in items if item.path.name == "test_slurm.py" and item.name != QUEUE_FIRST]
    middle = [item for item in items if item.path.name != "test_slurm.py"]
    items[:] = first + middle + last


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real single-host SLURM cluster (tests/cluster/slurm_cluster.py) for the whole session.

    It needs root. Elsewhere its tests skip and say why; in CI (CI=true) they must run, so there
    a missing piece fails them instead."""
    import os
    import tempfile
    from pathlib import Path

    from slurm_cluster import Cluster, ensure_installed

    why_not = "starting a SLURM cluster needs root" if os.geteuid() != 0 else ensure_installed()
    if why_not:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the real-SLURM tests: {why_not}")
        pytest.skip(why_not)
    # Not under pytest's folders: munged wants every folder above its socket open to all.
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="minidist-slurm-")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
