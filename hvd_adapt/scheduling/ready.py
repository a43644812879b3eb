"""The standbys' ready files: ``<folder>/<host>/<pid>.json``, and whether their heartbeat beats.

A standby (:mod:`hvd_adapt.scheduling.standby`) writes its file once booted
and touches it every second while it waits; the launch stub claims it by
renaming it. ``hvd-adapt-discover`` counts the live ones every second, so
this module is the standard library's ``glob`` and ``os`` only (and the checks
of :mod:`hvd_adapt._runtime.private_files`).

A heartbeat is judged without comparing clocks: the modification time of a
ready file is set by whichever clock the file system uses (an NFS server's,
a pod's that drifted), so its absolute value says nothing to a reader on
another machine. The reader remembers what it saw instead: a file counts as
live once the reader has seen its modification time *change*, and for
:data:`FRESH_SECONDS` of the reader's own clock after the last change it
saw. A file seen for the first time is not yet live (one heartbeat later it
is); a dead standby's file stops changing and stops counting, whatever time
it carries.

Only a folder ``<folder>/<host>`` of this user that no other user may write
counts (see :func:`host_folder`): another local user cannot plant a file
there, and the launch stub checks the standby's credentials on its socket
besides.

>>> ready_count("/nonexistent", "host", {}, now=0.0)
(0, {})
"""
import glob
import os

from .._runtime.private_files import check_private_folder

# A ready file whose heartbeat the reader has not seen change for this long is a dead standby's.
FRESH_SECONDS = 5.0


def host_folder(folder, host):
    """``<folder>/<host>``, checked: a real folder of this user that no other user may write.
    Raises ``FileNotFoundError`` when it is missing and
    :class:`~hvd_adapt._runtime.private_files.UnsafePathError` (naming the owner and mode)
    when another user could plant files in it."""
    return check_private_folder(os.path.join(folder, host))


def ready_files(folder, host):
    """Every ready file of ``host``'s standbys under ``folder``, in name order; []
    when the host has no folder. Whether a standby is alive its socket tells (the stub
    connects); :func:`ready_count` judges heartbeats. Raises
    :class:`~hvd_adapt._runtime.private_files.UnsafePathError` for a folder other users
    may write."""
    try:
        path = host_folder(folder, host)
    except FileNotFoundError:
        return []
    return sorted(glob.glob(os.path.join(glob.escape(path), "*.json")))


def ready_count(folder, host, seen, now):
    """How many of ``host``'s standbys beat, judged on this reader's clock ``now`` and what
    it saw before: ``seen`` maps a ready file to ``[mtime_ns, last change seen at]`` (the
    second None until a change is seen). Returns the count and the ``seen`` entries to keep
    for the next call (files that are gone are forgotten). A host folder other users may
    write raises :class:`~hvd_adapt._runtime.private_files.UnsafePathError`."""
    count, kept = 0, {}
    for path in ready_files(folder, host):
        try:
            mtime = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            continue
        before, changed_at = seen.get(path, (None, None))
        if before is not None and mtime != before:
            changed_at = now
        if changed_at is not None and now - changed_at <= FRESH_SECONDS:
            count += 1
        kept[path] = [mtime, changed_at]
    return count, kept
