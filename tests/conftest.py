import http.server
import os
import shutil
import subprocess
import tempfile
import threading

import pytest

from support.gloo_store import Store
from support.launch import SITE, pythonpath, with_site

# Worker scripts run a job when imported: --doctest-modules must not import them.
collect_ignore_glob = ["distributed/workers/*.py", "support/hvdrun_fast_discovery.py",
                       "support/site/*.py"]


def pytest_configure(config):
    """The processes the suite starts import tests/support/site/sitecustomize.py, which spares
    each the import of ``torch._dynamo`` that torch's eager optimizers make and do not use;
    ``HVD_ADAPT_TEST_TORCH_AS_IS=1`` runs them as a user's processes run."""
    if os.environ.get("HVD_ADAPT_TEST_TORCH_AS_IS") == "1":
        if SITE in pythonpath(os.environ):
            # Inherited from a suite's process: this one has imported the site already.
            raise pytest.UsageError(f"HVD_ADAPT_TEST_TORCH_AS_IS=1, but PYTHONPATH names {SITE}: "
                                    "take it off PYTHONPATH")
        return
    os.environ.update(with_site(os.environ))


@pytest.fixture(autouse=True, scope="session")
def job_directories_under_pytests_temp(tmp_path_factory):
    """Jobs' log and report directories (``tempfile.mkdtemp`` in the launch helpers) go
    under pytest's base temp, which pytest prunes to the last few runs, instead of piling
    up in /tmp with every run of the suite."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tempfile, "tempdir", str(tmp_path_factory.getbasetemp()))
        yield


@pytest.fixture
def shared_tmp():
    """A fresh folder like /tmp (mode 1777, reachable by every user) outside pytest's private
    base temp, removed afterwards."""
    folder = tempfile.mkdtemp(prefix="hvd_adapt-shared-", dir="/tmp")
    os.chmod(folder, 0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def full_disk(tmp_path):
    """A folder on a 256 KiB tmpfs, with ``fill(folder)`` (tests/support/full_disk.py) to use
    up what is left; skipped (with the reason) where this process may not mount one."""
    folder = tmp_path / "small_disk"
    folder.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs",
                              str(folder)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a small tmpfs was refused: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.fixture
def store():
    """A key-value store like horovodrun's (tests/support/gloo_store.py), empty, served on
    127.0.0.1; the fixture is the client hvd_adapt's rendezvous code talks to."""
    from hvd_adapt._runtime.rendezvous import RendezvousServer
    Store.data = {}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Store)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield RendezvousServer(*server.server_address)
    server.shutdown()
    server.server_close()
