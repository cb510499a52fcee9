"""Engines' own latency histograms, read from the same ``/metrics`` scrape as their KV numbers:
each one's cumulative ``_sum`` (seconds) and ``_count``, summed over every label set (model,
data-parallel engine, LMCache worker), so a mean over any span is Δsum / Δcount.

``kvwatch record`` draws them beside its alerts (the ``engine latency`` lane): when reclaim
evicts a KV tier, the engine's time to first token and LMCache's retrieve time are where
the loss shows. Names as vLLM (its real 0.26.0 page: tests/fixtures/engine_metrics/vllm-0.26.0.txt),
SGLang (``sglang/srt/observability/metrics_collector.py``), LMCache in process
(``lmcache/observability.py``, exported on vLLM's /metrics) and vLLM's NixlConnector
(``vllm/distributed/kv_transfer/kv_connector/v1/nixl``: observed on the decode side, one per
KV transfer, beside kvwatch's own transfer slices) declare them; all in seconds.
What an engine does not export is absent, never zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvwatch.daemon.model.engines import LatencyReading


@dataclass(frozen=True, slots=True)
class Rule:
    name: str  # the reading's name, one of LATENCY_NAMES
    histogram: str  # the engine's histogram; its samples are <histogram>_sum and <histogram>_count


RULES = (
    Rule("ttft", "vllm:time_to_first_token_seconds"),
    Rule("e2e", "vllm:e2e_request_latency_seconds"),
    Rule("ttft", "sglang:time_to_first_token_seconds"),
    Rule("e2e", "sglang:e2e_request_latency_seconds"),
    Rule("lmcache_retrieve", "lmcache:time_to_retrieve"),
    Rule("lmcache_store", "lmcache:time_to_store"),
    Rule("nixl_xfer", "vllm:nixl_xfer_time_seconds"),
    Rule("nixl_post", "vllm:nixl_post_time_seconds"),
)
_SUM = {f"{r.histogram}_sum": r for r in RULES}
_COUNT = {f"{r.histogram}_count": r for r in RULES}

Sample = tuple[str, Mapping[str, str], float]


def wanted(name: str) -> bool:
    return name in _SUM or name in _COUNT


def read_latencies(samples: Iterable[Sample]) -> tuple[LatencyReading, ...]:
    """Per reading, the sums and counts of every histogram it has on the page; a histogram
    counts only with both its sum and its count (two engines' histograms of one name add up)."""
    sums: dict[Rule, float] = {}
    counts: dict[Rule, float] = {}
    for name, _, value in samples:
        if name in _SUM:
            rule = _SUM[name]
            sums[rule] = sums.get(rule, 0.0) + value
        elif name in _COUNT:
            rule = _COUNT[name]
            counts[rule] = counts.get(rule, 0.0) + value
    out: dict[str, tuple[float, float]] = {}
    for rule in RULES:
        if rule in sums and rule in counts:
            s, c = out.get(rule.name, (0.0, 0.0))
            out[rule.name] = (s + sums[rule], c + counts[rule])
    return tuple(LatencyReading(n, s, c) for n, (s, c) in out.items())
