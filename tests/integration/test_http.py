"""kvwatch's HTTP endpoints (``exporters/http.py``) on loopback: /metrics, /healthz, /readyz,
garbage requests, concurrent scrapes, TLS (and ``kvwatch top`` trusting the daemon's certificate)."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from kvwatch.daemon.snapshot import Snapshot
from kvwatch.exporters.http import MetricsServer
from kvwatch.exporters.prometheus import SnapshotCollector, build_registry

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
