"""Prometheus families of the engines' KV tiers in one schema (``engines/tiers.py``): what each
tier stored, loaded and evicted as the engine counts it, its hit and usage ratios. Bytes where the
engine counts bytes (or blocks with a configured block size); other units as the engine counts them."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from kvwatch.daemon.model.snapshot import ProcessView, Snapshot
from kvwatch.exporters.labels import PROCESS_LABELS, label_values
from kvwatch.exporters.metric_specs import COUNTER, GAUGE, Metrics, MetricSpec

METRICS = Metrics(
    (
        MetricSpec(
            "kvwatch_engine_kv_tier_stored_bytes",
            COUNTER,
            (
                "KV bytes the engine says its tier stored (tier cpu, disk, remote, storage); source: "
                "whose metric names (vllm, lmcache, lmcache_mp, sglang, kvbm)"
            ),
            (*PROCESS_LABELS, "tier", "source"),
        ),
        MetricSpec(
            "kvwatch_engine_kv_tier_loaded_bytes",
            COUNTER,
            (
                "KV bytes the engine says its tier loaded (tier cpu, disk, remote, storage); source: "
                "whose metric names (vllm, lmcache, lmcache_mp, sglang, kvbm)"
            ),
            (*PROCESS_LABELS, "tier", "source"),
        ),
        MetricSpec(
            "kvwatch_engine_kv_tier_evicted_bytes",
            COUNTER,
            (
                "KV bytes the engine says its tier evicted (tier cpu, disk, remote, storage); source:"
                " whose metric names (vllm, lmcache, lmcache_mp, sglang, kvbm)"
            ),
            (*PROCESS_LABELS, "tier", "source"),
        ),
        MetricSpec(
            "kvwatch_engine_kv_tier_stored_units",
            COUNTER,
            (
                "KV the engine says its tier stored, in the engine's own unit (blocks, chunks, "
                "tokens); source: whose metric names (vllm, lmcache, lmcache_mp, sglang, kvbm)"
            ),
            (*PROCESS_LABELS, "tier", "source", "unit"),
        ),
        MetricSpec(
            "kvwatch_engine_kv_tier_loaded_units",
            COUNTER,
            (
                "KV the engine says its tier loaded, in the engine's own unit (blocks, chunks, "
                "tokens); source: whose metric names (vllm, lmcache, lmcache_mp, sglang, kvbm)"
            ),
            (*PROCESS_LABELS, "tier", "source", "unit"),
        ),
        MetricSpec(
            "kvwatch_engine_kv_tier_evicted_units",
            COUNTER,
            (
                "KV the engine says its tier evicted, in the engine's own unit (blocks, chunks, "
                "tokens); source: whose metric names (vllm, lmcache, lmcache_mp, sglang, kvbm)"
            ),
            (*PROCESS_LABELS, "tier", "source", "unit"),
        ),
        MetricSpec(
            "kvwatch_engine_kv_tier_queried_tokens",
            COUNTER,
            "tokens looked up in the tier; source: whose metric names (vllm, lmcache, lmcache_mp, sglang, kvbm)",
            (*PROCESS_LABELS, "tier", "source"),
        ),
        MetricSpec(
            "kvwatch_engine_kv_tier_hit_tokens",
            COUNTER,
            (
                "of those, tokens found in the tier; source: whose metric names (vllm, lmcache, "
                "lmcache_mp, sglang, kvbm)"
            ),
            (*PROCESS_LABELS, "tier", "source"),
        ),
        MetricSpec(
            "kvwatch_engine_kv_tier_hit_ratio",
            GAUGE,
            (
                "tokens found over tokens looked up in the tier over the rate window, or the engine's"
                " own ratio where it exports only that (Dynamo KVBM); source: whose metric names "
                "(vllm, lmcache, lmcache_mp, sglang, kvbm)"
            ),
            (*PROCESS_LABELS, "tier", "source"),
        ),
        MetricSpec(
            "kvwatch_engine_kv_tier_usage_ratio",
            GAUGE,
            (
                "share of the tier's capacity in use, 0..1; source: whose metric names (vllm, "
                "lmcache, lmcache_mp, sglang, kvbm)"
            ),
            (*PROCESS_LABELS, "tier", "source"),
        ),
        MetricSpec(
            "kvwatch_engine_kv_tier_used_bytes",
            GAUGE,
            "bytes the tier holds; source: whose metric names (vllm, lmcache, lmcache_mp, sglang, kvbm)",
            (*PROCESS_LABELS, "tier", "source"),
        ),
    )
)

MOVES = ("stored", "loaded", "evicted")


class _Families:
    def __init__(self) -> None:
        self.bytes = {m: METRICS.counter(f"kvwatch_engine_kv_tier_{m}_bytes") for m in MOVES}
        self.units = {m: METRICS.counter(f"kvwatch_engine_kv_tier_{m}_units") for m in MOVES}
        self.queried = METRICS.counter("kvwatch_engine_kv_tier_queried_tokens")
        self.hit = METRICS.counter("kvwatch_engine_kv_tier_hit_tokens")
        self.hit_ratio = METRICS.gauge("kvwatch_engine_kv_tier_hit_ratio")
        self.usage = METRICS.gauge("kvwatch_engine_kv_tier_usage_ratio")
        self.used = METRICS.gauge("kvwatch_engine_kv_tier_used_bytes")

    def add(self, p: ProcessView) -> None:
        e = p.engine
        if e is None:
            return
        v = label_values(p.labels, PROCESS_LABELS)
        size = e.block_bytes if e.block_bytes_source == "config" else None  # an operator's size, not learnt
        for r in e.tiers:
            lv = [*v, r.tier, r.source]
            if r.quantity in MOVES:
                if r.unit == "bytes":
                    self.bytes[r.quantity].add_metric(lv, r.value)
                    continue
                self.units[r.quantity].add_metric([*lv, r.unit], r.value)
                if r.unit == "blocks" and size:
                    self.bytes[r.quantity].add_metric(lv, r.value * size)
            elif r.quantity == "queried":
                self.queried.add_metric(lv, r.value)
            elif r.quantity == "hit":
                self.hit.add_metric(lv, r.value)
            elif r.quantity == "usage":
                self.usage.add_metric(lv, r.value)
            elif r.quantity == "used":
                self.used.add_metric(lv, r.value)
        for (source, tier), ratio in sorted(e.tier_hit_ratio.items()):
            self.hit_ratio.add_metric([*v, tier, source], ratio)

    def all(self) -> Iterator[Metric]:
        yield from self.bytes.values()
        yield from self.units.values()
        yield from (self.queried, self.hit, self.hit_ratio, self.usage, self.used)


def tier_families(s: Snapshot) -> Iterator[Metric]:
    f = _Families()
    for p in s.processes:
        f.add(p)
    yield from f.all()
