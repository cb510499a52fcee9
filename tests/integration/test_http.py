"""kvwatch's HTTP endpoints (``exporters/http.py``) on loopback: /metrics, /healthz, /readyz,
garbage requests, concurrent scrapes, TLS (and ``kvwatch top`` trusting the daemon's certificate)."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from kvwatch.daemon.model.snapshot import Snapshot
from kvwatch.exporters.http import MetricsServer
from kvwatch.exporters.prometheus import SnapshotCollector, build_registry
from tests.support.daemon import wait_until
from tests.support.snapshots import snap


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    state = {"snap": snap(995.0, 3, 0)}
    collector = SnapshotCollector(lambda: state["snap"], clock=lambda: 1001.0)
    srv = MetricsServer("127.0.0.1", 0, build_registry(collector), lambda: state["snap"], clock=lambda: 1001.0)
    srv.state = state  # type: ignore[attr-defined]
    srv.start()
    yield srv
    srv.stop()


def get(srv: MetricsServer, path: str) -> tuple[int, str]:
    host, port = srv.address
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_endpoints(server: MetricsServer) -> None:
    code, body = get(server, "/metrics")
    assert code == 200 and "kvwatch_page_free_pages_total" in body and "kvwatch_process_resident_memory_bytes" in body
    assert get(server, "/healthz") == (200, "ok\n")
    code, body = get(server, "/readyz")
    assert code == 200 and json.loads(body)["ready"] is True
    assert get(server, "/nope")[0] == 404
    server.state["snap"] = Snapshot.empty("probes loading")  # type: ignore[attr-defined]
    code, body = get(server, "/readyz")
    assert code == 503 and json.loads(body)["reasons"] == ["probes loading"]


def test_healthz_reports_stalled_loop(server: MetricsServer) -> None:
    server.state["snap"] = replace(snap(995.0, 3, 0), wall_time=1.0)  # type: ignore[attr-defined]
    assert get(server, "/healthz")[0] == 503


def test_garbage_requests_do_not_break_server(server: MetricsServer) -> None:
    host, port = server.address
    for payload in (
        b"\x00\xff garbage\r\n\r\n",
        b"GET /" + b"A" * 70000 + b" HTTP/1.1\r\n\r\n",
        b"POST /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello",
        b"",
    ):
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            s.recv(65536)
    assert get(server, "/metrics")[0] == 200


def test_concurrent_scrapes_agree(server: MetricsServer) -> None:
    bodies: list[str] = []
    lock = threading.Lock()

    def scrape() -> None:
        for _ in range(20):
            _, body = get(server, "/metrics")
            line = next(
                line
                for line in body.splitlines()
                if line.startswith("kvwatch_page_free_pages_total{") and 'pid="7"' in line
            )
            with lock:
                bodies.append(line)

    threads = [threading.Thread(target=scrape) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(bodies) == 160 and len(set(bodies)) == 1


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_tls_endpoints_and_top_over_tls(tmp_path: Path) -> None:
    """daemon.tls_cert/tls_key: every endpoint over TLS only; `kvwatch top` trusts the
    daemon's own (self-signed) certificate."""
    from kvwatch.exporters.top import DaemonSource, SourceError

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    snapshot = snap(995.0, 3, 0)
    collector = SnapshotCollector(lambda: snapshot, clock=lambda: 1001.0)
    srv = MetricsServer(
        "127.0.0.1", 0, build_registry(collector), lambda: snapshot, clock=lambda: 1001.0, tls_cert=cert, tls_key=key
    )
    srv.start()
    try:
        host, port = srv.address
        ctx = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(f"https://{host}:{port}/metrics", timeout=5, context=ctx) as r:
            assert r.status == 200 and b"kvwatch_build_info" in r.read()
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read()
        frame = DaemonSource(f"https://{host}:{port}", cafile=str(cert)).fetch()
        assert frame.header.tick == snapshot.tick
        with pytest.raises(SourceError, match="unreachable"):  # an unknown certificate is refused
            DaemonSource(f"https://{host}:{port}").fetch()
    finally:
        srv.stop()


# --- hostile clients: idle and trickling connections, TLS handshakes, resets ------------------------


