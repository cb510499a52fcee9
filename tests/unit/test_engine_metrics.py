"""The engine /metrics reader against each engine's exposition, served over HTTP on loopback.

Fixtures: ``tests/fixtures/engine_metrics`` (``tests/tools/engine_metrics_fixtures.py``
writes them with prometheus-client and each engine's own metric declarations).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from kvwatch.daemon.engines.metrics import EngineScraper, parse_exposition
from kvwatch.daemon.engines.taps import sample_series
from kvwatch.daemon.engines.views import EngineSample, ScrapeTarget

FIXTURES = Path(__file__).parent.parent / "fixtures" / "engine_metrics"


class _Handler(BaseHTTPRequestHandler):
    routes: ClassVar[dict[str, tuple[int, bytes, float]]] = {}

    def do_GET(self) -> None:
        status, body, delay = self.routes.get(self.path, (404, b"no such path", 0.0))
        if delay:
            time.sleep(delay)
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
def server() -> Iterator[tuple[str, dict[str, tuple[int, bytes, float]]]]:
    routes: ClassVar[dict[str, tuple[int, bytes, float]]] = {}
    handler = type("H", (_Handler,), {"routes": routes})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}", routes
    finally:
        srv.shutdown()
        srv.server_close()


def scrape(url: str, timeout: float = 1.0) -> tuple[EngineSample | None, dict[str, int]]:
    s = EngineScraper(timeout=timeout, thrash_seconds=10.0)
    target = ScrapeTarget(url, "1@1")
    s.set_targets([target])
    s.scrape_once()
    st = s.states()[target]
    s.close()
    return st.last, st.failures


def serve(routes: dict[str, tuple[int, bytes, float]], name: str) -> str:
    routes[f"/{name}"] = (200, (FIXTURES / name).read_bytes(), 0.0)
    return f"/{name}"


def test_vllm_033(server: tuple[str, dict[str, tuple[int, bytes, float]]]) -> None:
    base, routes = server
    sample, failures = scrape(base + serve(routes, "vllm-0.33.0.txt"))
    assert failures == {} and sample is not None
    assert sample.usage == pytest.approx(0.92)  # the fuller of two data-parallel engines
    assert (sample.prefix_queries, sample.prefix_hits) == (200_001, 122_001)  # tokens, summed over engines
    assert sample.preemptions == 14 and sample.running == 24 and sample.waiting == 6
    assert sample.sleeping is False
    assert (sample.idle_evict_samples, sample.idle_evict_young) == (100, 50)  # le=10 bucket of the idle histogram


def test_vllm_011_old_and_new_names_not_double_counted(server: tuple[str, dict[str, tuple[int, bytes, float]]]) -> None:
    base, routes = server
    sample, _ = scrape(base + serve(routes, "vllm-0.11.0.txt"))
    assert sample is not None
    assert (sample.usage, sample.prefix_queries, sample.prefix_hits) == (0.42, 100_000, 61_000)
    assert sample.sleeping is None and sample.idle_evict_samples is None  # not exported by this release


def test_sglang_rank_zero_speaks(server: tuple[str, dict[str, tuple[int, bytes, float]]]) -> None:
    base, routes = server
    sample, _ = scrape(base + serve(routes, "sglang-0.5.23.txt"))
    assert sample is not None
    assert sample.usage == 0.97
    assert sample.evicted_tokens == 123_456  # tp_rank 1's doubled copy left out
    assert (sample.prefix_queries, sample.prefix_hits) == (100_000, 35_000)  # prompt tokens, cached tokens
    assert sample.preemptions == 11 and sample.running == 30 and sample.waiting == 5


def test_lmcache(server: tuple[str, dict[str, tuple[int, bytes, float]]]) -> None:
    base, routes = server
    sample, _ = scrape(base + serve(routes, "lmcache-0.5.6.txt"))
    assert sample is not None
    assert (sample.lmcache_evicted_keys, sample.lmcache_hit_tokens, sample.lmcache_requested_tokens) == (
        257,
        20_000,
        50_000,
    )
    assert sample.usage is None and sample.prefix_queries is None


def test_failures_counted_by_reason(server: tuple[str, dict[str, tuple[int, bytes, float]]]) -> None:
    base, routes = server
    routes["/slow"] = (200, (FIXTURES / "vllm-0.33.0.txt").read_bytes(), 1.5)
    routes["/broken"] = (500, b"oops", 0.0)
    routes["/garbage"] = (200, b"this is {not the exposition format\n", 0.0)
    t0 = time.monotonic()
    assert scrape(base + "/slow", timeout=0.3) == (None, {"timeout": 1})
    assert time.monotonic() - t0 < 1.4  # bounded by the timeout, not by the engine
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


def test_last_good_sample_kept_through_failures(server: tuple[str, dict[str, tuple[int, bytes, float]]]) -> None:
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


def test_parser_rejects_non_exposition() -> None:
    with pytest.raises(ValueError):
        parse_exposition("vllm:kv_cache_usage_perc{engine=0 oops\n", at=0.0)


def _offload_page(flat: bool, labelled: bool) -> str:
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    r = CollectorRegistry()
    lab = ["model_name", "engine"]
    Counter("vllm:external_prefix_cache_queries", "q", lab, registry=r).labels("m", "0").inc(30_400)
    Counter("vllm:external_prefix_cache_hits", "h", lab, registry=r).labels("m", "0").inc(4_800)
    if flat:
        Counter("vllm:kv_offload_store_bytes", "s", lab, registry=r).labels("m", "0").inc(2_936_012_800)
        Counter("vllm:kv_offload_load_bytes", "l", lab, registry=r).labels("m", "0").inc(157_286_400)
    if labelled:  # the older name vLLM 0.26 keeps beside the flat ones, by transfer_type
        c = Counter("vllm:kv_offload_total_bytes", "t", [*lab, "transfer_type"], registry=r)
        c.labels("m", "0", "GPU_to_CPU").inc(2_936_012_800)
        c.labels("m", "0", "CPU_to_GPU").inc(157_286_400)
    return generate_latest(r).decode()


@pytest.mark.parametrize(("flat", "labelled"), [(True, True), (True, False), (False, True)])
def test_vllm_offload_and_external_prefix_cache(flat: bool, labelled: bool) -> None:
    s = parse_exposition(_offload_page(flat, labelled), at=1.0)
    assert (s.external_queries, s.external_hits) == (30_400, 4_800)
    assert (s.offload_store_bytes, s.offload_load_bytes) == (2_936_012_800, 157_286_400)  # never summed twice
    c = sample_series(s)
    assert c["engine_external_prefix_queries"] == 30_400 and c["engine_offload_load_bytes"] == 157_286_400


def test_real_vllm_026_page() -> None:
    """vLLM 0.26.0's own /metrics on the H200 after the validation run (tests/gpu/results): the
    numbers kvwatch re-exported there matched these exactly; here the parser alone."""
    s = parse_exposition((FIXTURES / "vllm-0.26.0.txt").read_text(), at=1.0)
    assert (s.prefix_queries, s.prefix_hits) == (13_207_980, 6_291_648)
    assert (s.external_queries, s.external_hits) == (6_528_096, 11_584)
    assert (s.offload_store_bytes, s.offload_load_bytes) == (212_630_241_280, 2_162_688_000)
    assert (s.preemptions, s.usage, s.sleeping, s.running, s.waiting) == (1136, 0.0, False, 0, 0)
    assert s.generation_tokens == 322_409  # not request_generation_tokens, a histogram of the same tokens
