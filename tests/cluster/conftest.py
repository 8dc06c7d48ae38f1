"""The real single-host SLURM cluster (slurm_cluster.py beside this file), started once per session."""

import pytest


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
