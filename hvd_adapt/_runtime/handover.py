"""The worker's side of a standby's hand-over, and the wire format the hand-over speaks.

A standby worker (``hvd-adapt-worker --standby``, see
:mod:`hvd_adapt.scheduling.standby`) runs the training script ahead of its
join: the script boots as usual and blocks in :func:`hvd_adapt.init`, which
calls :func:`wait_for_handover` first. There, a script started by a
standby's supervisor (``HVD_ADAPT_STANDBY_FD`` set) reports ready over the
socket its supervisor passed and waits until a launch hands over its slot:
environment, working directory and standard streams. Everywhere else it
returns at once.

The messages (between the script, its supervisor and the launch stub that
Horovod starts) are a length header that may carry file descriptors, then
JSON: :func:`send_message`, :func:`recv_message`. Standard library only at
import: the supervisor and the stub (``scheduling/``) use it too.
"""
import json
import logging
import os
import socket
import struct
import sys

log = logging.getLogger("hvd_adapt")

ENV_FD = "HVD_ADAPT_STANDBY_FD"
# Seconds a claimed standby waits for its stub to connect before it offers itself again,
# and that a stub waits for a claimed standby to take its connection.
CLAIM_SECONDS = 10.0
_HEADER = struct.Struct("!Q")
_UCRED = struct.Struct("3i")


def send_message(sock, message, fds=()):
    """Send ``message`` (JSON-serialisable) over the Unix socket ``sock``, with ``fds``."""
    data = json.dumps(message).encode()
    header = _HEADER.pack(len(data))
    if fds:
        socket.send_fds(sock, [header], list(fds))
    else:
        sock.sendall(header)
    sock.sendall(data)


def _recv_exactly(sock, n):
    chunks = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise EOFError("the other end closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_message(sock, max_fds=0):
    """``(message, fds)``: the next message on ``sock`` and up to ``max_fds`` descriptors
    sent with it. Raises EOFError where the other end closed the connection."""
    fds = []
    if max_fds:
        header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, max_fds)
        if not header:
            raise EOFError("the other end closed the connection")
        header += _recv_exactly(sock, _HEADER.size - len(header))
    else:
        header = _recv_exactly(sock, _HEADER.size)
    (length,) = _HEADER.unpack(header)
    return json.loads(_recv_exactly(sock, length)), fds


def peer_credentials(sock):
    """``(pid, uid)`` of the process at the other end of the Unix socket ``sock``."""
    pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                _UCRED.size))
    return pid, uid


# What a training script imports after init() in nearly every job is imported
# while the standby waits, so that it does not count in the survivors' pause:
# every public name of the library (each loads its module on first use), and
# what torch.optim imports at the first optimizer's construction (its compiler
# stack, more than a second on this machine): a throwaway optimizer loads it.
def _preload():
    import hvd_adapt
    import torch
    for name in hvd_adapt.__all__:
        getattr(hvd_adapt, name)
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


def wait_for_handover():
    """In a standby (``HVD_ADAPT_STANDBY_FD`` set by its supervisor): report ready, wait until
    a launch hands over its slot, then take on its environment, working directory and
    standard streams. Elsewhere: return at once. :func:`hvd_adapt.init` calls it first."""
    fd = os.environ.pop(ENV_FD, None)
    if fd is None:
        return
    _preload()
    with socket.socket(fileno=int(fd)) as sock:
        send_message(sock, {"ready": True})
        log.info("standby: booted, waiting for a slot")
        message, fds = recv_message(sock, max_fds=3)
    sys.stdout.flush()
    sys.stderr.flush()
    for target, received in zip((0, 1, 2), fds):
        os.dup2(received, target)
        os.close(received)
    os.chdir(message["cwd"])
    # The standby's own environment (its pod's), with the slot's variables over it.
    os.environ.update(message["env"])
