"""Small real servers for tests: an HTTP endpoint that records what is POSTed to it."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@contextlib.contextmanager
def recording_server() -> Iterator[tuple[str, list[tuple[str, Any]]]]:
    """(base URL, [(path, JSON body), ...]) of every POST, answered 200 (an Alertmanager stand-in)."""
    got: list[tuple[str, Any]] = []

    class H(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            got.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", got
    finally:
        httpd.shutdown()
        httpd.server_close()
