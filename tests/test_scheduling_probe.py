"""The ssh-port probe: hosts that answer, hosts that do not, and names that do not resolve
in time, all within the probe's deadline."""
import socket
import threading

import pytest

from hvd_adapt.scheduling.probe import reachable


@pytest.fixture
def listening_port():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server.getsockname()[1]
    server.close()


def test_only_hosts_answering_on_the_port(listening_port):
    assert reachable(["127.0.0.1", "127.0.0.1", "127.0.0.2", "no-such-host.invalid"],
                     listening_port, timeout=2.0) == {"127.0.0.1"}


def test_a_name_stuck_in_resolution_does_not_hold_the_probe(listening_port, monkeypatch):
    # A DNS server that never answers for one name: the lookup blocks past the deadline.
    released = threading.Event()
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if host == "stuck.example":
            released.wait(120)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    result = {}
    probe = threading.Thread(target=lambda: result.update(
        answered=reachable(["stuck.example", "127.0.0.1"], listening_port, timeout=0.5)))
    probe.start()
    probe.join(30)
    finished = not probe.is_alive()
    released.set()
    probe.join()
    assert finished, "the probe waited for a lookup past its deadline"
    assert result["answered"] == {"127.0.0.1"}
