"""Scraping engines' ``/metrics``: each engine on its own cadence, each scrape held to a deadline.

What a page says is ``exposition.py``'s to read; here is when each engine is scraped and how a
scrape ends. Re-exported on kvwatch's /metrics, as the last scrape read them: the numbers its
alerts join with (KV usage, prefix-cache queries and hits per medium, preemptions, sleep, the
engine's own offload byte counts beside the copy probes'); nothing else of the engine's.

* Every target is scraped each ``interval`` seconds on its own schedule, at most one scrape in
  flight per target, on at most ``workers`` threads: a slow engine delays no other. When more
  engines are stuck than there are workers, each holds its worker until its deadline and the
  target that has waited longest goes next; a scrape that overran its interval waits one
  interval after it ends.
* One scrape (connecting, the engine's answer, reading and parsing the page) ends within
  ``timeout`` seconds: every wait on the socket is given only the time left, so an engine that
  trickles its answer a byte at a time fails at the deadline (``deadline``), and so does a page
  still being parsed.
* Redirects are never followed (a 3xx is the failure ``redirect``); a page is at most
  ``MAX_BODY`` bytes (``too_large``). Where the URL came from an engine's command line, its host
  is one of the engine's own addresses (``reach.py``).
* Every failure is counted by reason (``kvwatch_engine_scrapes_total{result}``) and logged once
  per engine and reason, with where it happened: never the page's text, the engine's reason
  phrase or the URL's user info.
"""

from __future__ import annotations

import errno
import functools
import http
import http.client
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import structlog

from kvwatch.daemon.engines.exposition import DeadlineExceeded, PageError, parse_exposition
from kvwatch.daemon.model.engines import EngineSample, ScrapeTarget, TargetState

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

__all__ = ["MAX_BODY", "EngineScraper", "ScrapeFailed", "failure", "fetch", "parse_exposition"]

log = structlog.get_logger("kvwatch.engine_metrics")

MAX_BODY = 4 << 20  # 60 x the largest real page seen (vLLM 0.26.0 with its histograms: 67 KB)
READ_CHUNK = 64 << 10
WORKERS = 4
ACCEPT = "text/plain;version=0.0.4"
HTTP_STATUSES = frozenset(int(x) for x in http.HTTPStatus)  # http_NNN for these, http_other for the rest


class ScrapeFailed(Exception):
    """A scrape that got no page: ``reason`` is its counted result, ``detail`` names no content."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("the scrape's deadline passed")
        return left


class _DeadlineSocket(socket.socket):
    """A TCP socket whose every wait is given only the time left before the scrape's deadline."""

    deadline: _Deadline | None = None

    def _arm(self) -> None:
        if self.deadline is not None:
            self.settimeout(self.deadline.left())

    def recv_into(self, buffer: WriteableBuffer, nbytes: int = 0, flags: int = 0) -> int:
        self._arm()
        return super().recv_into(buffer, nbytes, flags)

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        self._arm()
        return super().recv(bufsize, flags)

    def sendall(self, data: ReadableBuffer, flags: int = 0) -> None:
        self._arm()
        super().sendall(data, flags)


class _DeadlineTLSSocket(ssl.SSLSocket):
    """The same over TLS: each read of a record, and the request's write, is given the time left
    (the handshake has what was left when the connection was made)."""

    deadline: _Deadline | None = None

    def _arm(self) -> None:
        if self.deadline is not None:
            self.settimeout(self.deadline.left())

    def read(self, len: int = 1024, buffer: Any = None) -> Any:
        self._arm()
        return super().read(len, buffer)

    def sendall(self, data: ReadableBuffer, flags: int = 0) -> None:
        self._arm()
        super().sendall(data, flags)


@functools.cache
def _tls() -> ssl.SSLContext:
    ctx = ssl.create_default_context()  # verified, as urllib did: an engine's own certificate must be trusted
    ctx.sslsocket_class = _DeadlineTLSSocket
    return ctx


def _open(host: str, port: int, deadline: _Deadline) -> _DeadlineSocket:
    last: OSError = ConnectionError("no address")
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = _DeadlineSocket(family, kind, proto)
        sock.deadline = deadline
        try:
            sock.settimeout(deadline.left())
            sock.connect(addr)
        except OSError as err:
            sock.close()
            last = err
            continue
        return sock
    raise last


