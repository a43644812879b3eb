import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))

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
