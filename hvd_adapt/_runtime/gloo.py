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
world first meet on the job's rendezvous server, with no timeout of Gloo's
(:func:`meet`: each puts its rank under ``hvd_adapt_start`` and waits,
polling, until every rank of the world has, up to ``start_timeout()``), and
only then call ``hvd.init()``, whose Gloo rendezvous now finds every peer
started, so Gloo's timeout can be short (``COLLECTIVE_TIMEOUT_SECONDS``) and
a dead or stopped peer is noticed in seconds. It is set only around that
``hvd.init()`` (:func:`_short_gloo_timeout`): a reset of Horovod's own
``hvd.elastic.run`` has no meeting and keeps Horovod's default.

In an elastic reset a survivor learns its new rank and world size from the
driver's ``rank_and_size`` answer, which also tells the driver that the
worker is ready (horovod/runner/elastic/rendezvous.py records it there,
so it may be asked once per reset). :func:`init_world` asks for it itself,
meets, and serves that same answer to ``hvd.init()``'s own request through a
proxy on loopback that passes everything else on to the real server
(:class:`_RankAndSizeProxy`): the one place where hvd_adapt stands between
Horovod and its rendezvous server.

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
import http.client
import http.server
import ipaddress
import logging
import os
import socket
import threading
import time

import psutil

from .._checks import seconds_from_environment

log = logging.getLogger("hvd_adapt")

# Set by horovodrun (gloo_run.create_run_env_vars) for every Gloo worker.
IFACE_VARIABLE = "HOROVOD_GLOO_IFACE"
ADDR_VARIABLE = "HOROVOD_GLOO_RENDEZVOUS_ADDR"
PORT_VARIABLE = "HOROVOD_GLOO_RENDEZVOUS_PORT"
TIMEOUT_VARIABLE = "HOROVOD_GLOO_TIMEOUT_SECONDS"
# Gloo's timeout once a world has met: how long a survivor waits for a message from a
# peer that died or stopped before its collective fails and the job resets.
COLLECTIVE_TIMEOUT_SECONDS = 5
# How long the workers of a new world wait for each other to start (meet()).
START_TIMEOUT_VARIABLE = "HVD_ADAPT_START_TIMEOUT_SECONDS"
START_TIMEOUT_SECONDS = 60
START_SCOPE = "hvd_adapt_start"
RANK_AND_SIZE_SCOPE = "rank_and_size"    # horovod/runner/elastic/rendezvous.py
# Where Gloo's rendezvous of Horovod's global context puts each rank's address
# (gloo_context.cc's HOROVOD_GLOO_GLOBAL_PREFIX; the key is the rank): a rank found
# there has started and met already, as the survivors of a reset of Horovod's own
# hvd.elastic.run, which has no meeting, do.
GLOO_GLOBAL_SCOPE = "global"


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
    if not apply or TIMEOUT_VARIABLE in os.environ:
        yield
        return
    os.environ[TIMEOUT_VARIABLE] = str(COLLECTIVE_TIMEOUT_SECONDS)
    try:
        yield
    finally:
        del os.environ[TIMEOUT_VARIABLE]


def start_timeout():
    """Seconds the workers of a world wait for each other to start:
    ``HVD_ADAPT_START_TIMEOUT_SECONDS``, default 60 (cold workers take 8-40 s)."""
    return seconds_from_environment(START_TIMEOUT_VARIABLE, START_TIMEOUT_SECONDS)


class RendezvousServer:
    """The job's rendezvous server (horovodrun's HTTP key-value store), from the
    worker's environment."""

    def __init__(self, address, port):
        self.address, self.port = address, int(port)

    @classmethod
    def from_environment(cls):
        """The server horovodrun named, or None outside a Gloo launch."""
        if ADDR_VARIABLE not in os.environ or PORT_VARIABLE not in os.environ:
            return None
        return cls(os.environ[ADDR_VARIABLE], os.environ[PORT_VARIABLE])

    def request(self, method, path, body=None, timeout=30):
        """``(status, body)`` of one request."""
        connection = http.client.HTTPConnection(self.address, self.port, timeout=timeout)
        try:
            headers = {"Content-Length": str(len(body))} if body is not None else {}
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def get(self, scope, key, timeout=30):
        status, body = self.request("GET", f"/{scope}/{key}", timeout=timeout)
        return body if status == 200 else None

    def put(self, scope, key, value):
        status, _ = self.request("PUT", f"/{scope}/{key}", body=value)
        if status != 200:
            raise RuntimeError(f"the rendezvous server {self.address}:{self.port} answered "
                               f"{status} to storing {scope}/{key}")


