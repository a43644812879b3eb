"""What a Gloo world needs before ``hvd.init()``: an address its peers reach, and its
workers all started.

**The two waits.** Horovod 0.28 uses one timeout, ``HOROVOD_GLOO_TIMEOUT_SECONDS``,
for two different waits (gloo_context.cc, ``Rendezvous``: ``setTimeout``
and ``HTTPStore::wait``): the rendezvous of every (re)initialisation, where
the survivors of a grow wait for the new worker's whole start-up (ssh, a
container, ``import torch``: 8-40 s on a cluster; Horovod's driver starts it
only once they wait there), and each message of a collective, where a
survivor waits for a peer that died or hangs. One long value cost every
failure a minute; one short value killed every grow. So the workers of a
world first meet on the job's rendezvous server (:func:`meet`), with no
timeout of Gloo's, and only then call ``hvd.init()``, whose Gloo rendezvous
then finds every peer started, so Gloo's timeout can be short
(``COLLECTIVE_TIMEOUT_SECONDS``) and a dead or stopped peer is noticed in
seconds. It is set only around that ``hvd.init()`` (:func:`_short_gloo_timeout`):
a reset of Horovod's own ``hvd.elastic.run`` has no meeting and keeps Horovod's
default.

**The meeting.** Each worker puts its mark under ``hvd_adapt_start/<rank>``;
rank 0 decides for the world (one writer, so no two workers decide apart): it
says ``go`` once every rank is there, or, when a rank is still missing after
``MEETING_SECONDS``, ``again``. A world told ``again`` is formed anew by
Horovod's driver, where the wait goes on with its evidence: every worker of
it asks for its slot in the next world (``rank_and_size``, which records it
as ready), and the driver forms that world once each worker has either asked
(a worker slow to start asks when it arrives, and joins) or seen its launch
fail (ssh refused: the survivors go on without it in the time the refusal
takes, not after a timeout). Horovod's driver gives no other sign of a
failed launch (registration.py waits for every worker of a world to record a
state before it acts on any), so the meeting asks it for another world rather
than guessing. The other ranks follow rank 0's verdict; they wait for it up
to ``HVD_ADAPT_START_TIMEOUT_SECONDS`` (60 s) where rank 0 itself never comes
(its host died between the driver's answer and the meeting), and a new
worker that meets survivors of Horovod's own reset (in Gloo's rendezvous
already) waits that long for the rest.

In an elastic reset a survivor learns its new rank and world size from the
driver's ``rank_and_size`` answer, which also tells the driver that the
worker is ready (horovod/runner/elastic/rendezvous.py records it there,
so it may be asked once per world). :func:`init_world` asks for it itself,
meets, and serves that same answer to ``hvd.init()``'s own request through a
proxy on loopback that passes everything else on to the real server
(:class:`_RankAndSizeProxy`): the one place where hvd_adapt stands between
Horovod and its rendezvous server. Before it asks, the worker puts the reset
marker its peers' watchdogs read (``_runtime/watchdog.py``), waiting out an
outage of the launcher however long (``_runtime/rendezvous.py``), and checks
that its start mark in the world it trained in is still there: where the
driver formed a world without it meanwhile (it ended its ssh session), the
worker ends (``liveness.left_behind``) instead of answering for a slot that
is no longer its own. A refused connection (horovodrun gone) ends it too.

**The host's address.**

Horovod 0.28.1 creates one more Gloo context than the global, local and
cross ones, for the global process set that every job has
(``GlooContext::InitializeForProcessSet``, horovod/common/gloo/gloo_context.cc),
and that context's device is made from the context's own ``gloo_iface_``,
which only ``Initialize`` sets, so it is always empty there: Gloo then
listens on the first address that the host's name (``gethostname()``)
resolves to, whatever ``--network-interface`` said. On a host whose name
resolves to loopback (Debian's ``127.0.1.1 <name>``, or an image's shared
name) the job's peers on other hosts connect to their own loopback and fail
(``gloo::IoException ... connect [127.0.0.1]: Connection refused``). The
context cannot be told its interface from outside Horovod, so
:func:`check_host_address` refuses such a host before ``hvd.init()``,
naming the host, where its name resolves and the fix.
"""
import contextlib
import http.server
import ipaddress
import logging
import os
import socket
import threading
import time

import psutil

