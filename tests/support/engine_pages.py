"""A stand-in for engines' /metrics on loopback: pages per path, held, trickled, or raw bytes
of the test's making (a status line, a redirect, garbage)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar


class Routes(dict[str, tuple[int, bytes, float]]):
    """path -> (status, body, hold): a route with a hold answers only once the fixture releases
    it (at the test's end) or the hold has passed; the paths answered after a hold, in order.
    ``trickle``: path -> where ("headers" / "body") the answer dribbles out one byte each 50 ms
    until the fixture releases it; ``raw``: path -> bytes written as they are (a status line of
    the test's making); ``hits``: every path asked for, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.answered: list[str] = []
        self.trickle: dict[str, str] = {}
        self.raw: dict[str, bytes] = {}
        self.hits: list[str] = []


class _Handler(BaseHTTPRequestHandler):
    routes: ClassVar[Routes]

    def _dribble(self, head: bytes, byte: bytes) -> None:
        try:
            self.wfile.write(head)
            while not self.routes.release.wait(0.05):
                self.wfile.write(byte)
        except OSError:
            pass  # the scraper gave up

    def do_GET(self) -> None:
        self.routes.hits.append(self.path)
        where = self.routes.trickle.get(self.path)
        if where == "headers":  # a status line, then a header that never ends
            return self._dribble(b"HTTP/1.1 200 OK\r\nX-Slow: ", b"a")
        if where == "body":
            return self._dribble(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n", b"#")
        if self.path in self.routes.raw:
            self.wfile.write(self.routes.raw[self.path])
            return None
        status, body, hold = self.routes.get(self.path, (404, b"no such path", 0.0))
        if hold:
            self.routes.release.wait(hold)
            self.routes.answered.append(self.path)
        try:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the scraper gave up first (the timeout test)

    def log_message(self, *args: object) -> None:
        return None


@contextlib.contextmanager
def page_server() -> Iterator[tuple[str, Routes]]:
    """(base URL, its routes); every hold and trickle is released when the block ends."""
    routes = Routes()
    handler = type("H", (_Handler,), {"routes": routes})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}", routes
    finally:
        routes.release.set()
        srv.shutdown()
        srv.server_close()
