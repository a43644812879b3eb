"""_runtime/gloo.py in one process: the meeting on a key-value store like horovodrun's, the
proxy that answers rank_and_size, the start timeout's checks."""
import http.server
import threading

import pytest

from hvd_adapt._runtime import gloo


class Store(http.server.BaseHTTPRequestHandler):
    """horovodrun's key-value store, as its KVStoreHandler answers (404 for a missing key)."""
    data = {}

    def do_GET(self):
        value = self.data.get(self.path)
        self.send_response(200 if value is not None else 404)
        self.send_header("Content-Length", str(len(value or b"")))
        self.end_headers()
        self.wfile.write(value or b"")

    def do_PUT(self):
        self.data[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def store():
    Store.data = {}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Store)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield gloo.RendezvousServer(*server.server_address)
    server.shutdown()
    server.server_close()


def test_ranks_meet_once_all_have_started(store):
    met = []
    late = threading.Thread(target=lambda: met.append(gloo.meet(store, 2, 3, timeout=30)))
    first = threading.Thread(target=lambda: met.append(gloo.meet(store, 0, 3, timeout=30)))
    first.start()
    late.start()
    assert first.is_alive()                  # rank 1 has not started
    assert gloo.meet(store, 1, 3, timeout=30)
    first.join(30)
    late.join(30)
    assert met == [True, True]


def test_a_rank_that_never_starts_ends_the_wait(store):
    assert gloo.meet(store, 0, 2, timeout=0.3) is False


def test_a_rank_already_in_gloos_rendezvous_has_started(store):
    # The survivors of a reset of Horovod's own hvd.elastic.run enter Gloo's rendezvous
    # without meeting: a joiner's meeting finds them there.
    store.put(gloo.GLOO_GLOBAL_SCOPE, "0", b"address")
    assert gloo.meet(store, 1, 2, timeout=30)


def test_the_proxy_answers_rank_and_size_and_passes_the_rest_on(store):
    with gloo._RankAndSizeProxy(store, b"1,3,0,1,1,3") as proxy:
        via = gloo.RendezvousServer(*proxy.server_address)
        assert via.get("rank_and_size", "h2:0") == b"1,3,0,1,1,3"
        assert store.get("rank_and_size", "h2:0") is None    # the driver was not asked again
        via.put("global", "1", b"address")
        assert store.get("global", "1") == b"address"
        assert via.get("global", "2") is None


@pytest.mark.parametrize("value", ["0", "-3", "soon", "inf"])
def test_a_bad_start_timeout_is_named(monkeypatch, value):
    monkeypatch.setenv(gloo.START_TIMEOUT_VARIABLE, value)
    with pytest.raises(ValueError, match=f"HVD_ADAPT_START_TIMEOUT_SECONDS must be a number of "
                                         f"seconds > 0, got '{value}'"):
        gloo.start_timeout()


def test_a_bad_gloo_timeout_is_named_before_the_watchdog_uses_it(monkeypatch):
    monkeypatch.setenv(gloo.TIMEOUT_VARIABLE, "5s")
    with pytest.raises(ValueError, match="HOROVOD_GLOO_TIMEOUT_SECONDS must be a number of "
                                         "seconds > 0, got '5s'"):
        gloo.collective_timeout()
    monkeypatch.delenv(gloo.TIMEOUT_VARIABLE)
    assert gloo.collective_timeout() == gloo.COLLECTIVE_TIMEOUT_SECONDS