from .._checks import seconds_from_environment
from . import liveness
from .horovod_internals import RANK_AND_SIZE_SCOPE
from .rendezvous import (ADDR_VARIABLE, PORT_VARIABLE, RESET_KEY,
                         RESET_SCOPE, START_SCOPE, VERDICT_KEY, LauncherGone,
                         RendezvousServer)

log = logging.getLogger("hvd_adapt")

# Set by horovodrun (gloo_run.create_run_env_vars) for every Gloo worker.
IFACE_VARIABLE = "HOROVOD_GLOO_IFACE"
TIMEOUT_VARIABLE = "HOROVOD_GLOO_TIMEOUT_SECONDS"
# Gloo's timeout once a world has met: how long a survivor waits for a message from a
# peer that died or stopped before its collective fails and the job resets.
COLLECTIVE_TIMEOUT_SECONDS = 5
# How long a world's ranks wait for the verdict of a rank 0 that never comes, and a new
# worker for the rest of a world of Horovod's own reset (meet()).
START_TIMEOUT_VARIABLE = "HVD_ADAPT_START_TIMEOUT_SECONDS"
START_TIMEOUT_SECONDS = 60
# How long rank 0 waits in the meeting for a rank that has not come before it tells the
# world to ask the driver for the next one: a warm standby comes in well under it; a cold
# start (seconds) is then waited for in the driver, which also sees a launch that failed.
MEETING_SECONDS = 2.0
# The meeting's polls: every 20 ms (rank 0, and the other ranks of a small world: a warm
# join waits for two of them); a large world's other ranks ask the driver's server less
# often (2 ms per worker: 500 requests a second at most).
POLL_SECONDS, POLL_PER_WORKER = 0.02, 0.002
GO, AGAIN, LEFT = b"go", b"again", b"left"
# Where Gloo's rendezvous of Horovod's global context puts each rank's address
# (gloo_context.cc's HOROVOD_GLOO_GLOBAL_PREFIX; the key is the rank): a rank found
# there has started and met already, as the survivors of a reset of Horovod's own
# hvd.elastic.run, which has no meeting, do.
GLOO_GLOBAL_SCOPE = "global"
# What the driver's rank_and_size answer holds (SlotInfo.to_response_string), and the
# variables a worker's first hvd.init() reads them from.
SLOT_VARIABLES = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                  "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")


