"""A key-value store like horovodrun's rendezvous server, over HTTP, for tests of the
meeting and the reset keys without a launcher."""
import http.server


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
