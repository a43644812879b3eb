"""_runtime/rendezvous.py: a worker's requests to horovodrun's key-value store wait out an
outage of the launcher, however long, and end on a refusal (horovodrun gone)."""
import http.server
import socket
import threading
import time

import pytest

from hvd_adapt._runtime import rendezvous
from hvd_adapt._runtime.rendezvous import LauncherGone, RendezvousServer
from support.gloo_store import Store


def free_port(address):
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def test_a_request_waits_for_a_server_that_says_nothing_until_it_answers(monkeypatch, caplog):
    # A listener whose accept queue is full drops new connections' SYNs: the server says
    # nothing, as behind a link that is down. After a few seconds it serves again.
    monkeypatch.setattr(rendezvous, "CONNECT_SECONDS", 0.5)
    monkeypatch.setattr(rendezvous, "RETRY_SECONDS", 0.1)
    port = free_port("127.0.0.8")
    listener = socket.socket()
    listener.bind(("127.0.0.8", port))
    listener.listen(0)
    filler = socket.create_connection(("127.0.0.8", port))
    Store.data = {"/scope/key": b"value"}
    server = http.server.HTTPServer(("127.0.0.8", port), Store, bind_and_activate=False)
    server.socket.close()
    server.socket = listener

    def heal():
        time.sleep(3)
        listener.accept()[0].close()     # the queue has room again
        filler.close()
        server.serve_forever(poll_interval=0.05)

    threading.Thread(target=heal, daemon=True).start()
    try:
        assert RendezvousServer("127.0.0.8", port).get("scope", "key") == b"value"
        assert "does not answer /scope/key" in caplog.text and "answers again" in caplog.text
    finally:
        server.shutdown()
        listener.close()


def test_a_refused_connection_means_horovodrun_is_gone():
    server = RendezvousServer("127.0.0.1", free_port("127.0.0.1"))
    with pytest.raises(LauncherGone, match="refuses connections .*: horovodrun is gone"):
        server.get("scope", "key")
    assert server.reach("GET", "/scope/key")[0] == rendezvous.REFUSED


def test_a_request_asked_once_never_goes_twice():
    # rank_and_size records the worker in the driver: where its connection breaks after it
    # was sent, it is not sent again.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    requests = []

    def serve():
        connection, _ = listener.accept()
        requests.append(connection.recv(4096))
        connection.close()

    threading.Thread(target=serve, daemon=True).start()
    server = RendezvousServer(*listener.getsockname())
    with pytest.raises(LauncherGone, match="broke while it was asked /rank_and_size/h1:0"):
        server.get("rank_and_size", "h1:0", once=True)
    listener.close()
    assert len(requests) == 1


def test_reach_tells_an_answer_from_silence(store):
    store.put("scope", "key", b"1")
    assert store.reach("GET", "/scope/key")[:2] == (rendezvous.ANSWERED, 200)
    assert store.reach("GET", "/scope/other")[:2] == (rendezvous.ANSWERED, 404)