class _Connection(http.client.HTTPConnection):
    def __init__(self, host: str, port: int | None, deadline: _Deadline) -> None:
        super().__init__(host, port, timeout=deadline.left())
        self.deadline = deadline

    def connect(self) -> None:
        self.sock = _open(self.host, self.port, self.deadline)


class _TLSConnection(http.client.HTTPSConnection):
    def __init__(self, host: str, port: int | None, deadline: _Deadline) -> None:
        super().__init__(host, port, timeout=deadline.left(), context=_tls())
        self.deadline = deadline

    def connect(self) -> None:
        sock = _tls().wrap_socket(_open(self.host, self.port, self.deadline), server_hostname=self.host)
        if isinstance(sock, _DeadlineTLSSocket):  # always: the context makes these
            sock.deadline = self.deadline
        self.sock = sock


def fetch(url: str, seconds: float) -> str:
    """GET one page within ``seconds`` all told. Raises ScrapeFailed, DeadlineExceeded, OSError
    or http.client's errors (``failure`` names each)."""
    deadline = _Deadline(seconds)
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise ScrapeFailed("url", "port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ScrapeFailed("url", "scheme or host")
    conn = (_TLSConnection if parts.scheme == "https" else _Connection)(parts.hostname, port, deadline)
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", path, headers={"Accept": ACCEPT})
        resp = conn.getresponse()
        if 300 <= resp.status < 400:
            raise ScrapeFailed("redirect", f"HTTP {resp.status}, not followed")
        if not 200 <= resp.status < 300:
            raise ScrapeFailed(f"http_{resp.status}" if resp.status in HTTP_STATUSES else "http_other")
        return _body(resp).decode("utf-8", errors="replace")
    finally:
        conn.close()


def _body(resp: http.client.HTTPResponse) -> bytes:
    if resp.length is not None and resp.length > MAX_BODY:
        raise ScrapeFailed("too_large", f"more than {MAX_BODY} bytes")
    chunks, size = [], 0
    while chunk := resp.read(READ_CHUNK):
        size += len(chunk)
        if size > MAX_BODY:
            raise ScrapeFailed("too_large", f"more than {MAX_BODY} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


# in order: the first class an error is an instance of names its reason
_FAILURES: tuple[tuple[type[BaseException], str], ...] = (
    (TimeoutError, "deadline"),  # socket timeouts too: every wait was given the time left
    (ssl.SSLError, "tls"),
    (http.client.RemoteDisconnected, "connect"),  # closed without an answer
    (http.client.HTTPException, "protocol"),
    (OSError, "connect"),
)


def failure(err: BaseException, seconds: float) -> tuple[str, str]:
    """A failed scrape's counted reason, and where it failed: never text the engine sent."""
    if isinstance(err, ScrapeFailed):
        return err.reason, err.detail
    if isinstance(err, PageError):
        return "parse", str(err)
    reason = next((r for kind, r in _FAILURES if isinstance(err, kind)), "other")
    if reason == "deadline":
        return reason, f"no page within {seconds:g} s"
    code = err.errno if isinstance(err, OSError) and reason == "connect" else None
    return reason, errno.errorcode.get(code or 0, type(err).__name__)


def shown_url(url: str) -> str:
    """A URL for a log line: scheme, host, port and path (no user info, no query)."""
    try:
        p = urlsplit(url)
        port = p.port
    except ValueError:
        return "(unparsable)"
    return f"{p.scheme}://{p.hostname}{f':{port}' if port else ''}{p.path}"


@dataclass(slots=True)
class _Target:
    """The scraper's own, mutable account of a target (``TargetState`` is its copy)."""

    ok: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # reason -> count
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> samples
    last: EngineSample | None = None
    last_error: str = ""
    due: float = 0.0  # monotonic time its next scrape may start
    logged: set[str] = field(default_factory=set)  # what was logged of it already

    def copy(self, t: ScrapeTarget) -> TargetState:
        return TargetState(t, self.ok, dict(self.failures), self.last, self.last_error, dict(self.rejected))

    def log_once(self, kind: str, event: str, url: str, **kw: object) -> None:
        if kind not in self.logged:
            self.logged.add(kind)
            log.warning(event, url=shown_url(url), **kw)


class EngineScraper:
    """Scrapes every target each ``interval`` seconds, on its own cadence (``_run``'s thread
    schedules, ``workers`` threads scrape, each scrape within ``timeout``); the agent reads
    ``states()``."""

    def __init__(
        self,
        *,
        interval: float = 5.0,
        timeout: float = 2.0,
        thrash_seconds: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        fetcher: Callable[[str, float], str] = fetch,
        workers: int = WORKERS,
    ) -> None:
        self.interval = interval
        self.timeout = timeout
        self.thrash_seconds = thrash_seconds
        self.clock = clock  # a sample's time; scheduling and deadlines run on time.monotonic
        self.fetcher = fetcher
        self.workers = workers
        self._lock = threading.Lock()
        self._states: dict[ScrapeTarget, _Target] = {}
        self._flying: set[ScrapeTarget] = set()  # a scrape in flight (a target removed meanwhile too)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvwatch-scrape")

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvwatch-engine-metrics", daemon=True)
            self._thread.start()

    def set_targets(self, targets: Iterable[ScrapeTarget]) -> None:
        wanted = set(targets)
        now = time.monotonic()
        with self._lock:
            new = wanted - self._states.keys()
            for t in list(self._states):
                if t not in wanted:
                    del self._states[t]
            for t in new:
                self._states[t] = _Target(due=now)  # a new engine is scraped at once
        if new:
            self._wake.set()

    def states(self) -> dict[ScrapeTarget, TargetState]:
        with self._lock:
            return {t: s.copy(t) for t, s in self._states.items()}

    def close(self) -> None:
        """Stops scheduling; a scrape in flight ends by its deadline on its own."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)  # the scheduler never waits on a scrape
            self._thread = None
        self._pool.shutdown(wait=False, cancel_futures=True)

    def scrape_once(self) -> None:
        """Scrape every target not in flight now, together, and wait for them (each within its
        deadline): for ``kvwatch doctor`` and tests; the daemon's thread schedules on its own."""
        with self._lock:
            targets = [t for t in self._states if t not in self._flying]
            self._flying.update(targets)
        wait_all([self._pool.submit(self._work, t) for t in targets])

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                pause = self._dispatch()
            except Exception as err:  # never let the schedule die; a scrape's own errors are counted
                log.warning("engine metrics schedule failed", error=type(err).__name__)
                pause = self.interval
            self._wake.wait(pause)

    def _dispatch(self) -> float:
        """Start the due targets free workers can take, the longest waiting first; returns the
        seconds until the next is due (a finished scrape wakes the schedule sooner)."""
        now = time.monotonic()
        with self._lock:
            waiting = sorted(
                ((st.due, t) for t, st in self._states.items() if t not in self._flying), key=lambda x: x[0]
            )
            free = max(self.workers - len(self._flying), 0)
            start = [t for due, t in waiting if due <= now][:free]
            self._flying.update(start)
        for t in start:
            try:
                self._pool.submit(self._work, t)
            except RuntimeError:  # closing: the pool takes no more
                with self._lock:
                    self._flying.discard(t)
        later = [due for due, t in waiting if t not in start]
        if not later or len(start) >= free:
            return self.interval
        return max(min(later) - now, 0.0)

    def _work(self, target: ScrapeTarget) -> None:
        started = time.monotonic()
        sample, err = self._scrape(target)
        finished = time.monotonic()
        with self._lock:
            self._flying.discard(target)
            st = self._states.get(target)
            if st is not None:
                on_time = finished < started + self.interval
                st.due = started + self.interval if on_time else finished + self.interval
                self._record(target, st, sample, err)
        self._wake.set()

    def _scrape(self, target: ScrapeTarget) -> tuple[EngineSample | None, BaseException | None]:
        deadline = time.monotonic() + self.timeout
        try:
            text = self.fetcher(target.url, self.timeout)
            sample = parse_exposition(text, at=self.clock(), thrash_seconds=self.thrash_seconds, deadline=deadline)
        except Exception as err:  # any failure of a peer is a counted scrape failure
            return None, err
        return sample, None

    def _record(
        self, target: ScrapeTarget, st: _Target, sample: EngineSample | None, err: BaseException | None
    ) -> None:
        if sample is not None:
            st.ok += 1
            st.last = sample
            st.last_error = ""
            for reason, n in sample.rejected.items():
                st.rejected[reason] = st.rejected.get(reason, 0) + n
                st.log_once(f"rejected {reason}", "engine metrics samples rejected", target.url, reason=reason)
            return
        reason, detail = failure(err or RuntimeError(), self.timeout)
        st.failures[reason] = st.failures.get(reason, 0) + 1
        st.last_error = f"{reason}: {detail}" if detail else reason
        st.log_once(reason, "engine metrics scrape failed", target.url, reason=reason, detail=detail)
