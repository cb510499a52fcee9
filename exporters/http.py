"""HTTP endpoints: /metrics, /healthz, /readyz, /api/v1/top (for `kvwatch top`). Loopback by default.

TLS when configured. Threaded: a slow scraper never blocks another or the probe loop (which only
publishes snapshots). Request logging goes through structlog, never stderr.
"""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import structlog
from kvwatch.daemon.snapshot import Snapshot
from kvwatch.exporters.top_model import API_PATH, build_frame, encode
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

log = structlog.get_logger("kvwatch.http")

STALE_AFTER_TICKS = 30  # /healthz turns 503 when the loop stops publishing for this long


@dataclass(frozen=True, slots=True)
class _Context:
    registry: CollectorRegistry
    get_snapshot: Callable[[], Snapshot]
    tick_seconds: float
    clock: Callable[[], float]


class _Handler(BaseHTTPRequestHandler):
    server_version = "kvwatch"
    sys_version = ""
    ctx: ClassVar[_Context]

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http", client=self.client_address[0], request=format % args)

    def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            self._send(200, encoder(self.ctx.registry), content_type)
        elif path == "/healthz":
            s = self.ctx.get_snapshot()
            stale = s.wall_time and self.ctx.clock() - s.wall_time > STALE_AFTER_TICKS * self.ctx.tick_seconds
            if stale:
                self._send(503, b"loop stalled\n")
            else:
                self._send(200, b"ok\n")
        elif path == "/readyz":
            s = self.ctx.get_snapshot()
            body = json.dumps({"ready": s.ready, "reasons": list(s.not_ready_reasons)}).encode() + b"\n"
            self._send(200 if s.ready else 503, body, "application/json")
        elif path == API_PATH:
            self._send(200, encode(build_frame(self.ctx.get_snapshot())), "application/json")
        elif path == "/":
            self._send(200, f"kvwatch: /metrics /healthz /readyz {API_PATH}\n".encode())
        else:
            self._send(404, b"not found\n")

    do_HEAD = do_GET

    def do_POST(self) -> None:
        self._send(405, b"method not allowed\n")

    do_PUT = do_DELETE = do_PATCH = do_POST


class MetricsServer:
    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        get_snapshot: Callable[[], Snapshot],
        *,
        tick_seconds: float = 1.0,
        clock: Callable[[], float],
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
    ) -> None:
        handler = type(
            "KvwatchHandler",
            (_Handler,),
            {"ctx": _Context(registry, get_snapshot, tick_seconds, clock)},
        )
        ThreadingHTTPServer.allow_reuse_address = True
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.httpd.timeout = 5
        if tls_cert is not None and tls_key is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.load_cert_chain(str(tls_cert), str(tls_key))
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="kvwatch-http", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
