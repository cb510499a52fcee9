"""The engine /metrics scraper (``engines/metrics.py``) against each engine's exposition served
over HTTP on loopback: what it reads, and every failure counted by its reason.

Fixtures: ``tests/fixtures/engine_metrics`` (``tests/tools/engine_metrics_fixtures.py`` writes
them with prometheus-client and each engine's own metric declarations)."""

from __future__ import annotations

import math
import socket
from collections.abc import Iterator, Mapping
from dataclasses import replace

import pytest
import structlog

from kvwatch.daemon.engines.metrics import EngineScraper
from kvwatch.daemon.model.engines import EnginePlan, EngineSample, EngineView, ScrapeTarget
from kvwatch.exporters.prom_engines import engine_families
from tests.support.daemon import wait_until
from tests.support.engine_pages import Routes, page_server
from tests.support.kv_scripts import FIXTURES as ALL_FIXTURES
from tests.support.snapshots import snap

FIXTURES = ALL_FIXTURES / "engine_metrics"


@pytest.fixture
def server() -> Iterator[tuple[str, Routes]]:
    with page_server() as served:
        yield served


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
    assert scrape(base + "/slow", timeout=0.3) == (None, {"deadline": 1})
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


def test_a_slow_engine_never_delays_another(server: tuple[str, Routes]) -> None:
    """Each target on its own cadence: while one engine holds its answer (its deadline far off),
    another engine's scrapes keep coming at their interval."""
    base, routes = server
    good = ScrapeTarget(base + serve(routes, "vllm-0.33.0.txt"), "1@1")
    routes["/held"] = (200, b"", 600.0)  # answers when the fixture releases it
    held = ScrapeTarget(base + "/held", "2@2")
    s = EngineScraper(interval=0.05, timeout=120.0)
    s.set_targets([held, good])
    s.start()
    try:
        wait_until(lambda: s.states()[good].ok >= 5, 30, "five scrapes of the healthy engine")
        st = s.states()
        assert (st[held].ok, dict(st[held].failures)) == (0, {})  # its one scrape still in flight
        assert st[good].failures == {}
    finally:
        s.close()


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_trickling_page_fails_by_its_deadline(server: tuple[str, Routes], where: str) -> None:
    """One byte every 50 ms never trips a per-read timeout; the whole-request deadline ends the
    scrape, counted, and the healthy engine beside it is scraped all along."""
    base, routes = server
    routes.trickle["/slow"] = where
    slow = ScrapeTarget(base + "/slow", "2@2")
    good = ScrapeTarget(base + serve(routes, "vllm-0.33.0.txt"), "1@1")
    s = EngineScraper(interval=0.05, timeout=0.5)
    s.set_targets([slow, good])
    s.start()
    try:
        wait_until(lambda: s.states()[slow].failures.get("deadline", 0) >= 2, 30, "two deadline failures")
        st = s.states()
        assert st[slow].ok == 0 and set(st[slow].failures) == {"deadline"}
        assert st[slow].last_error.startswith("deadline")
        # the healthy engine is scraped all along; its own page, parsed on a machine busy enough,
        # may miss a 0.5 s deadline too: that is a timing outcome, not the slow engine's doing
        assert st[good].ok >= 1 and set(st[good].failures) <= {"deadline"}
    finally:
        s.close()


def test_stuck_scrapes_hold_a_worker_no_longer_than_their_deadline(server: tuple[str, Routes]) -> None:
    """More stuck engines than workers: each holds its worker until its deadline, then the
    healthy engine, waiting longest, is scraped next."""
    base, routes = server
    good = ScrapeTarget(base + serve(routes, "vllm-0.33.0.txt"), "1@1")
    stuck = [ScrapeTarget(f"{base}/held{i}", f"{i + 2}@2") for i in range(3)]
    for t in stuck:
        routes[t.url.removeprefix(base)] = (200, b"", 600.0)
    s = EngineScraper(interval=0.05, timeout=0.3, workers=2)
    s.set_targets([*stuck, good])
    s.start()
    try:
        wait_until(
            lambda: s.states()[good].ok >= 3 and all(s.states()[t].failures.get("deadline") for t in stuck),
            30,
            "the healthy engine scraped while the stuck ones fail by their deadline",
        )
        assert set(s.states()[good].failures) <= {"deadline"}  # only a busy machine's timing, never another's
    finally:
        s.close()


