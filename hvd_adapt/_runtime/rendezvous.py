"""The job's rendezvous server (horovodrun's HTTP key-value store), as a worker and
``hvd-adapt-discover`` reach it, and the keys hvd_adapt keeps there.

The server runs inside horovodrun (the elastic driver): a worker that cannot
reach it has lost the launcher, not its peers. So every request here tells
three answers apart (:meth:`RendezvousServer.reach`): it **answered**; it
**refused** the connection (a reset: nothing listens on its port, horovodrun
is gone); it said **nothing** (a timeout, an unreachable network: an outage
of the launcher's link, which may heal). The worker's requests wait out an
outage, however long, and give up only on a refusal (:class:`LauncherGone`);
its watchdog acts on the answers as ``_runtime/liveness.py`` rules.

Horovod 0.28.1's driver clears the store whenever it forms a world
(``RendezvousServer.init``, horovod/runner/http/http_server.py), so what is
found there belongs to the current world.

Standard library only (``hvd-adapt-discover`` reads the reset marker).
"""
import errno
import logging
import os
import time

log = logging.getLogger("hvd_adapt")

# Set by horovodrun (gloo_run.create_run_env_vars) for every Gloo worker.
ADDR_VARIABLE = "HOROVOD_GLOO_RENDEZVOUS_ADDR"
PORT_VARIABLE = "HOROVOD_GLOO_RENDEZVOUS_PORT"
# Where a world's workers meet (_runtime/gloo.py): each rank's start mark, and the verdict
# of its rank 0.
START_SCOPE = "hvd_adapt_start"
VERDICT_KEY = "verdict"
# Put by the first worker of a world that enters hvd_adapt's reset: its peers' watchdogs and
# hvd-adapt-discover read it as "the peers reset".
RESET_SCOPE = "hvd_adapt_reset"
RESET_KEY = "peers"
# How long a connection attempt may take before the server counts as silent for it: past
# Linux's first SYN retransmissions (1 s, 3 s), so a lost packet is not an outage.
CONNECT_SECONDS = 4.0
# Between two connection attempts while the server is silent or unreachable.
RETRY_SECONDS = 1.0
ANSWERED, REFUSED, SILENT = "answered", "refused", "silent"


class LauncherGone(RuntimeError):
    """The rendezvous server refused a connection: horovodrun is gone, and with it the job
    this worker belonged to."""


def _refused(error):
    return isinstance(error, ConnectionRefusedError) or getattr(error, "errno", None) in (
        errno.ECONNREFUSED,)


class RendezvousServer:
    """horovodrun's key-value store at ``address:port``."""

    def __init__(self, address, port):
        self.address, self.port = address, int(port)

    def __str__(self):
        return f"{self.address}:{self.port}"

    @classmethod
    def from_environment(cls):
        """The server horovodrun named, or None outside a Gloo launch."""
        if ADDR_VARIABLE not in os.environ or PORT_VARIABLE not in os.environ:
            return None
        return cls(os.environ[ADDR_VARIABLE], os.environ[PORT_VARIABLE])

    def _connect(self, timeout):
        # Imported here, not at the top: http.client pulls in the email package (about
        # 25 ms), and hvd-adapt-discover, which Horovod's driver starts every second,
        # imports this module on every run but connects only while judging a silent host.
        import http.client
        connection = http.client.HTTPConnection(self.address, self.port, timeout=timeout)
        try:
            connection.connect()
        except BaseException:
            connection.close()
            raise
        return connection

    @staticmethod
    def _exchange(connection, method, path, body, timeout):
        connection.sock.settimeout(timeout)
        headers = {"Content-Length": str(len(body))} if body is not None else {}
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()

    def reach(self, method, path, body=None, timeout=CONNECT_SECONDS):
        """One request, as the watchdog polls: ``(ANSWERED, status, body)``, ``(REFUSED,
        None, error)`` or ``(SILENT, None, error)`` (no answer within ``timeout`` s)."""
        try:
            connection = self._connect(timeout)
        except OSError as e:
            return (REFUSED if _refused(e) else SILENT), None, e
        try:
            status, reply = self._exchange(connection, method, path, body, timeout)
            return ANSWERED, status, reply
        except OSError as e:
            return SILENT, None, e
        finally:
            connection.close()

    def request(self, method, path, body=None, once=False):
        """``(status, body)`` of one request, waiting out an outage of the server (a
        timeout or an unreachable network: tried again every ``RETRY_SECONDS``, logged
        once), however long. ``once``: the request must reach the server at most once
        (``rank_and_size`` records the worker in the driver): it is sent only on a
        connection made, and its answer awaited with no timeout. Raises
        :class:`LauncherGone` on a refused connection, or where a ``once`` request's
        connection breaks."""
        waiting_since = None
        while True:
            try:
                connection = self._connect(CONNECT_SECONDS)
            except OSError as e:
                if _refused(e):
                    raise LauncherGone(f"the rendezvous server {self} refuses connections "
                                       f"({e}): horovodrun is gone") from e
                waiting_since = self._waiting(waiting_since, path, e)
                continue
            try:
                result = self._exchange(connection, method, path, body,
                                        None if once else 10 * CONNECT_SECONDS)
            except OSError as e:
                if once:
                    raise LauncherGone(f"the connection to the rendezvous server {self} broke "
                                       f"while it was asked {path} ({e})") from e
                waiting_since = self._waiting(waiting_since, path, e)
                continue
            finally:
                connection.close()
            if waiting_since is not None:
                log.warning("the rendezvous server %s answers again, after %.0f s", self,
                            time.monotonic() - waiting_since)
            return result

    def _waiting(self, since, path, error):
        if since is None:
            log.warning("the rendezvous server %s (horovodrun) does not answer %s (%s): "
                        "waiting for it, however long (an outage of the launcher's link "
                        "ends nothing; a refused connection would)", self, path, error)
            since = time.monotonic()
        time.sleep(RETRY_SECONDS)
        return since

    def get(self, scope, key, once=False):
        """The value under ``scope/key``, or None where there is none (404)."""
        status, body = self.request("GET", f"/{scope}/{key}", once=once)
        return body if status == 200 else None

    def put(self, scope, key, value):
        status, _ = self.request("PUT", f"/{scope}/{key}", body=value)
        if status != 200:
            raise RuntimeError(f"the rendezvous server {self} answered {status} to storing "
                               f"{scope}/{key}")

