"""The namespace cluster as fixtures: ``bed`` (3 hosts, one per test module) and ``job_dir``
(a folder on the shared file system for one job's script, logs and checkpoints)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import bed as cluster  # noqa: E402


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    reason = cluster.missing()
    if reason:
        pytest.skip(reason)
    with cluster.Bed(3, ssh_options=cluster.KEEPALIVE,
                     root=str(tmp_path_factory.mktemp("bed"))) as made:
        yield made


@pytest.fixture
def job_dir(tmp_path):
    # Every host reads and writes it as root; the default 0700 of pytest's folders is fine.
    return str(tmp_path)