def test_a_redirect_is_a_counted_failure_never_followed(server: tuple[str, Routes]) -> None:
    base, routes = server
    serve(routes, "vllm-0.33.0.txt")
    location = f"{base}/vllm-0.33.0.txt".encode()
    routes.raw["/metrics"] = b"HTTP/1.1 302 Found\r\nLocation: " + location + b"\r\nContent-Length: 0\r\n\r\n"
    assert scrape(base + "/metrics") == (None, {"redirect": 1})
    assert routes.hits == ["/metrics"]  # the page it points at was never asked for


LEAK_MARK = "sk-live-7f3a9c"


def test_errors_name_the_position_and_kind_never_the_page(server: tuple[str, Routes]) -> None:
    """A page's text (a credential in a label) and an engine's reason phrase never reach the
    log or the scrape's state: only the line, the kind of error, the status."""
    base, routes = server
    page = f'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3\nvllm:x{{key="{LEAK_MARK}" oops}} 1\n'
    routes["/bad"] = (200, page.encode(), 0.0)
    routes.raw["/reason"] = f"HTTP/1.1 500 {LEAK_MARK}\r\nContent-Length: 0\r\n\r\n".encode()
    bad, reason = ScrapeTarget(base + "/bad", "1@1"), ScrapeTarget(base + "/reason", "2@2")
    s = EngineScraper(timeout=2.0)
    with structlog.testing.capture_logs() as logs:
        s.set_targets([bad, reason])
        s.scrape_once()
        s.scrape_once()
    st = s.states()
    s.close()
    assert st[bad].failures == {"parse": 2} and st[bad].last_error == "parse: line 3: labels"
    assert st[reason].failures == {"http_500": 2} and st[reason].last_error == "http_500"
    assert len([e for e in logs if str(e.get("url", "")).startswith(base)]) == 2  # once per engine and kind
    assert LEAK_MARK not in repr(logs) and LEAK_MARK not in repr(st)


HOSTILE = b"""# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0"} +Inf
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0"} -3
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0"} NaN
# TYPE vllm:kv_offload_store_bytes counter
vllm:kv_offload_store_bytes_total{engine="0"} +Inf
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} 4
"""


def test_non_finite_and_negative_samples_are_rejected_counted_and_never_exported(
    server: tuple[str, Routes],
) -> None:
    """+Inf, NaN and negative values of the numbers kvwatch reads are dropped sample by sample and
    counted by reason; the rest of the page counts, and /metrics never shows them."""
    base, routes = server
    routes["/metrics"] = (200, HOSTILE, 0.0)
    target = ScrapeTarget(base + "/metrics", "7@1")
    s = EngineScraper(timeout=2.0)
    s.set_targets([target])
    s.scrape_once()
    s.scrape_once()
    st = s.states()[target]
    s.close()
    assert st.ok == 2 and st.failures == {}
    assert st.rejected == {"infinite": 4, "negative": 2, "nan": 2}
    assert st.last is not None and st.last.running == 4
    assert (st.last.usage, st.last.preemptions, st.last.prefix_queries, st.last.offload_store_bytes) == (None,) * 4
    p = snap(10.0, 1, 1).processes[0]
    view = EngineView(EnginePlan(p.key, p.pid, metrics_url=target.url), (), st, 0.0, None)
    families = {f.name: f for f in engine_families(replace(snap(10.0, 1, 1), processes=(replace(p, engine=view),)))}
    assert families["kvwatch_engine_kv_usage_ratio"].samples == []
    rejected = {x.labels["reason"]: x.value for x in families["kvwatch_engine_samples_rejected"].samples}
    assert rejected == {"infinite": 4, "negative": 2, "nan": 2}
    assert all(math.isfinite(x.value) and x.value >= 0 for f in families.values() for x in f.samples)


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_listener_that_never_answers_fails_by_the_deadline(scheme: str) -> None:
    """Connected (the kernel's backlog accepts) but never read: the request, or the TLS
    handshake, waits for nothing past the deadline."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        assert scrape(f"{scheme}://127.0.0.1:{port}/metrics", timeout=0.5) == (None, {"deadline": 1})


def test_tls_to_a_plain_http_engine_is_a_tls_failure(server: tuple[str, Routes]) -> None:
    base, _ = server
    assert scrape(base.replace("http://", "https://") + "/metrics") == (None, {"tls": 1})
