"""The engine /metrics scraper (``engines/metrics.py``) against each engine's exposition served
over HTTP on loopback: what it reads, and every failure counted by its reason.

Fixtures: ``tests/fixtures/engine_metrics`` (``tests/tools/engine_metrics_fixtures.py`` writes
them with prometheus-client and each engine's own metric declarations)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
from kvwatch.daemon.engines.metrics import EngineScraper
from kvwatch.daemon.engines.views import EngineSample, ScrapeTarget

from tests.support.kv_scripts import FIXTURES as ALL_FIXTURES

FIXTURES = ALL_FIXTURES / "engine_metrics"


class Routes(dict[str, tuple[int, bytes, float]]):
    """path -> (status, body, hold): a route with a hold answers only once the fixture releases
    it (at the test's end) or the hold has passed; the paths answered after a hold, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.answered: list[str] = []


class _Handler(BaseHTTPRequestHandler):
    routes: ClassVar[Routes]

    def do_GET(self) -> None:
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


@pytest.fixture
def server() -> Iterator[tuple[str, Routes]]:
    routes = Routes()
    handler = type("H", (_Handler,), {"routes": routes})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}", routes
    finally:
        routes.release.set()
        srv.shutdown()
        srv.server_close()


def scrape(url: str, timeout: float = 1.0) -> tuple[EngineSample | None, Mapping[str, int]]:
    s = EngineScraper(timeout=timeout, thrash_seconds=10.0)
    target = ScrapeTarget(url, "1@1")
    s.set_targets([target])
    s.scrape_once()
    st = s.states()[target]
    s.close()
    return st.last, st.failures


def serve(routes: Routes, name: str) -> str:
    routes[f"/{name}"] = (200, (FIXTURES / name).read_bytes(), 0.0)
    return f"/{name}"


def test_vllm_033(server: tuple[str, Routes]) -> None:
    base, routes = server
    sample, failures = scrape(base + serve(routes, "vllm-0.33.0.txt"))
    assert failures == {} and sample is not None
    assert sample.usage == pytest.approx(0.92)  # the fuller of two data-parallel engines
    assert (sample.prefix_queries, sample.prefix_hits) == (200_001, 122_001)  # tokens, summed over engines
    assert sample.preemptions == 14 and sample.running == 24 and sample.waiting == 6
    assert sample.sleeping is False
    assert (sample.idle_evict_samples, sample.idle_evict_young) == (100, 50)  # le=10 bucket of the idle histogram


def test_vllm_011_old_and_new_names_not_double_counted(server: tuple[str, Routes]) -> None:
    base, routes = server
    sample, _ = scrape(base + serve(routes, "vllm-0.11.0.txt"))
    assert sample is not None
    assert (sample.usage, sample.prefix_queries, sample.prefix_hits) == (0.42, 100_000, 61_000)
    assert sample.sleeping is None and sample.idle_evict_samples is None  # not exported by this release


def test_sglang_rank_zero_speaks(server: tuple[str, Routes]) -> None:
    base, routes = server
    sample, _ = scrape(base + serve(routes, "sglang-0.5.23.txt"))
    assert sample is not None
    assert sample.usage == 0.97
    assert sample.evicted_tokens == 123_456  # tp_rank 1's doubled copy left out
    assert (sample.prefix_queries, sample.prefix_hits) == (100_000, 35_000)  # prompt tokens, cached tokens
    assert sample.preemptions == 11 and sample.running == 30 and sample.waiting == 5


def test_lmcache(server: tuple[str, Routes]) -> None:
    base, routes = server
    sample, _ = scrape(base + serve(routes, "lmcache-0.5.6.txt"))
    assert sample is not None
    assert (sample.lmcache_evicted_keys, sample.lmcache_hit_tokens, sample.lmcache_requested_tokens) == (
        257,
        20_000,
        50_000,
    )
    assert sample.usage is None and sample.prefix_queries is None


def test_failures_counted_by_reason(server: tuple[str, Routes]) -> None:
    base, routes = server
    routes["/slow"] = (200, (FIXTURES / "vllm-0.33.0.txt").read_bytes(), 60.0)  # answers at the end
    routes["/broken"] = (500, b"oops", 0.0)
    routes["/garbage"] = (200, b"this is {not the exposition format\n", 0.0)
    assert scrape(base + "/slow", timeout=0.3) == (None, {"timeout": 1})
    assert routes.answered == []  # the timeout ended the scrape, not the engine's answer
    assert scrape(base + "/broken") == (None, {"http_500": 1})
    assert scrape(base + "/garbage") == (None, {"parse": 1})
    assert scrape(base + "/missing") == (None, {"http_404": 1})
    with socket_closed() as port:
        assert scrape(f"http://127.0.0.1:{port}/metrics") == (None, {"connect": 1})


class socket_closed:
    """A port nothing listens on."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        return port

    def __exit__(self, *exc: object) -> None:
        return None


def test_last_good_sample_kept_through_failures(server: tuple[str, Routes]) -> None:
    base, routes = server
    path = serve(routes, "vllm-0.33.0.txt")
    s = EngineScraper(timeout=1.0)
    target = ScrapeTarget(base + path, "1@1")
    s.set_targets([target])
    s.scrape_once()
    routes[path] = (503, b"", 0.0)
    s.scrape_once()
    st = s.states()[target]
    s.close()
    assert st.ok == 1 and st.failures == {"http_503": 1}
    assert st.last is not None and st.last.usage == pytest.approx(0.92)
    assert st.last_error.startswith("http_503")
