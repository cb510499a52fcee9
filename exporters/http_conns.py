"""The connections kvwatch's HTTP server holds, and how many.

One thread serves one connection (HTTP/1.0: one request each), so the number of connections is
the number of threads. The table admits at most ``limit`` connections. A connection still
reading its request head (TLS handshake included) is *idle*; one whose request is being answered
is *busy*. At the limit, a new connection takes the slot of the oldest idle one, which is closed:
a slow-loris holding every slot with heads that never end cannot keep a scrape out. Only when
every slot is busy is the new connection refused (closed at once). An idle connection whose head
is not complete ``head_seconds`` after it was accepted is closed by ``reap`` (the server's poll),
so a client trickling a byte at a time is cut off as surely as a silent one; every read and
write also has a socket timeout of the same length.

A connection kvwatch closes early, or loses, is counted by reason (``DROP_REASONS``) and logged
once per reason: never a traceback on stderr.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import structlog
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvwatch.exporters.metric_specs import COUNTER, GAUGE, Metrics, MetricSpec

METRICS = Metrics(
    (
        MetricSpec(
            "kvwatch_http_connections_dropped",
            COUNTER,
            "connections to kvwatch's HTTP server closed or lost before their answer, by reason",
            ("reason",),
        ),
        MetricSpec(
            "kvwatch_http_connections_open", GAUGE, "connections kvwatch's HTTP server holds now (one thread each)", ()
        ),
    )
)

log = structlog.get_logger("kvwatch.http")

# Why a connection ended without its answer:
#   limit: refused at once, every slot busy; evicted: idle, closed to make room for a new one;
#   timeout: its request head (or a read or write) overdue; tls: the TLS handshake failed;
#   too_large: a request head past MAX_HEAD_BYTES; reset: the client went away mid-request;
#   error: kvwatch's own handler failed (a bug: logged with its exception).
DROP_REASONS = ("limit", "evicted", "timeout", "tls", "too_large", "reset", "error")
_LEVELS = {"limit": "warning", "evicted": "warning", "timeout": "info", "error": "error"}  # else info

# A request head is a request line (http.server allows 64 KiB) and headers: 128 KiB in all,
# instead of http.server's 64 KiB line plus 100 header lines of 64 KiB each (6.5 MiB a
# connection). Scrapers send well under 2 KiB.
MAX_HEAD_BYTES = 128 * 1024


@dataclass(eq=False, slots=True)
class Conn:
    sock: socket.socket  # the TLS socket once wrapped
    client: str
    deadline: float  # monotonic time by which its request head must be in
    idle: bool = True
    dropped: str = ""  # the reason kvwatch counted for it, once


class ConnectionTable:
    def __init__(self, limit: int, head_seconds: float, clock: Callable[[], float]) -> None:
        self.limit = limit
        self.head_seconds = head_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._open: dict[Conn, None] = {}  # in the order admitted: the first idle one is the oldest
        self._dropped: Counter[str] = Counter()

    def admit(self, sock: socket.socket, client: str) -> Conn | None:
        """The new connection's entry, or None: refused (the caller closes it)."""
        with self._lock:
            if len(self._open) >= self.limit:
                oldest_idle = next((c for c in self._open if c.idle), None)
                if oldest_idle is None:
                    self._count("limit", client)
                    return None
                self._shut(oldest_idle, "evicted")
                del self._open[oldest_idle]
            conn = Conn(sock, client, self.clock() + self.head_seconds)
            self._open[conn] = None
            return conn

    def rewrap(self, conn: Conn, tls: ssl.SSLContext) -> None:
        """The connection's socket wrapped in TLS (the handshake still to come): under the lock,
        so that ``_shut`` always reaches the socket that owns the descriptor."""
        with self._lock:
            conn.sock = tls.wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)

    def busy(self, conn: Conn) -> None:
        """Its request head is read: it is answered, never evicted."""
        with self._lock:
            conn.idle = False

    def drop(self, conn: Conn, reason: str, exc: BaseException | None = None) -> None:
        """Count the connection's early end (the first reason given for it)."""
        with self._lock:
            if not conn.dropped:
                conn.dropped = reason
                self._count(reason, conn.client, exc)

    def release(self, conn: Conn) -> None:
        """Its thread is done with it; after this no one shuts its socket down (it is closed)."""
        with self._lock:
            self._open.pop(conn, None)

    def reap(self) -> None:
        """Close the idle connections whose request head is overdue."""
        now = self.clock()
        with self._lock:
            for conn in [c for c in self._open if c.idle and now >= c.deadline]:
                self._shut(conn, "timeout")
                del self._open[conn]

    def close_all(self) -> None:
        with self._lock:
            for conn in self._open:
                _shutdown(conn.sock)
            self._open.clear()

    def counts(self) -> tuple[dict[str, int], int]:
        """(connections dropped by reason, connections open)."""
        with self._lock:
            return {r: self._dropped[r] for r in DROP_REASONS}, len(self._open)

    def _shut(self, conn: Conn, reason: str) -> None:
        """Wake the connection's thread (its reads and writes fail at once); it closes the socket.
        Called with the lock held, so never on a socket its thread has released and closed."""
        if not conn.dropped:
            conn.dropped = reason
            self._count(reason, conn.client)
        _shutdown(conn.sock)

    def _count(self, reason: str, client: str, exc: BaseException | None = None) -> None:
        """Count it; log the first of each reason (the counter says how often since)."""
        self._dropped[reason] += 1
        if self._dropped[reason] == 1:
            error = {} if exc is None else {"error": f"{type(exc).__name__}: {exc}"}
            getattr(log, _LEVELS.get(reason, "info"))("http connection dropped", kind=reason, client=client, **error)


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # the plain call: never the TLS state another thread uses
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def drop_reason(err: BaseException, *, handshake: bool) -> str:
    """The reason an exception out of a connection's thread ended it."""
    if isinstance(err, TimeoutError):
        return "timeout"
    if isinstance(err, http.client.LineTooLong):
        return "too_large"
    if handshake and isinstance(err, OSError):
        return "tls"
    if isinstance(err, ConnectionError | ssl.SSLEOFError | ssl.SSLZeroReturnError):
        return "reset"
    if isinstance(err, OSError):
        return "reset"  # any other socket failure mid-request: the connection is gone
    return "error"


