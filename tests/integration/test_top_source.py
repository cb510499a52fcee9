"""``kvwatch top``'s daemon source (``exporters/top.py``) against an HTTP endpoint on loopback:
a frame read, and each failure explained (not a frame, an HTTP error, unreachable)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest

from kvwatch.exporters.top import DaemonSource, SourceError
from kvwatch.exporters.top_model import API_PATH, build_frame, encode
from tests.support.snapshots import snap


@pytest.fixture
def server() -> Iterator[tuple[HTTPServer, dict[str, Any]]]:
    state: dict[str, Any] = {"code": 200, "body": b""}

    class H(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(state["code"])
            self.end_headers()
            self.wfile.write(state["body"])

        def log_message(self, *a: Any) -> None:
            pass

    httpd = HTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield httpd, state
    httpd.shutdown()
    httpd.server_close()


def test_daemon_source_reads_and_explains_failures(server: tuple[HTTPServer, dict[str, Any]]) -> None:
    httpd, state = server
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    src = DaemonSource(url)
    frame = build_frame(snap(5.0, 3, 0), host="n")
    state["body"] = encode(frame)
    assert src.fetch() == frame
    state["body"] = b"<html>not kvwatch</html>"
    with pytest.raises(SourceError, match="not a kvwatch top frame"):
        src.fetch()
    state["code"] = 404
    with pytest.raises(SourceError, match=f"{API_PATH}: HTTP 404"):
        src.fetch()
    httpd.shutdown()
    httpd.server_close()
    with pytest.raises(SourceError, match="unreachable"):
        src.fetch()
