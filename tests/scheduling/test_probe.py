"""The ssh-port probe: hosts that answer, hosts that do not, and names that do not resolve
in time, all within the probe's deadline."""
import socket
import threading

import pytest

from hvd_adapt.scheduling.probe import answers, reachable


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


def test_a_refusal_is_an_answer_and_silence_is_not(listening_port):
    # 127.0.0.2 refuses (nothing listens there); 127.0.0.3's listener has a full accept
    # queue, so the kernel drops new SYNs: silence, as from a host cut off; a name that
    # does not resolve is left out (the name service's silence, not the host's).
    with socket.socket() as full:
        full.bind(("127.0.0.3", listening_port))
        full.listen(0)
        with socket.create_connection(("127.0.0.3", listening_port), timeout=5):
            said = answers(["127.0.0.1", "127.0.0.2", "127.0.0.3", "no-such-host.invalid"],
                           listening_port, timeout=0.5)
    assert said == {"127.0.0.1": True, "127.0.0.2": False, "127.0.0.3": None}
