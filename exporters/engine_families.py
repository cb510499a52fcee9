"""Prometheus families of the engine taps: KV event streams, engine /metrics scrapes, and the
engine's own counters re-exported as its last scrape read them."""

from __future__ import annotations

from collections.abc import Iterator

from kvwatch.daemon.engines.records import EngineSample
from kvwatch.daemon.snapshot import Snapshot
from kvwatch.exporters.labels import PROCESS_LABELS, label_values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# per KV event stream: StreamStats attribute, metric name, help
STREAM_COUNTERS = (
    ("batches", "kvwatch_kv_event_batches", "KV event batches decoded"),
    ("gaps", "kvwatch_kv_event_gaps", "sequence gaps seen (batches missed)"),
    ("replayed", "kvwatch_kv_event_batches_replayed", "missed batches recovered from the replay endpoint"),
    ("lost", "kvwatch_kv_event_batches_lost", "missed batches not recovered"),
    ("restarts", "kvwatch_kv_event_publisher_restarts", "the publisher's sequence began again"),
)


def engine_families(s: Snapshot) -> Iterator[Metric]:
    labels = list(PROCESS_LABELS)
    stored = CounterMetricFamily(
        "kvwatch_kv_blocks_stored",
        "KV blocks stored, from the engine's KV event stream",
        labels=[*labels, "medium"],
    )
    removed = CounterMetricFamily(
        "kvwatch_kv_blocks_removed",
        "KV blocks evicted, from the engine's KV event stream",
        labels=[*labels, "medium"],
    )
    young = CounterMetricFamily(
        "kvwatch_kv_blocks_removed_young",
        "KV blocks evicted within engines.thrash_seconds of being stored (hot blocks)",
        labels=[*labels, "medium"],
    )
    resets = CounterMetricFamily(
        "kvwatch_kv_cache_resets", "AllBlocksCleared events (prefix-cache reset, sleep)", labels=labels
    )
    s_labels = [*labels, "endpoint", "dp_rank"]
    connected = GaugeMetricFamily(
        "kvwatch_kv_event_stream_connected", "1 while the KV event subscriber is connected", labels=s_labels
    )
    per_stream = {attr: CounterMetricFamily(name, doc, labels=s_labels) for attr, name, doc in STREAM_COUNTERS}
    bad = CounterMetricFamily(
        "kvwatch_kv_event_decode_errors",
        "messages (kind frames, sequence, payload) or events (kind event) dropped as malformed",
        labels=[*s_labels, "kind"],
    )
    scrapes = CounterMetricFamily(
        "kvwatch_engine_scrapes",
        "scrapes of the engine's /metrics by result (ok, timeout, connect, http_NNN, parse)",
        labels=[*labels, "result"],
    )
    usage = GaugeMetricFamily("kvwatch_engine_kv_usage_ratio", "KV pool usage the engine reports (0..1)", labels=labels)
    hit = GaugeMetricFamily(
        "kvwatch_engine_prefix_cache_hit_ratio",
        "prefix-cache hits over queried tokens, over the detector window",
        labels=labels,
    )
    reexported = _EngineCounters(labels)
    for p in s.processes:
        e = p.engine
        if e is None:
            continue
        v = label_values(p.labels, PROCESS_LABELS)
        if e.streams:
            for medium, (a, b, c) in sorted(e.media.items()):
                stored.add_metric([*v, medium], a)
                removed.add_metric([*v, medium], b)
                young.add_metric([*v, medium], c)
            resets.add_metric(v, sum(x.cleared for x in e.streams))
        for x in e.streams:
            sv = [*v, x.spec.endpoint, str(x.spec.dp_rank)]
            connected.add_metric(sv, 1 if x.connected else 0)
            for attr, fam in per_stream.items():
                fam.add_metric(sv, getattr(x, attr))
            for kind, n in sorted(x.decode_errors.items()):
                bad.add_metric([*sv, kind], n)
        if e.scrape is not None:
            scrapes.add_metric([*v, "ok"], e.scrape.ok)
            for reason, n in sorted(e.scrape.failures.items()):
                scrapes.add_metric([*v, reason], n)
            sample = e.scrape.last
            if sample is not None and sample.usage is not None:
                usage.add_metric(v, sample.usage)
            if sample is not None:
                reexported.add(v, sample)
        if e.hit_ratio is not None:
            hit.add_metric(v, e.hit_ratio)
    yield from (stored, removed, young, resets, connected)
    yield from (per_stream[a] for a in ("batches", "gaps", "replayed", "lost"))
    yield from (bad, per_stream["restarts"])
    yield from (scrapes, usage, hit)
    yield from reexported.families()


class _EngineCounters:
    """The engine's own counters its alerts join with, as its last scrape read them."""

    def __init__(self, labels: list[str]) -> None:
        self.queried = CounterMetricFamily(
            "kvwatch_engine_prefix_cache_queried_tokens",
            "tokens the engine looked up in its prefix cache (medium GPU) or its KV connector's tier (CPU)",
            labels=[*labels, "medium"],
        )
        self.hit = CounterMetricFamily(
            "kvwatch_engine_prefix_cache_hit_tokens",
            "of those, tokens found (vLLM prefix_cache_hits / external_prefix_cache_hits)",
            labels=[*labels, "medium"],
        )
        self.preemptions = CounterMetricFamily(
            "kvwatch_engine_preemptions", "requests the engine preempted (vLLM num_preemptions)", labels=labels
        )
        self.offload = CounterMetricFamily(
            "kvwatch_engine_kv_offload_bytes",
            "KV bytes the engine reports copying to its CPU tier (d2h) and back (h2d): vLLM kv_offload_*_bytes",
            labels=[*labels, "direction"],
        )
        self.sleeping = GaugeMetricFamily(
            "kvwatch_engine_sleeping", "1 while the engine reports sleep mode (KV pool released)", labels=labels
        )

    def add(self, v: list[str], x: EngineSample) -> None:
        for medium, q, h in (("GPU", x.prefix_queries, x.prefix_hits), ("CPU", x.external_queries, x.external_hits)):
            if q is not None:
                self.queried.add_metric([*v, medium], q)
            if h is not None:
                self.hit.add_metric([*v, medium], h)
        if x.preemptions is not None:
            self.preemptions.add_metric(v, x.preemptions)
        for direction, b in (("d2h", x.offload_store_bytes), ("h2d", x.offload_load_bytes)):
            if b is not None:
                self.offload.add_metric([*v, direction], b)
        if x.sleeping is not None:
            self.sleeping.add_metric(v, 1.0 if x.sleeping else 0.0)

    def families(self) -> Iterator[Metric]:
        yield from (self.queried, self.hit, self.preemptions, self.offload, self.sleeping)
