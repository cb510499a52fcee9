"""The engine /metrics reader against each engine's exposition, served over HTTP on loopback.

Fixtures: ``tests/fixtures/engine_metrics`` (``tests/tools/engine_metrics_fixtures.py``
writes them with prometheus-client and each engine's own metric declarations).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kvwatch.daemon.engines.metrics import parse_exposition
from kvwatch.daemon.engines.taps import sample_series

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
