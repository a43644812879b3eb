"""Filling a file system: a disk that is full (the ``full_disk`` fixture, tests/conftest.py,
mounts a small tmpfs as root)."""
import os


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