def meet(server, rank, size, timeout):
    """Put ``rank`` under ``START_SCOPE`` and wait until all ``size`` ranks have, or are in
    Gloo's rendezvous already (``GLOO_GLOBAL_SCOPE``): every worker of the world is started. The driver clears the store for every new world,
    so what is found is this world's. Returns True, or False after ``timeout`` s (logged:
    ``hvd.init()`` then fails on Gloo's short timeout and the job resets)."""
    server.put(START_SCOPE, str(rank), b"1")
    deadline = time.monotonic() + timeout
    missing = set(range(size)) - {rank}
    pause = 0.02
    while missing:
        missing = {r for r in missing if server.get(START_SCOPE, str(r)) is None
                   and server.get(GLOO_GLOBAL_SCOPE, str(r)) is None}
        if not missing:
            break
        if time.monotonic() > deadline:
            log.warning("rank %d of %d: ranks %s did not start within %s s "
                        "(%s); initialising without them", rank, size, sorted(missing),
                        timeout, START_TIMEOUT_VARIABLE)
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.2)
    return True


class _RankAndSizeProxy(http.server.ThreadingHTTPServer):
    """A rendezvous server on loopback that answers ``rank_and_size`` with the answer this
    worker already got, and passes every other request on to ``server``."""

    daemon_threads = True

    def __init__(self, server, answer):
        self.upstream, self.answer = server, answer
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.thread = threading.Thread(target=self.serve_forever, name="hvd_adapt-rendezvous",
                                       daemon=True)

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
        except OSError as e:
            log.warning("rendezvous proxy: %s %s failed: %s", self.command, self.path, e)
            status, reply = 503, b""
        self._answer(status, reply)

    do_GET = do_PUT = do_DELETE = _forward

    def log_message(self, *args):
        pass


def _parse_answer(answer):
    """``rank,size,local_rank,local_size,cross_rank,cross_size`` (SlotInfo.to_response_string)."""
    return [int(v) for v in answer.decode("ascii").split(",")]


def init_world(init, reset=False, short_timeout=True):
    """Call ``init()`` (``hvd.init``) once every worker of this world has started.

    Outside a Gloo launch it only calls ``init()``. ``short_timeout``: that call gets
    Gloo's short timeout (:func:`collective_timeout`; an elastic job's). ``reset``:
    this is an elastic reset (after ``hvd.shutdown()``), whose rank and size come from
    the driver, and which waits for another world where one worker of the next never
    starts; otherwise they come from the environment horovodrun started the worker with.
    """
    server = RendezvousServer.from_environment()
    if server is None:
        with _short_gloo_timeout(short_timeout):
            return init()
    iface = os.environ.get(IFACE_VARIABLE)
    if not reset:
        rank, size = int(os.environ.get("HOROVOD_RANK", 0)), int(os.environ.get("HOROVOD_SIZE", 1))
        check_host_address(iface, int(os.environ.get("HOROVOD_CROSS_SIZE", "1")))
        if size > 1:
            meet(server, rank, size, start_timeout())
        with _short_gloo_timeout(short_timeout):
            return init()
    host, local_rank = os.environ["HOROVOD_HOSTNAME"], os.environ["HOROVOD_LOCAL_RANK"]
    while True:
        # Answered once the driver has every worker of the last world's state (no timeout:
        # asking again in the same world would count this worker twice), with this
        # worker's slot in the next one.
        answer = server.get(RANK_AND_SIZE_SCOPE, f"{host}:{local_rank}", timeout=None)
        rank, size, local_rank, _, _, cross_size = _parse_answer(answer)
        if rank < 0:
            break    # removed from the job: hvd.init() raises Horovod's own error for it
        check_host_address(iface, cross_size)
        if size == 1 or meet(server, rank, size, start_timeout()):
            break
        # A worker of the new world never started (its host is down, its ssh refused):
        # Gloo's rendezvous would fail and kill this process. Asking again tells the
        # driver this worker is ready for another world, as after a failed collective;
        # the driver forms it once the missing worker's launch has failed.
    # rank -1: removed from the job; hvd.init() raises Horovod's own error for it.
    with _RankAndSizeProxy(server, answer) as proxy:
        real = os.environ[ADDR_VARIABLE], os.environ[PORT_VARIABLE]
        os.environ[ADDR_VARIABLE], os.environ[PORT_VARIABLE] = proxy.server_address[0], \
            str(proxy.server_address[1])
        try:
            with _short_gloo_timeout(short_timeout):
                return init()
        finally:
            os.environ[ADDR_VARIABLE], os.environ[PORT_VARIABLE] = real
