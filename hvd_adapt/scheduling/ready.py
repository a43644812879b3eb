"""The standbys' ready files: ``<folder>/<host>/<pid>.json``, fresh while their heartbeat is.

A standby (:mod:`hvd_adapt.scheduling.standby`) writes its file once booted
and touches it every second while it waits; the launch stub claims it by
renaming it. ``hvd-adapt-discover`` counts the fresh ones every second, so
this module is the standard library's ``glob``, ``os`` and ``time`` only.

>>> ready_count("/nonexistent", "host")
0
"""
import glob
import os
import time

# A ready file this much older than its heartbeat is a dead standby's.
FRESH_SECONDS = 5.0


def ready_files(folder, host):
    """The ready files of ``host``'s standbys under ``folder`` whose heartbeat is fresh."""
    now = time.time()
    fresh = []
    for path in glob.glob(os.path.join(folder, glob.escape(host), "*.json")):
        try:
            if now - os.stat(path).st_mtime <= FRESH_SECONDS:
                fresh.append(path)
        except FileNotFoundError:
            pass
    return sorted(fresh)


def ready_count(folder, host):
    """How many standbys wait ready on ``host``."""
    return len(ready_files(folder, host))
