"""A small file system the test mounts (tmpfs, as root) and fills: a disk that is full."""
import os
import subprocess

import pytest


@pytest.fixture
def full_disk(tmp_path):
    """A folder on a 256 KiB tmpfs, with ``fill(folder)`` to use up what is left; skipped
    (with the reason) where this process may not mount one."""
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


def fill(folder, leave=0):
    """Write a filler file into ``folder`` until the file system is full, then free ``leave``
    bytes of it (a write then ends short, rather than failing at once)."""
    path = os.path.join(folder, "filler")
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    os.truncate(path, max(0, os.path.getsize(path) - leave))
