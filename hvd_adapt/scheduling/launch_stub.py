"""The launch stub (``hvd-adapt-worker --standby-dir DIR -- COMMAND``, what Horovod starts
for a slot): it hands the slot to a ready standby of its host, or runs COMMAND itself.

Standard library only, so it starts in milliseconds. It claims a standby
(an atomic rename of its ready file), checks it is its own user's (the
folder ``DIR/<host>``, the ready file and the socket belong to that user and
no one else may write them; the process on the socket is that user's and the
very pid the ready file names, ``SO_PEERCRED``), passes it the slot's
environment (:func:`slot_environment`), working directory and standard
streams, forwards signals to it and returns its exit code. Where no standby
is ready, or anything about a claim fails, :func:`hand_over` returns None
and the caller starts the command cold.
"""
import json
import os
import signal
import socket
import stat
import sys

from .._runtime.handover import CLAIM_SECONDS, ENV_FD, peer_credentials, recv_message, send_message
from .._runtime.private_files import (UnsafePathError, check_owned, read_own_file,
                                      remove_if_present)
from .ready import ready_files

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# The slot's variables a script needs (Horovod's rendezvous and ranks, the launcher's
# settings for the library, NCCL, Gloo and MPI, the devices of the slot); the rest of the
# launcher's environment (its secrets among them) stays with the stub.
SLOT_PREFIXES = ("HOROVOD_", "HVD_ADAPT_", "NCCL_", "GLOO_", "OMPI_", "PMIX_")
SLOT_NAMES = ("CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED")
# A ready file is a few hundred bytes; more is not one.
_READY_FILE_LIMIT = 1 << 16


def slot_environment(environ, passed=()):
    """The part of ``environ`` a stub hands its standby: :data:`SLOT_PREFIXES`,
    :data:`SLOT_NAMES` and the names in ``passed`` (``--pass-env``)."""
    return {name: value for name, value in environ.items()
            if name != ENV_FD and (name.startswith(SLOT_PREFIXES) or name in SLOT_NAMES
                                   or name in passed)}


def warn(message):
    """One line on stderr, prefixed with the program's name (the stub has no logging set up:
    its stderr is the slot's)."""
    sys.stderr.write(f"hvd-adapt-worker: {message}\n")
    sys.stderr.flush()


def hand_over(folder, host, command, passed=()):
    """Hand this process's slot to a ready standby of ``host`` running ``command``; returns
    the standby's exit code once it ends, or None when no standby took the slot (a
    warning on stderr says why where one was refused). Only the slot's environment
    (:func:`slot_environment` with ``passed``) goes to the standby."""
    try:
        paths = ready_files(folder, host)
    except OSError as e:        # UnsafePathError among them: a folder others may write
        warn(f"not using the standby folder: {e}")
        return None
    for path in paths:
        try:
            connection = _claim(path, command)
        except Exception as e:      # any failed claim is a cold start, never a failed slot
            warn(f"not using the standby of {path}: {e}")
            continue
        if connection is None:
            continue
        try:
            send_message(connection, {"env": slot_environment(os.environ, passed),
                               "cwd": os.getcwd()}, (0, 1, 2))
        except OSError as e:
            connection.close()
            warn(f"the standby of {path} went away during the hand-over: {e}")
            continue
        return _relay(connection)
    return None


def _claim(path, command):
    """The connection to the standby of ready file ``path`` once it is claimed and proved
    to be this user's; None where it is another command's, already claimed or gone."""
    info = json.loads(read_own_file(path, limit=_READY_FILE_LIMIT))
    if not (isinstance(info, dict) and isinstance(info.get("socket"), str)
            and type(info.get("pid")) is int and isinstance(info.get("command"), list)):
        raise ValueError("not a ready file (socket, pid and command expected)")
    if info["command"] != list(command):
        return None
    claimed = path[:-len(".json")] + ".claimed"
    try:
        st = os.lstat(info["socket"])
    except FileNotFoundError:
        remove_if_present(path)           # its standby ended and its socket with it: the file is stale
        return None
    if not stat.S_ISSOCK(st.st_mode):
        raise UnsafePathError(f"{info['socket']} is not a socket")
    check_owned(st, info["socket"])
    try:
        os.rename(path, claimed)
    except FileNotFoundError:
        return None             # another stub was first
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # A standby that cannot take the connection within CLAIM_SECONDS is not one to wait for.
        connection.settimeout(CLAIM_SECONDS)
        try:
            connection.connect(info["socket"])
        except ConnectionRefusedError:
            remove_if_present(claimed)    # a killed standby's file and socket
            connection.close()
            return None
        pid, uid = peer_credentials(connection)
        if uid != os.geteuid() or pid != info["pid"]:
            raise UnsafePathError(f"{info['socket']} is served by pid {pid} of uid {uid}, not "
                                  f"by the standby's pid {info['pid']} of this user "
                                  f"(uid {os.geteuid()})")
    except BaseException:
        connection.close()
        raise
    connection.settimeout(None)
    return connection


def _relay(connection):
    def forward(signum, frame):
        try:
            send_message(connection, {"signal": signum})
        except OSError:
            pass

    for signum in _FORWARDED:
        signal.signal(signum, forward)
    with connection:
        try:
            message, _ = recv_message(connection)
            return int(message["exit"])
        except (EOFError, OSError, ValueError, KeyError):
            sys.stderr.write("hvd-adapt-worker: the standby went away without an exit status\n")
            return 1