class _Clock:
    """The server's monotonic clock for connection deadlines, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _server(**kw: Any) -> MetricsServer:
    snapshot = snap(995.0, 3, 0)
    collector = SnapshotCollector(lambda: snapshot, clock=lambda: 1001.0)
    kw.setdefault("get_snapshot", lambda: snapshot)
    srv = MetricsServer("127.0.0.1", 0, build_registry(collector), clock=lambda: 1001.0, **kw)
    srv.start()
    return srv


def _drops(srv: MetricsServer, scheme: str = "http", context: ssl.SSLContext | None = None) -> dict[str, float]:
    """kvwatch_http_connections_dropped_total by reason, as a scrape of the server reads it."""
    host, port = srv.address
    with urllib.request.urlopen(f"{scheme}://{host}:{port}/metrics", timeout=10, context=context) as r:
        text = r.read().decode()
    return {
        s.labels["reason"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kvwatch_http_connections_dropped_total"
    }


def _dropped(srv: MetricsServer, reason: str, scheme: str = "http", context: ssl.SSLContext | None = None) -> float:
    return _drops(srv, scheme, context).get(reason, 0.0)


def _closed_without_answer(s: socket.socket) -> bool:
    """The server closed the connection and sent nothing: an end of stream, or a reset when it
    closed before reading what the client had sent."""
    try:
        return s.recv(100) == b""
    except ConnectionResetError:
        return True


def _kvwatch_http_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("kvwatch-http"))


def test_idle_connections_are_bounded_evicted_and_timed_out() -> None:
    """400 idle connections (a slow-loris) hold at most max_connections threads; a scrape still
    answers; the oldest idle connection makes room for a new one; the rest are closed when their
    request head is overdue (the deadline on an injected clock, so no test waits for it)."""
    clock = _Clock()
    srv = _server(max_connections=16, timeout_seconds=60.0, monotonic=clock)
    idle: list[socket.socket] = []
    try:
        host, port = srv.address
        for _ in range(400):
            s = socket.create_connection((host, port), timeout=10)
            s.sendall(b"GET /metr")  # a request head that never ends
            idle.append(s)
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
            assert r.status == 200 and b"kvwatch_build_info" in r.read()
        wait_until(lambda: _kvwatch_http_threads() <= 16 + 1, 30, "at most 16 connection threads and the server's")
        assert _dropped(srv, "evicted") >= 400 - 16  # the newest idle ones (less a slot per scrape) wait
        for s in idle[:8]:  # an evicted client sees its connection closed, without an answer
            assert _closed_without_answer(s)
        clock.now += 61  # every head overdue: the server's poll closes them

        def all_closed() -> bool:
            d = _drops(srv)
            return d["evicted"] + d["timeout"] == 400 and d["timeout"] >= 1

        wait_until(all_closed, 30, "every idle connection closed, by eviction or its deadline")
        wait_until(lambda: _kvwatch_http_threads() <= 1, 30, "no connection threads left")
        for s in idle[-8:]:
            assert _closed_without_answer(s)
    finally:
        for s in idle:
            s.close()
        srv.stop()


def test_busy_connections_are_not_evicted_and_over_the_bound_are_refused() -> None:
    """Connections whose request is being answered keep their slot: past the bound, with every
    slot busy, a new connection is closed at once and counted (limit)."""
    release = threading.Event()
    entered = threading.Semaphore(0)
    snapshot = snap(995.0, 3, 0)

    def slow_snapshot() -> Snapshot:
        entered.release()
        release.wait(30)
        return snapshot

    srv = _server(max_connections=2, timeout_seconds=60.0, get_snapshot=slow_snapshot)
    busy: list[socket.socket] = []
    try:
        host, port = srv.address
        for _ in range(2):
            s = socket.create_connection((host, port), timeout=10)
            s.sendall(b"GET /readyz HTTP/1.0\r\n\r\n")
            busy.append(s)
            assert entered.acquire(timeout=10)
        with socket.create_connection((host, port), timeout=10) as refused:
            assert refused.recv(100) == b""  # closed at once, not queued behind the busy ones
        release.set()
        for s in busy:
            assert b"200 OK" in s.recv(4096)
        wait_until(lambda: srv.table.counts()[1] == 0, 30, "the answered connections' slots free")
        assert _dropped(srv, "limit") == 1 and _dropped(srv, "evicted") == 0
    finally:
        release.set()
        for s in busy:
            s.close()
        srv.stop()


def test_an_oversized_request_head_is_refused() -> None:
    """A request head is read up to a bound (not the 100 headers of 64 KiB each that http.server
    allows): the memory one connection can hold is small."""
    srv = _server()
    try:
        host, port = srv.address
        with socket.create_connection((host, port), timeout=10) as s:
            try:  # the server stops reading at its bound: the rest of this may meet a closed connection
                s.sendall(
                    b"GET /metrics HTTP/1.0\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 60000) for i in range(90))
                )
                s.shutdown(socket.SHUT_WR)
                head = s.recv(100)
            except (BrokenPipeError, ConnectionResetError):
                head = b""
        assert head == b"" or head.startswith(b"HTTP/1.0 431"), head  # never the page
        assert _dropped(srv, "too_large") == 1
    finally:
        srv.stop()


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_an_idle_tls_connection_does_not_block_other_scrapes(tmp_path: Path) -> None:
    """With TLS on, a TCP connection that never starts its handshake holds only its own thread:
    an HTTPS scrape behind it answers; its handshake is cut off at its deadline."""
    cert, key = _self_signed(tmp_path)
    clock = _Clock()
    srv = _server(tls_cert=cert, tls_key=key, timeout_seconds=60.0, monotonic=clock)
    ctx = ssl.create_default_context(cafile=str(cert))
    host, port = srv.address
    idle = socket.create_connection((host, port), timeout=10)
    try:
        with urllib.request.urlopen(f"https://{host}:{port}/metrics", timeout=10, context=ctx) as r:
            assert r.status == 200 and b"kvwatch_build_info" in r.read()
        with socket.create_connection((host, port), timeout=10) as plain:  # plain HTTP on the TLS port
            plain.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            plain.recv(100)
        wait_until(lambda: _dropped(srv, "tls", "https", ctx) >= 1, 30, "the failed handshake counted")
        clock.now += 61
        wait_until(lambda: _dropped(srv, "timeout", "https", ctx) >= 1, 30, "the idle handshake cut off")
        assert _closed_without_answer(idle)
    finally:
        idle.close()
        srv.stop()


def test_a_client_reset_is_one_log_line_not_a_traceback(capfd: pytest.CaptureFixture[str]) -> None:
    """A client that resets its connection while its answer is being made: no traceback on
    stderr, one structured log line for the kind (however often it happens), each one counted."""
    entered, release = threading.Event(), threading.Event()
    snapshot = snap(995.0, 3, 0)

    def held_snapshot() -> Snapshot:
        entered.set()
        release.wait(30)
        return snapshot

    srv = _server(get_snapshot=held_snapshot)
    try:
        host, port = srv.address
        with capture_logs() as logs:
            for n in (1, 2):
                entered.clear()
                release.clear()
                s = socket.create_connection((host, port), timeout=10)
                s.sendall(b"GET /readyz HTTP/1.0\r\n\r\n")
                assert entered.wait(10)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()  # RST
                release.set()
                wait_until(lambda n=n: _dropped(srv, "reset") >= n, 30, f"reset {n} counted")
        resets = [e for e in logs if e.get("kind") == "reset"]
        assert len(resets) == 1 and resets[0]["client"] == "127.0.0.1", logs
        assert "error" in resets[0] and "\n" not in str(resets[0])
    finally:
        release.set()
        srv.stop()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err


def test_listens_on_ipv6_loopback() -> None:
    """daemon.listen = "[::1]:PORT" (parse_listen accepts it): the server binds an IPv6 socket."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    snapshot = snap(995.0, 3, 0)
    srv = MetricsServer(
        "::1", 0, build_registry(SnapshotCollector(lambda: snapshot)), lambda: snapshot, clock=lambda: 1001.0
    )
    srv.start()
    try:
        with urllib.request.urlopen(f"http://[::1]:{srv.address[1]}/healthz", timeout=10) as r:
            assert r.status == 200
    finally:
        srv.stop()
