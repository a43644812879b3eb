import pytest


@pytest.fixture(scope="module")
def bed(request, tmp_path_factory):
    """The namespace cluster (tests/support/bed.py): 3 hosts (a module's ``BED_HOSTS`` where it
    sets one) and the launcher's own, one per test module."""
    from support import bed as cluster
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
