"""The watchdog: a small process beside each elastic Gloo worker that ends the worker when
it cannot end itself, on evidence (``_runtime/liveness.py`` says when, and logs why).

Horovod 0.28.1's driver forms the next world only once every worker of the
last one has recorded a state (horovod/runner/elastic/registration.py):
READY with its reset's ``rank_and_size`` request, or SUCCESS/FAILURE when
its ssh command exits. A worker that cannot act for itself never records one,
and its peers wait for it: a **stopped** worker (SIGSTOP, a debugger) or a
**wedged** one (its interpreter deadlocked), whose peers' collectives failed
and who reset without it. A worker whose **launcher is gone** (horovodrun
killed, its host crashed) trains on as an orphan. So ``hvd_adapt.init()`` in
an elastic Gloo launch starts this process with the worker (:func:`start`).
It dies with the worker (``PR_SET_PDEATHSIG``), and about once a second
(``liveness.POLL_SECONDS``) it

- polls the worker's standard output and error (the pipes that horovodrun, or
  the sshd of horovodrun's ssh, reads; they are its own as well, so its lines go
  where the worker's do): an error or hang-up there means nobody reads the
  worker any more;
- asks the job's rendezvous server for the peers' reset marker (put by the
  first worker that enters hvd_adapt's reset, ``_runtime/gloo.py``): answered,
  refused (horovodrun's process is gone) or silent (an outage);
- reads the worker's heartbeat, a counter that a thread of the training
  process writes four times a second into one page of shared memory (a
  memfd, no file, no system call per beat), and its ``/proc`` state and CPU.

A worker that computes, alone or for long, beats; one whose launcher only
does not answer keeps training. Neither is ever ended. A killed worker's
ssh command exits non-zero, the driver records the failure (and blacklists
the host for its cooldown, ``horovodrun --blacklist-cooldown-range``) and
forms a world of the survivors. A script that uses Horovod's own
``hvd.elastic.run`` puts no marker, so only the launcher rules guard it.

The process starts before the worker knows its launch (a standby starts it
before its hand-over, so that a warm join waits for no process to start) and
waits on a socket for the worker to name the rendezvous server and hand it the
standard output and error it then has (:meth:`Beacon.watch`).
"""
import argparse
import json
import logging
import mmap
import os
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

from . import liveness
from .parent_death import death_signal_setter
from .rendezvous import ANSWERED, RESET_KEY, RESET_SCOPE, RendezvousServer

log = logging.getLogger("hvd_adapt")

# The heartbeat: beats since the worker started.
_PAGE = struct.Struct("<q")
_HANGUP = select.POLLERR | select.POLLHUP
STREAMS = {1: "standard output", 2: "standard error"}


class Beacon:
    """The worker's side: a thread that beats in one page of shared memory, the watchdog
    process that reads it, and the socket that tells the watchdog what to watch."""

    def __init__(self):
        self.fd = os.memfd_create("hvd_adapt-heartbeat", 0)
        os.ftruncate(self.fd, _PAGE.size)
        self.page = mmap.mmap(self.fd, _PAGE.size)
        self.process = None
        self.socket = None
        self.thread = threading.Thread(target=self._beat, name="hvd_adapt-heartbeat",
                                       daemon=True)

    def watch(self, server):
        """Tell the watchdog the job's rendezvous ``server`` and hand it this worker's
        standard output and error as they are now (a standby's are its launch's): it starts
        watching."""
        streams = [fd for fd in STREAMS if _is_open(fd)]
        message = json.dumps({"server": str(server), "streams": streams}).encode()
        socket.send_fds(self.socket, [message], streams)
        self.socket.close()

    def close(self):
        """No watching after all (a launch that is not elastic): the watchdog exits."""
        self.socket.close()

    def _beat(self):
        beats = 0
        while True:
            beats += 1
            _PAGE.pack_into(self.page, 0, beats)
            time.sleep(liveness.BEAT_SECONDS)


