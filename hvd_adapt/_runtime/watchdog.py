"""The watchdog: a small process beside each elastic Gloo worker that ends the worker
when the worker cannot end itself.

Horovod 0.28.1's driver forms the next world only once every worker of the
last one has recorded a state (horovod/runner/elastic/registration.py):
READY with its reset's ``rank_and_size`` request, or SUCCESS/FAILURE when
its ssh command exits. Two kinds of worker never record one, and the
survivors wait for them in their reset:

- a **hung** worker (SIGSTOPped, a stuck data loader, a GPU hang): its
  peers' collectives fail after Gloo's timeout, they reset, it does not;
- a **cut-off** worker (its host's link is down): it waits in its reset's
  ``rank_and_size`` request (no timeout), and when the link heals it would
  answer for a slot the driver has since given to another worker.

Neither can act itself (a stopped process runs no thread), so
``hvd_adapt.init()`` in an elastic Gloo launch starts this process with the
worker (:func:`start`). It dies with the worker (``PR_SET_PDEATHSIG``), asks
the job's rendezvous server one small GET about once a second
(``POLL_SECONDS``), and kills its worker (SIGKILL) when

- **peers have reset and its worker has not**: a worker entering
  hvd_adapt's reset first puts ``RESET_SCOPE/RESET_KEY`` on the server
  (the driver clears the store when it forms a world, after every worker of
  the last one asked for its ``rank_and_size``, so a marker found belongs
  to the current world). A stopped worker (``/proc`` state ``T``) is killed
  at once; any other after :meth:`Judge.grace`: Gloo's collective timeout
  plus ``HVD_ADAPT_HANG_GRACE_SECONDS`` (default 5) or twice the worker's
  recent optimizer-step time, whichever is longer. A healthy worker reaches
  its next collective within a step, that collective fails within Gloo's
  timeout, and it resets, so a slow but healthy worker is never killed;
- **the rendezvous server has not answered** for
  ``HVD_ADAPT_UNREACHABLE_SECONDS`` (default 10): its host is cut off from
  the driver; a healed host rejoins with a fresh worker.

The killed worker's ssh command exits non-zero, the driver records the
failure (and blacklists the host for its cooldown, ``horovodrun
--blacklist-cooldown-range``) and forms a world of the survivors.

The worker tells its watchdog how it does through one page of shared memory
(a memfd, no file): its recent step time, written by the loader at each
optimizer step, and how many resets it entered and whether it is in one:
memory writes, no system call or message per step. A script that uses
Horovod's own ``hvd.elastic.run`` puts no marker, so only the second rule
guards it.
"""
import argparse
import logging
import mmap
import os
import signal
import struct
import subprocess
import sys
import time

from .._checks import seconds_from_environment
from .gloo import RendezvousServer
from .parent_death import death_signal_setter

log = logging.getLogger("hvd_adapt")

RESET_SCOPE = "hvd_adapt_reset"
RESET_KEY = "peers"
POLL_SECONDS = 1.0
GRACE_VARIABLE = "HVD_ADAPT_HANG_GRACE_SECONDS"
GRACE_SECONDS = 5.0
UNREACHABLE_VARIABLE = "HVD_ADAPT_UNREACHABLE_SECONDS"
UNREACHABLE_SECONDS = 10.0
# step seconds, resets entered, in a reset (0/1)
_PAGE = struct.Struct("<dqq")
# The grace follows a slow phase at once and a fast one slowly: one quick step
# (a short last batch) does not shorten it.
_STEP_DECAY = 0.9


class Beacon:
    """The worker's side: what it tells its watchdog, by writing one page of shared memory."""

    def __init__(self, server):
        self.server = server
        self.fd = os.memfd_create("hvd_adapt-watchdog", 0)
        os.ftruncate(self.fd, _PAGE.size)
        self.page = mmap.mmap(self.fd, _PAGE.size)
        self.step_seconds, self.resets, self.in_reset = 0.0, 0, 0
        self.last_step = None
        self.process = None

    def _write(self):
        _PAGE.pack_into(self.page, 0, self.step_seconds, self.resets, self.in_reset)

    def step_done(self):
        """An optimizer step ended: its time (since the last one) feeds the grace."""
        now = time.monotonic()
        if self.last_step is not None:
            self.step_seconds = max(now - self.last_step, self.step_seconds * _STEP_DECAY)
            self._write()
        self.last_step = now

    def leaving_training(self):
        """The training function raised for a reset (its restore comes first): tell the
        watchdog, so that a long restore never counts as hanging."""
        self.in_reset = 1
        self._write()

    def entering_reset(self):
        """Tell the watchdogs of the peers that this worker resets, and its own that it is
        in a reset (so it never counts as behind)."""
        self.resets, self.in_reset = self.resets + 1, 1
        self._write()
        try:
            self.server.put(RESET_SCOPE, RESET_KEY, b"1")
        except (OSError, RuntimeError) as e:
            # The rendezvous request that follows meets the same fault and decides.
            log.warning("could not mark this worker's reset on the rendezvous server: %s", e)

    def reset_done(self):
        self.in_reset, self.last_step = 0, None    # the first step after a reset warms up
        self._write()


