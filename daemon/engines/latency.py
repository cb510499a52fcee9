"""Engines' own latency histograms, read from the same ``/metrics`` scrape as their KV numbers:
each one's cumulative ``_sum`` (seconds) and ``_count``, summed over every label set (model,
data-parallel engine, LMCache worker), so a mean over any span is Δsum / Δcount.

``kvwatch record`` draws them beside its alerts (the ``engine latency`` lane): when reclaim
evicts a KV tier, the engine's time to first token and LMCache's retrieve time are where
the loss shows. Each engine's histograms are in its module (``kinds/``): names as vLLM (its real
0.26.0 page: tests/fixtures/engine_metrics/vllm-0.26.0.txt), SGLang
(``sglang/srt/observability/metrics_collector.py``), LMCache in process
(``lmcache/observability.py``, exported on vLLM's /metrics) and vLLM's NixlConnector
(``vllm/distributed/kv_transfer/kv_connector/v1/nixl``: observed on the decode side, one per
KV transfer, beside kvwatch's own transfer slices) declare them; all in seconds. Readings come
in LATENCY_NAMES' order.
What an engine does not export is absent, never zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvwatch.daemon.engines.kind import LatencyRule
from kvwatch.daemon.engines.kinds import KINDS
from kvwatch.daemon.model.engines import LATENCY_NAMES, LatencyReading

RULES: tuple[LatencyRule, ...] = tuple(r for k in KINDS for r in k.latencies)  # each engine's, in its module
_SUM = {f"{r.histogram}_sum": r for r in RULES}
_COUNT = {f"{r.histogram}_count": r for r in RULES}

Sample = tuple[str, Mapping[str, str], float]


def wanted(name: str) -> bool:
    return name in _SUM or name in _COUNT


def read_latencies(samples: Iterable[Sample]) -> tuple[LatencyReading, ...]:
    """Per reading, the sums and counts of every histogram it has on the page; a histogram
    counts only with both its sum and its count (two engines' histograms of one name add up)."""
    sums: dict[LatencyRule, float] = {}
    counts: dict[LatencyRule, float] = {}
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
    return tuple(LatencyReading(n, *out[n]) for n in LATENCY_NAMES if n in out)
