"""Prometheus families of the engines' KV tiers in one schema (``engines/tiers.py``): what each
tier stored, loaded and evicted as the engine counts it, its hit and usage ratios. Bytes where the
engine counts bytes (or blocks with a configured block size); other units as the engine counts them."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvwatch.daemon.model.snapshot import ProcessView, Snapshot
from kvwatch.exporters.labels import PROCESS_LABELS, label_values

MOVES = ("stored", "loaded", "evicted")
SOURCES = "source: whose metric names (vllm, lmcache, lmcache_mp, sglang, kvbm)"


class _Families:
    def __init__(self) -> None:
        labels = [*PROCESS_LABELS, "tier", "source"]
        self.bytes = {
            m: CounterMetricFamily(
                f"kvwatch_engine_kv_tier_{m}_bytes",
                f"KV bytes the engine says its tier {m} (tier cpu, disk, remote, storage); {SOURCES}",
                labels=labels,
            )
            for m in MOVES
        }
        self.units = {
            m: CounterMetricFamily(
                f"kvwatch_engine_kv_tier_{m}_units",
                f"KV the engine says its tier {m}, in the engine's own unit (blocks, chunks, tokens); {SOURCES}",
                labels=[*labels, "unit"],
            )
            for m in MOVES
        }
        self.queried = CounterMetricFamily(
            "kvwatch_engine_kv_tier_queried_tokens", f"tokens looked up in the tier; {SOURCES}", labels=labels
        )
        self.hit = CounterMetricFamily(
            "kvwatch_engine_kv_tier_hit_tokens", f"of those, tokens found in the tier; {SOURCES}", labels=labels
        )
        self.hit_ratio = GaugeMetricFamily(
            "kvwatch_engine_kv_tier_hit_ratio",
            "tokens found over tokens looked up in the tier over the rate window, or the engine's own ratio "
            f"where it exports only that (Dynamo KVBM); {SOURCES}",
            labels=labels,
        )
        self.usage = GaugeMetricFamily(
            "kvwatch_engine_kv_tier_usage_ratio", f"share of the tier's capacity in use, 0..1; {SOURCES}", labels=labels
        )
        self.used = GaugeMetricFamily(
            "kvwatch_engine_kv_tier_used_bytes", f"bytes the tier holds; {SOURCES}", labels=labels
        )

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