def read_page(page):
    """``(step_seconds, resets, in_reset)`` as the worker last wrote them."""
    return _PAGE.unpack_from(page, 0)


def is_stopped(pid):
    """Whether process ``pid`` is stopped (SIGSTOP, or a tracer's stop)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return False
    # The command name in parentheses may itself hold spaces or ')'.
    return text[text.rindex(")") + 2:][:1] in ("T", "t")


class Judge:
    """When a worker is to be killed, from what the watchdog sees at each poll."""

    def __init__(self, collective_timeout, grace_floor=GRACE_SECONDS,
                 unreachable=UNREACHABLE_SECONDS):
        self.collective_timeout, self.grace_floor = collective_timeout, grace_floor
        self.unreachable = unreachable
        self.behind_since = None     # (time, resets): peers reset, the worker not yet
        self.silent_since = None     # the rendezvous server's first unanswered request

    def grace(self, step_seconds):
        """How long a healthy worker can take to follow its peers into a reset: to its
        next collective (within a step), which fails within Gloo's timeout."""
        return self.collective_timeout + max(self.grace_floor, 2 * step_seconds)

    def observe(self, now, answered, marker, step_seconds, resets, in_reset, stopped):
        """The reason to kill the worker now, or None. ``answered``: the server answered
        this poll; ``marker``: a peer's reset marker is on it; the rest: the worker's."""
        if not answered:
            if self.silent_since is None:
                self.silent_since = now
            if now - self.silent_since >= self.unreachable:
                return (f"the rendezvous server has not answered for "
                        f"{now - self.silent_since:.0f} s ({UNREACHABLE_VARIABLE}="
                        f"{self.unreachable:g}): this host is cut off from the job")
            return None
        self.silent_since = None
        if not marker or in_reset:
            self.behind_since = None
            return None
        if self.behind_since is None or self.behind_since[1] != resets:
            self.behind_since = (now, resets)
        if stopped:
            return "it is stopped while its peers reset"
        waited, grace = now - self.behind_since[0], self.grace(step_seconds)
        if waited >= grace:
            return (f"its peers reset {waited:.0f} s ago and it did not follow within "
                    f"{grace:.0f} s (Gloo's timeout + max({GRACE_VARIABLE}="
                    f"{self.grace_floor:g}, 2 x its step time {step_seconds:.1f} s))")
        return None


def start(server, collective_timeout):
    """Start the watchdog of this worker; return the :class:`Beacon` the worker writes.
    Its settings are read here, so a bad one is refused in the worker."""
    grace = seconds_from_environment(GRACE_VARIABLE, GRACE_SECONDS)
    unreachable = seconds_from_environment(UNREACHABLE_VARIABLE, UNREACHABLE_SECONDS)
    beacon = Beacon(server)
    beacon.process = subprocess.Popen(
        [sys.executable, "-m", __name__, "--pid", str(os.getpid()), "--fd", str(beacon.fd),
         "--server", f"{server.address}:{server.port}",
         "--collective-timeout", str(collective_timeout), "--grace", str(grace),
         "--unreachable", str(unreachable)],
        pass_fds=(beacon.fd,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        close_fds=True)
    return beacon


def main(argv=None):
    parser = argparse.ArgumentParser(description="hvd_adapt's watchdog of one worker")
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--server", required=True)
    parser.add_argument("--collective-timeout", type=float, required=True)
    parser.add_argument("--grace", type=float, default=GRACE_SECONDS)
    parser.add_argument("--unreachable", type=float, default=UNREACHABLE_SECONDS)
    args = parser.parse_args(argv)
    death_signal_setter()()
    if os.getppid() != args.pid:
        return    # the worker ended before the line above
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"hvd_adapt watchdog of pid {args.pid}: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    page = mmap.mmap(args.fd, _PAGE.size)
    address, port = args.server.rsplit(":", 1)
    server = RendezvousServer(address, port)
    judge = Judge(args.collective_timeout, args.grace, args.unreachable)
    while True:
        polled = time.monotonic()
        try:
            marker = server.get(RESET_SCOPE, RESET_KEY, timeout=POLL_SECONDS * 2) is not None
            answered = True
        except OSError:
            marker, answered = False, False
        reason = judge.observe(time.monotonic(), answered, marker, *read_page(page),
                               stopped=is_stopped(args.pid))
        if reason is not None:
            log.warning("killing the worker: %s", reason)
            os.kill(args.pid, signal.SIGKILL)
            return
        time.sleep(max(0.0, POLL_SECONDS - (time.monotonic() - polled)))


if __name__ == "__main__":
    main()
