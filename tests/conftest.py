import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# tests/cluster's helpers (the namespace cluster): a conftest.py of its own there would clash
# with this one (pytest imports both as the module "conftest"), so its fixtures live here.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "cluster"))

# Worker scripts run a job when imported: --doctest-modules must not import them.
collect_ignore_glob = ["distributed/workers/*.py", "hvdrun_fast_discovery.py"]


@pytest.fixture(autouse=True, scope="session")
def job_directories_under_pytests_temp(tmp_path_factory):
    """Jobs' log and report directories (``tempfile.mkdtemp`` in the launch helpers) go
    under pytest's base temp, which pytest prunes to the last few runs, instead of piling
    up in /tmp with every run of the suite."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tempfile, "tempdir", str(tmp_path_factory.getbasetemp()))
        yield


@pytest.fixture(scope="module")
def bed(request, tmp_path_factory):
    """The namespace cluster (tests/cluster/bed.py): 3 hosts (a module's ``BED_HOSTS`` where it
    sets one) and the launcher's own, one per test module."""
    import bed as cluster
    reason = cluster.missing()
    if reason:
        pytest.skip(reason)
    with cluster.Bed(getattr(request.module, "BED_HOSTS", 3), ssh_options=cluster.KEEPALIVE,
                     launcher=True, root=str(tmp_path_factory.mktemp("bed"))) as made:
        yield made


@pytest.fixture
def job_dir(tmp_path):
    """A folder on the cluster's shared file system for one job's script, logs and
    checkpoints (every host reads and writes it as root; pytest's 0700 is fine)."""
    return str(tmp_path)