def gloo_host_address():
    """The address Gloo listens on when no interface is named: the first address of
    ``gethostname()`` that a socket can bind (gloo/transport/tcp/device.cc,
    lookupAddrForHostname), or None when the name does not resolve."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, 0, socket.SOCK_STREAM)
    except socket.gaierror:
        return None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind(address)
            except OSError:
                continue
        return address[0]
    return None


def interface_addresses(iface):
    """The IPv4 and IPv6 addresses of network interface ``iface`` (empty if it has none)."""
    return [entry.address.split("%")[0] for entry in psutil.net_if_addrs().get(iface, ())
            if entry.family in (socket.AF_INET, socket.AF_INET6)]


def check_host_address(iface, num_hosts):
    """Raise RuntimeError if a world of ``num_hosts`` hosts that talks over ``iface``
    cannot reach this host's process-set context: its name resolves to a loopback
    address while ``iface`` is not loopback and the world spans other hosts.

    ``iface`` None (not a Gloo launch) or a loopback interface (every peer on this
    machine, as in ``-H localhost:1,127.0.0.1:1``), or one host, is always fine.

    >>> check_host_address(None, 4)
    >>> check_host_address("lo", 2)
    """
    if not iface or num_hosts <= 1:
        return
    own = interface_addresses(iface)
    if any(ipaddress.ip_address(address).is_loopback for address in own):
        return
    address = gloo_host_address()
    if address is None or not ipaddress.ip_address(address).is_loopback:
        return
    name = socket.gethostname()
    suggestion = f"'{own[0]} {name}'" if own else f"'<{iface}'s address> {name}'"
    raise RuntimeError(
        f"host {name!r} resolves to {address} (loopback) on this host, but the job spans "
        f"{num_hosts} hosts over interface {iface!r} ({', '.join(own) or 'no address'}): "
        f"Horovod 0.28's process-set Gloo context ignores --network-interface and listens on "
        f"what the host name resolves to, so the other hosts cannot connect to it. Make "
        f"{name!r} resolve to {iface}'s address on this host (in /etc/hosts: {suggestion} "
        f"instead of '{address} {name}', or in DNS)")


def collective_timeout():
    """Gloo's timeout in a world hvd_adapt's meeting formed: ``HOROVOD_GLOO_TIMEOUT_SECONDS``
    where the user or ``horovodrun --gloo-timeout-seconds`` set it, else
    ``COLLECTIVE_TIMEOUT_SECONDS``."""
    return seconds_from_environment(TIMEOUT_VARIABLE, COLLECTIVE_TIMEOUT_SECONDS)


@contextlib.contextmanager
def _short_gloo_timeout(apply):
    """Gloo's timeout ``COLLECTIVE_TIMEOUT_SECONDS`` for the ``hvd.init()`` inside (Horovod
    reads it there, for the rendezvous and every collective of that world), unless set
    already. Only around the init that follows a meeting: an init that Horovod's own
    ``hvd.elastic.run`` makes in its reset has no meeting, so it keeps Horovod's default
    (30 s), long enough for a worker slow to reach it."""
    if not apply:
        yield
        return
    collective_timeout()        # a bad value of the user's is refused here, naming it
    if TIMEOUT_VARIABLE in os.environ:
        yield
        return
    os.environ[TIMEOUT_VARIABLE] = str(COLLECTIVE_TIMEOUT_SECONDS)
    try:
        yield
    finally:
        del os.environ[TIMEOUT_VARIABLE]


def start_timeout():
    """Seconds a world's ranks wait for the verdict of a rank 0 that does not come (and a
    new worker for the rest of a world of Horovod's own reset):
    ``HVD_ADAPT_START_TIMEOUT_SECONDS``, default 60."""
    return seconds_from_environment(START_TIMEOUT_VARIABLE, START_TIMEOUT_SECONDS)


class Meeting:
    """One world's meeting on the rendezvous server, as rank ``rank`` of ``size`` sees it;
    ``mark``: what this worker puts under its rank (its identity, :func:`identity`)."""

    def __init__(self, server, rank, size, mark):
        self.server, self.rank, self.size, self.mark = server, rank, size, mark

    def _mark_of(self, rank):
        return self.server.get(START_SCOPE, str(rank))

    def _in_gloo(self, rank):
        return self.server.get(GLOO_GLOBAL_SCOPE, str(rank)) is not None

    def run(self, wait=MEETING_SECONDS, timeout=None):
        """``GO`` (every rank is there: initialise) or ``AGAIN`` (ask the driver for the
        next world); ``wait`` None: a launch without a driver to ask (not elastic), where
        rank 0 waits up to ``timeout`` for the rest. Raises
        :class:`~.rendezvous.LauncherGone` where this worker's mark is gone meanwhile: the
        driver formed the next world without it (a verdict found then is that world's)."""
        self.server.put(START_SCOPE, str(self.rank), self.mark)
        if self.size == 1:
            return GO
        timeout = start_timeout() if timeout is None else timeout
        if self.rank == 0:
            verdict = self._decide(wait, timeout)
        else:
            verdict = self._follow(timeout, elastic=wait is not None)
        found = self._mark_of(self.rank)
        reason = liveness.left_behind(self.mark, self.mark if found == LEFT else found)
        if reason is not None:
            raise LauncherGone(reason)
        return verdict

    def _polls(self, timeout):
        """Yield the seconds waited so far, pausing between polls, until ``timeout``."""
        started = time.monotonic()
        pause = POLL_SECONDS if self.rank == 0 else max(POLL_SECONDS, POLL_PER_WORKER * self.size)
        while True:
            waited = time.monotonic() - started
            yield waited
            if waited > timeout:
                return
            time.sleep(pause)

    def _missing(self, ranks):
        """``(missing, left, in_gloo)`` among ``ranks``: not there, gone to the driver, and
        there in Gloo's rendezvous (survivors of Horovod's own reset)."""
        missing, left, in_gloo = set(), set(), set()
        for rank in ranks:
            mark = self._mark_of(rank)
            if mark == LEFT:
                left.add(rank)
            elif mark is None:
                (in_gloo if self._in_gloo(rank) else missing).add(rank)
        return missing | left, left, in_gloo

    def _decide(self, wait, timeout):
        waiting, in_gloo = set(range(1, self.size)), set()
        for waited in self._polls(timeout):
            waiting, left, gloo = self._missing(waiting)
            in_gloo |= gloo
            if not waiting:
                self.server.put(START_SCOPE, VERDICT_KEY, GO)
                return GO
            if in_gloo or wait is None:
                # Survivors of Horovod's own reset are in Gloo's rendezvous and cannot ask the
                # driver again (nor are the workers of a launch that is not elastic): wait for
                # the rest, as Horovod does.
                continue
            if left or waited >= wait:
                self.server.put(START_SCOPE, VERDICT_KEY, AGAIN)
                log.info("rank 0 of %d: rank(s) %s %s; this world asks the driver for the "
                         "next (it forms it once each of them has arrived or its launch has "
                         "failed)", self.size, sorted(waiting),
                         "left the meeting" if left else f"not here after {wait:g} s")
                return AGAIN
        log.warning("rank 0 of %d: rank(s) %s did not start within %g s (%s); initialising "
                    "without them", self.size, sorted(waiting), timeout,
                    START_TIMEOUT_VARIABLE)
        return GO

    def _rank_0_in_gloo(self):
        """Whether rank 0 is a survivor of Horovod's own reset (in Gloo's rendezvous, no
        mark of ours: no verdict comes)."""
        return self._mark_of(0) is None and self._in_gloo(0)

    def _follow(self, timeout, elastic):
        others = set(range(self.size)) - {self.rank}
        rank_0_meets = False
        for _ in self._polls(timeout):
            verdict = self.server.get(START_SCOPE, VERDICT_KEY)
            if verdict in (GO, AGAIN):
                return verdict
            rank_0_meets = rank_0_meets or self._mark_of(0) is not None
            if not rank_0_meets and self._in_gloo(0):
                # Go once all are there.
                others, _, _ = self._missing(others)
                if not others:
                    return GO
        if not elastic or self._rank_0_in_gloo():
            log.warning("rank %d of %d: ranks %s did not start within %g s (%s); "
                        "initialising without them", self.rank, self.size, sorted(others),
                        timeout, START_TIMEOUT_VARIABLE)
            return GO
        # Rank 0 never decided (its host died after the driver's answer): leave, so that rank
        # 0, should it come yet, sees it and tells the others to leave too.
        self.server.put(START_SCOPE, str(self.rank), LEFT)
        log.warning("rank %d of %d: rank 0 gave no verdict within %g s (%s); asking the "
                    "driver for the next world", self.rank, self.size, timeout,
                    START_TIMEOUT_VARIABLE)
        return AGAIN


def meet(server, rank, size, mark=b"1", wait=MEETING_SECONDS, timeout=None):
    """Meet the world on ``server`` as rank ``rank`` of ``size`` (see :class:`Meeting`):
    ``GO`` or ``AGAIN``."""
    return Meeting(server, rank, size, mark).run(wait, timeout)


class _RankAndSizeProxy(http.server.ThreadingHTTPServer):
    """A rendezvous server on loopback that answers ``rank_and_size`` with the answer this
    worker already got, and passes every other request on to ``server``."""

    daemon_threads = True
    # How often its loop looks for shutdown(): the reset waits for that after hvd.init(), so
    # socketserver's default (0.5 s) added a quarter of a second to every reset's pause.
    POLL_SECONDS = 0.005

    def __init__(self, server, answer):
        self.upstream, self.answer = server, answer
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.thread = threading.Thread(target=self.serve_forever, args=(self.POLL_SECONDS,),
                                       name="hvd_adapt-rendezvous", daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()
        self.thread.join()


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    def _answer(self, status, body):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _forward(self):
        if self.command == "GET" and self.path.startswith(f"/{RANK_AND_SIZE_SCOPE}/"):
            return self._answer(200, self.server.answer)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length or self.command == "PUT" else None
        try:
            status, reply = self.server.upstream.request(self.command, self.path, body)
        except (OSError, LauncherGone) as e:
            log.warning("rendezvous proxy: %s %s failed: %s", self.command, self.path, e)
            status, reply = 503, b""
        self._answer(status, reply)

    do_GET = do_PUT = do_DELETE = _forward

    def log_message(self, *args):
        pass


def _parse_answer(answer):
    """``rank,size,local_rank,local_size,cross_rank,cross_size`` (SlotInfo.to_response_string)."""
    return [int(v) for v in answer.decode("ascii").split(",")]


def identity():
    """What this worker puts under its rank when it meets: its slot and process, so that
    after a reset it can tell its own mark from another's."""
    return (f"{os.environ.get('HOROVOD_HOSTNAME', 'localhost')}:"
            f"{os.environ.get('HOROVOD_LOCAL_RANK', '0')}:{os.getpid()}").encode()


def ask_for_next_world(server, mark, last_rank=None):
    """This worker's slot in the driver's next world (its ``rank_and_size`` answer), asked
    once it has put the reset marker (its peers' watchdogs and ``hvd-adapt-discover``
    read it), and, after a reset of a worker that was rank ``last_rank``, once its own
    ``mark`` there shows that the world it trained in is still the driver's (a worker
    sent back by its meeting has just seen it). Each request waits out an outage of the
    launcher, however long. Raises :class:`~.rendezvous.LauncherGone` where horovodrun is
    gone or the driver went on without this worker (``liveness.left_behind``)."""
    server.put(RESET_SCOPE, RESET_KEY, b"1")
    if last_rank is not None:
        reason = liveness.left_behind(mark, server.get(START_SCOPE, str(last_rank)))
        if reason is not None:
            raise LauncherGone(reason)
    # Answered once the driver has every worker of this world's state; asked at most once per
    # world (asking again would count this worker twice).
    key = f"{os.environ['HOROVOD_HOSTNAME']}:{os.environ['HOROVOD_LOCAL_RANK']}"
    return server.get(RANK_AND_SIZE_SCOPE, key, once=True)


def init_world(init, reset=False, elastic=True, last_rank=None):
    """Call ``init()`` (``hvd.init``) once every worker of this world has started.

    Outside a Gloo launch it only calls ``init()``. ``elastic``: an elastic launch, whose
    ``init()`` gets Gloo's short timeout (:func:`collective_timeout`) and whose world,
    short of a worker, asks the driver for the next one. ``reset``:
    this is an elastic reset (after ``hvd.shutdown()``) of a worker that was rank
    ``last_rank``: its rank and size come from the driver; otherwise they come from the
    environment horovodrun started the worker with. A world whose meeting says
    ``AGAIN`` asks the driver for the next one (see the module's docstring).
    """
    server = RendezvousServer.from_environment()
    if server is None:
        with _short_gloo_timeout(elastic):
            return init()
    try:
        answer = _meet_world(server, reset, elastic, last_rank)
    except LauncherGone as e:
        log.error("ending this worker: %s", e)
        raise
    if not reset:
        with _short_gloo_timeout(elastic):
            return init()
    with _RankAndSizeProxy(server, answer) as proxy:
        real = os.environ[ADDR_VARIABLE], os.environ[PORT_VARIABLE]
        os.environ[ADDR_VARIABLE], os.environ[PORT_VARIABLE] = proxy.server_address[0], \
            str(proxy.server_address[1])
        try:
            with _short_gloo_timeout(elastic):
                return init()
        finally:
            os.environ[ADDR_VARIABLE], os.environ[PORT_VARIABLE] = real


def _meet_world(server, reset, elastic, last_rank):
    """Meet a world that goes (asking the driver for the next while one says ``AGAIN``);
    the driver's last answer (for a reset's proxy)."""
    iface = os.environ.get(IFACE_VARIABLE)
    mark = identity()
    if reset:
        answer = ask_for_next_world(server, mark, last_rank)
    else:
        answer = ",".join(os.environ.get(name, "1" if name.endswith("SIZE") else "0")
                          for name in SLOT_VARIABLES).encode()
    while True:
        rank, size, _, _, _, cross_size = _parse_answer(answer)
        if rank < 0:
            if reset:
                break    # hvd.init() raises Horovod's own error for it
            raise RuntimeError(f"{os.environ.get('HOROVOD_HOSTNAME')}"
                               f"[{os.environ.get('HOROVOD_LOCAL_RANK')}] has been removed "
                               "from elastic job")
        check_host_address(iface, cross_size)
        if meet(server, rank, size, mark, MEETING_SECONDS if elastic else None) == GO:
            break
        answer = ask_for_next_world(server, mark)
        if not reset:
            # A first hvd.init() reads its slot from the environment (a reset's asks the
            # proxy).
            os.environ.update(zip(SLOT_VARIABLES, answer.decode("ascii").split(",")))
    return answer