class HeadLimit:
    """A request's input stream that gives at most ``budget`` bytes to ``readline``; past it, the
    head is too large: ``overflow`` is called and http.client.LineTooLong raised (http.server
    answers it 431 in the headers; in the request line it ends the connection)."""

    def __init__(self, raw: object, overflow: Callable[[], None], budget: int = MAX_HEAD_BYTES) -> None:
        self._raw = raw
        self._overflow = overflow
        self.left = budget

    def readline(self, size: int = -1) -> bytes:
        want = self.left if size < 0 else min(size, self.left)
        line: bytes = self._raw.readline(want)  # type: ignore[attr-defined]
        self.left -= len(line)
        if self.left <= 0 and not line.endswith(b"\n"):
            self._overflow()
            raise http.client.LineTooLong("request head")
        return line

    def __getattr__(self, name: str) -> object:
        return getattr(self._raw, name)


class ConnectionStats(Collector):
    """kvwatch's own HTTP connections, on the registry the server serves."""

    def __init__(self, table: ConnectionTable) -> None:
        self.table = table

    def collect(self) -> Iterator[Metric]:
        dropped, open_now = self.table.counts()
        fam = METRICS.counter("kvwatch_http_connections_dropped")
        for reason, n in dropped.items():
            fam.add_metric([reason], n)
        yield fam
        yield METRICS.gauge("kvwatch_http_connections_open", value=open_now)

    def describe(self) -> Iterator[Metric]:
        return self.collect()