def _is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def read_beats(page):
    """The worker's heartbeat counter."""
    return _PAGE.unpack_from(page, 0)[0]


# The watchdog runs this module from the folder the worker imported hvd_adapt from, first on
# its path: where the script put a checkout on its own sys.path (hvd_adapt not installed),
# ``python -m`` alone found no hvd_adapt (or another copy of it), and the worker trained
# unwatched or failed in watch() with a broken pipe.
_BOOT = ("import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
         f"runpy.run_module({__name__!r}, run_name='__main__', alter_sys=True)")
_PACKAGE_FOLDER = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start():
    """Start this worker's heartbeat and its watchdog, which waits to be told what to watch
    (:meth:`Beacon.watch`); return the :class:`Beacon`. A standby starts it before its
    hand-over, so that a warm join does not wait for a process to start."""
    beacon = Beacon()
    beacon.thread.start()
    beacon.socket, theirs = socket.socketpair()
    with theirs:
        beacon.process = subprocess.Popen(
            [sys.executable, "-c", _BOOT, _PACKAGE_FOLDER, "--pid", str(os.getpid()),
             "--fd", str(beacon.fd)],
            pass_fds=(beacon.fd,), stdin=theirs, close_fds=True)
    return beacon


def told(sock):
    """The rendezvous server the worker names and its standard output and error (put on
    this process's own: its lines go where the worker's do), or None where the worker
    closed the socket (nothing to watch)."""
    message, fds, _, _ = socket.recv_fds(sock, 4096, len(STREAMS))
    if not message:
        return None
    message = json.loads(message)
    for target in STREAMS:
        if target not in message["streams"]:
            os.close(target)      # the worker has none: nothing of it to watch there
    for target, fd in zip(message["streams"], fds):
        os.dup2(fd, target)
        os.close(fd)
    address, port = message["server"].rsplit(":", 1)
    return RendezvousServer(address, port)


def watched_streams():
    """``{fd: name}`` of this process's standard streams that have a reader to lose (a pipe,
    a socket, a terminal); a file or /dev/null has none."""
    watched = {}
    for fd in STREAMS:
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            continue
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or os.isatty(fd):
            watched[fd] = STREAMS[fd]
    return watched


def closed(poller, watched, wait):
    """The names of the ``watched`` streams whose reader is gone, waiting up to ``wait`` s
    for one (the watchdog's pause between polls)."""
    events = poller.poll(max(0.0, wait) * 1000)
    return sorted({watched[fd] for fd, event in events if event & _HANGUP})


def main(argv=None):
    parser = argparse.ArgumentParser(description="hvd_adapt's watchdog of one worker")
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--fd", type=int, required=True)
    args = parser.parse_args(argv)
    death_signal_setter()()
    if os.getppid() != args.pid:
        return    # the worker ended before the line above
    with socket.socket(fileno=os.dup(0)) as sock:
        server = told(sock)
    if server is None:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"hvd_adapt watchdog of pid {args.pid}: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    page = mmap.mmap(args.fd, _PAGE.size)
    watched = watched_streams()
    poller = select.poll()
    for fd in watched:
        poller.register(fd, 0)     # errors and hang-ups are always reported
    judge = liveness.Judge(f"the rendezvous server {server}")
    gone = []
    while True:
        polled = time.monotonic()
        reached, status, _ = server.reach("GET", f"/{RESET_SCOPE}/{RESET_KEY}",
                                          timeout=2 * liveness.POLL_SECONDS)
        state, cpu = liveness.process_state(args.pid)
        if state is None:
            return
        reason = judge.observe(time.monotonic(), gone, reached,
                               marker=reached == ANSWERED and status == 200,
                               beats=read_beats(page), state=state, cpu=cpu)
        if reason is not None:
            log.warning("ending the worker (SIGKILL): %s", reason)
            os.kill(args.pid, signal.SIGKILL)
            return
        gone = closed(poller, watched, liveness.POLL_SECONDS - (time.monotonic() - polled))


if __name__ == "__main__":
    main()
