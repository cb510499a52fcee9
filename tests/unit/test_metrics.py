"""The engine /metrics reader against each engine's exposition, served over HTTP on loopback.

Fixtures: ``tests/fixtures/engine_metrics`` (``tests/tools/engine_metrics_fixtures.py``
writes them with prometheus-client and each engine's own metric declarations).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvwatch.daemon.engines.exposition import DeadlineExceeded, PageError, parse_exposition
from kvwatch.daemon.model.engine_scrape import scrape_counts

FIXTURES = Path(__file__).parent.parent / "fixtures" / "engine_metrics"


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
    c = scrape_counts(s)
    assert c.external_queries == 30_400 and c.offload_load_bytes == 157_286_400


def test_real_vllm_026_page() -> None:
    """vLLM 0.26.0's own /metrics on the H200 after the validation run (tests/gpu/results): the
    numbers kvwatch re-exported there matched these exactly; here the parser alone."""
    s = parse_exposition((FIXTURES / "vllm-0.26.0.txt").read_text(), at=1.0)
    assert (s.prefix_queries, s.prefix_hits) == (13_207_980, 6_291_648)
    assert (s.external_queries, s.external_hits) == (6_528_096, 11_584)
    assert (s.offload_store_bytes, s.offload_load_bytes) == (212_630_241_280, 2_162_688_000)
    assert (s.preemptions, s.usage, s.sleeping, s.running, s.waiting) == (1136, 0.0, False, 0, 0)
    assert s.generation_tokens == 322_409  # not request_generation_tokens, a histogram of the same tokens


HOSTILE_PAGE = """# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0"} +Inf
vllm:kv_cache_usage_perc{engine="1"} 1.5
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0"} -3
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0"} NaN
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0"} -Inf
# TYPE vllm:kv_offload_store_bytes counter
vllm:kv_offload_store_bytes_total{engine="0"} 1e300
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0"} 1%s
# TYPE vllm:kv_block_idle_before_evict_seconds histogram
vllm:kv_block_idle_before_evict_seconds_bucket{le="oops"} 1
vllm:kv_block_idle_before_evict_seconds_bucket{le="10.0"} 3
vllm:kv_block_idle_before_evict_seconds_bucket{le="+Inf"} 5
vllm:kv_block_idle_before_evict_seconds_count 5
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{num_gpu_blocks="\u00b2"} 1
# TYPE kvbm_host_cache_hit_rate gauge
kvbm_host_cache_hit_rate 2.5
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_sum{engine="0"} -1
vllm:e2e_request_latency_seconds_count{engine="0"} 4
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} 4
# TYPE not_read_by_kvwatch gauge
not_read_by_kvwatch -Inf
""" % ("0" * 400)


def test_hostile_values_are_rejected_per_sample_and_counted() -> None:
    """Every number kvwatch reads must be finite, >= 0, below 2^63 (a ratio at most 1, a bucket
    bound and a block count numbers): the others are dropped sample by sample, counted by reason,
    and the rest of the page counts. Samples kvwatch does not read are none of its business."""
    s = parse_exposition(HOSTILE_PAGE, at=1.0)
    assert dict(s.rejected) == {
        "infinite": 2,
        "above_one": 2,
        "negative": 2,
        "nan": 1,
        "too_large": 2,
        "bad_label": 2,
    }
    assert (s.usage, s.preemptions, s.prefix_queries, s.prefix_hits) == (None, None, None, None)
    assert (s.offload_store_bytes, s.generation_tokens, s.pool_blocks) == (None, None, None)
    assert s.running == 4 and (s.idle_evict_samples, s.idle_evict_young) == (5, 3)
    assert s.tiers == () and s.latencies == ()  # the hit rate above 1; a latency sum without its pair


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.txt")))
def test_real_pages_reject_nothing(name: str) -> None:
    assert parse_exposition((FIXTURES / name).read_text(), at=0.0).rejected == {}


def test_a_parse_error_names_its_line_and_kind_never_the_text() -> None:
    page = '# TYPE a gauge\na 1\n\nb{token="sk-live-42" x} 1\n'
    with pytest.raises(PageError) as err:
        parse_exposition(page, at=0.0)
    assert (err.value.line, err.value.kind, str(err.value)) == (4, "labels", "line 4: labels")
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_a_page_that_outlasts_its_deadline_stops_being_read() -> None:
    """The parse is part of the scrape's deadline: a page too large to read in time stops at the
    deadline (checked every few thousand lines), whatever shape its families have."""
    ticks = iter(range(10**6))
    page = "# TYPE vllm:num_requests_running gauge\n" + 'vllm:num_requests_running{engine="0"} 1\n' * 50_000
    with pytest.raises(DeadlineExceeded):
        parse_exposition(page, at=0.0, deadline=3.0, clock=lambda: float(next(ticks)))
    assert next(ticks) < 30  # a few checks, not one per line
