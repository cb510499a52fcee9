"""HTTP endpoints: /metrics, /healthz, /readyz, /api/v1/top (for `kvwatch top`). Loopback by default.

TLS when configured. A thread per connection, at most ``max_connections`` of them, each with a
deadline for its request head and a timeout on every read and write (``http_conns.py``): a slow
scraper never blocks another or the probe loop (which only publishes snapshots), and idle or
trickling connections cannot pile up. The accept loop only accepts: the TLS handshake runs in
the connection's own thread. Request logging goes through structlog, never stderr; a connection
that fails is counted by reason and logged once per reason, without a traceback.
"""

from __future__ import annotations

import json
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import structlog
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from kvwatch.daemon.model.snapshot import Snapshot
from kvwatch.exporters.http_conns import Conn, ConnectionStats, ConnectionTable, HeadLimit, drop_reason
from kvwatch.exporters.top_model import API_PATH, build_frame, encode

log = structlog.get_logger("kvwatch.http")

STALE_AFTER_TICKS = 30  # /healthz turns 503 when the loop stops publishing for this long
MAX_CONNECTIONS = 64  # node_exporter's --web.max-requests is 40; ours also holds idle connections
TIMEOUT_SECONDS = 10.0  # Prometheus' default scrape timeout


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

    def __init__(self, conn: Conn, address: Any, server: _Server) -> None:
        self.conn = conn
        self.table = server.table
        super().__init__(conn.sock, address, server)

    def setup(self) -> None:
        super().setup()
        self.rfile = HeadLimit(self.rfile, lambda: self.table.drop(self.conn, "too_large"))  # type: ignore[assignment]

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok:
            self.table.busy(self.conn)
        return ok

    def log_error(self, format: str, *args: Any) -> None:
        # http.server catches a read or write timeout itself and reports it only here
        if args and isinstance(args[0], TimeoutError):
            self.table.drop(self.conn, "timeout", args[0])
        else:
            self.log_message(format, *args)

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


class _Server(ThreadingHTTPServer):
    """http.server with the connection table in front of its threads; TLS per connection."""

    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 128  # connections the kernel queues for accept() (a burst of scrapers)

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[_Handler],
        table: ConnectionTable,
        timeout_seconds: float,
        tls: ssl.SSLContext | None,
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.handler = handler
        self.table = table
        self.conn_timeout = timeout_seconds
        self.tls = tls
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        conn = self.table.admit(request, str(client_address[0]))
        if conn is None:
            self.shutdown_request(request)
            return
        thread = threading.Thread(target=self._serve, args=(conn, client_address), name="kvwatch-http-conn")
        thread.daemon = True
        try:
            thread.start()
        except RuntimeError as err:  # no thread to be had: the same as no slot
            self.table.drop(conn, "limit", err)
            self.table.release(conn)
            self.shutdown_request(request)

    def _serve(self, conn: Conn, client_address: Any) -> None:
        handshake = self.tls is not None
        try:
            conn.sock.settimeout(self.conn_timeout)
            if self.tls is not None:
                self.table.rewrap(conn, self.tls)
                conn.sock.do_handshake()  # type: ignore[attr-defined]
                handshake = False
            self.handler(conn, client_address, self)
        except Exception as err:  # every failure of a connection is counted, none escapes
            self.table.drop(conn, drop_reason(err, handshake=handshake), err)
        finally:
            self.table.release(conn)
            self.shutdown_request(conn.sock)

    def service_actions(self) -> None:
        self.table.reap()  # the accept loop's poll, at least every half second

    def handle_error(self, request: Any, client_address: Any) -> None:
        """socketserver prints a traceback here; a failure outside a connection's thread is
        logged once instead."""
        err = sys.exception()
        log.error("http server error", client=str(client_address[0]), error=f"{type(err).__name__}: {err}")


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
        max_connections: int = MAX_CONNECTIONS,
        timeout_seconds: float = TIMEOUT_SECONDS,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``timeout_seconds``: for a connection's request head (TLS handshake included) from its
        accept, and for each read and write; ``monotonic`` times the heads."""
        handler = type(
            "KvwatchHandler",
            (_Handler,),
            {"ctx": _Context(registry, get_snapshot, tick_seconds, clock)},
        )
        tls = None
        if tls_cert is not None and tls_key is not None:
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            tls.minimum_version = ssl.TLSVersion.TLSv1_2
            tls.load_cert_chain(str(tls_cert), str(tls_key))
        self.table = ConnectionTable(max_connections, timeout_seconds, monotonic)
        self.httpd = _Server((host, port), handler, self.table, timeout_seconds, tls)
        self._registry = registry
        self._stats = ConnectionStats(self.table)
        registry.register(self._stats)
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
        self.table.close_all()
        self._registry.unregister(self._stats)
