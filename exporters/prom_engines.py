"""Prometheus families of the engine taps: KV event streams, engine /metrics scrapes, and the
engine's own counters re-exported as its last scrape read them."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from kvwatch.daemon.model.engines import (
    REGRET_BUCKETS,
    EngineSample,
    EngineView,
    MediumTotals,
    StreamStats,
    TargetState,
)
from kvwatch.daemon.model.snapshot import Snapshot
from kvwatch.exporters.labels import PROCESS_LABELS, label_values
from kvwatch.exporters.prom_aggregates import cache_resets

# per KV event stream: StreamStats attribute, metric name, help
STREAM_COUNTERS = (
    ("batches", "kvwatch_kv_event_batches", "KV event batches decoded"),
    ("gaps", "kvwatch_kv_event_gaps", "sequence gaps seen (batches missed)"),
    ("replayed", "kvwatch_kv_event_batches_replayed", "missed batches recovered from the replay endpoint"),
    ("lost", "kvwatch_kv_event_batches_lost", "missed batches not recovered"),
    (
        "abandoned",
        "kvwatch_kv_event_batches_abandoned",
        "of the lost, batches given up without asking the replay endpoint: more awaited replay than a "
        "replay buffer holds (10,000, vLLM's default buffer_steps)",
    ),
    ("restarts", "kvwatch_kv_event_publisher_restarts", "the publisher's sequence began again"),
)


def engine_families(s: Snapshot) -> Iterator[Metric]:
    labels = list(PROCESS_LABELS)
    events = _KvEventFamilies(labels)
    scrapes = _ScrapeFamilies(labels)
    reexported = _EngineCounters(labels)
    for p in s.processes:
        e = p.engine
        if e is None:
            continue
        v = label_values(p.labels, PROCESS_LABELS)
        events.add(v, e)
        scrapes.add(v, e)
        if e.scrape is not None and e.scrape.last is not None:
            reexported.add(v, e.scrape.last)
    yield from events.families()
    yield from scrapes.families()
    yield from reexported.families()


class _KvEventFamilies:
    """What the engine's KV event stream says (blocks stored and evicted) and how the stream fares."""

    def __init__(self, labels: list[str]) -> None:
        self.stored = CounterMetricFamily(
            "kvwatch_kv_blocks_stored",
            "KV blocks stored, from the engine's KV event stream",
            labels=[*labels, "medium"],
        )
        self.removed = CounterMetricFamily(
            "kvwatch_kv_blocks_removed",
            "KV blocks evicted, from the engine's KV event stream",
            labels=[*labels, "medium"],
        )
        self.young = CounterMetricFamily(
            "kvwatch_kv_blocks_removed_young",
            "KV blocks evicted within engines.thrash_seconds of being stored (hot blocks)",
            labels=[*labels, "medium"],
        )
        self.announced = CounterMetricFamily(
            "kvwatch_kv_blocks_announced",
            "KV blocks the engine announced again while it held them, as a request's prefix: prefix-cache "
            "hits it reports (vLLM kv_cache_report_mode full), not stores",
            labels=[*labels, "medium"],
        )
        self.regret = _RegretFamilies([*labels, "medium"])
        self.groups = _GroupFamilies(labels)
        self.extras = CounterMetricFamily(
            "kvwatch_kv_blocks_stored_extra_keys",
            "KV blocks stored whose hash carries an extra key: a LoRA adapter (lora), a request's cache "
            "salt (cache_salt, its first block), multimodal inputs, prompt embeddings",
            labels=[*labels, "key"],
        )
        self.resets = CounterMetricFamily(
            "kvwatch_kv_cache_resets", "AllBlocksCleared events (prefix-cache reset, sleep)", labels=labels
        )
        s_labels = [*labels, "endpoint", "dp_rank"]
        self.connected = GaugeMetricFamily(
            "kvwatch_kv_event_stream_connected", "1 while the KV event subscriber is connected", labels=s_labels
        )
        self.per_stream = {attr: CounterMetricFamily(name, doc, labels=s_labels) for attr, name, doc in STREAM_COUNTERS}
        self.bad = CounterMetricFamily(
            "kvwatch_kv_event_decode_errors",
            "messages dropped as malformed or implausible (kind frames, sequence, payload, nesting, timestamp, "
            "block_size, size, internal), events dropped (event) or kept undescribed (field)",
            labels=[*s_labels, "kind"],
        )

    def add(self, v: list[str], e: EngineView) -> None:
        if e.streams:
            horizons = e.regret_horizon
            for medium, m in sorted(e.media.items()):
                self.stored.add_metric([*v, medium], m.stored)
                self.removed.add_metric([*v, medium], m.removed)
                self.young.add_metric([*v, medium], m.removed_young)
                self.announced.add_metric([*v, medium], m.announced)
                self.regret.add([*v, medium], m, e.regret_ratio.get(medium), horizons.get(medium))
            self.resets.add_metric(v, cache_resets(e.streams))
            self.groups.add(v, e)
            for key, n in sorted(e.extras.items()):
                self.extras.add_metric([*v, key], n)
        for x in e.streams:
            self._add_stream([*v, x.spec.endpoint, str(x.spec.dp_rank)], x)

    def _add_stream(self, sv: list[str], x: StreamStats) -> None:
        self.connected.add_metric(sv, 1 if x.connected else 0)
        for attr, fam in self.per_stream.items():
            fam.add_metric(sv, getattr(x, attr))
        for kind, n in sorted(x.decode_errors.items()):
            self.bad.add_metric([*sv, kind], n)

    def families(self) -> Iterator[Metric]:
        yield from (self.stored, self.removed, self.young, self.announced)
        yield from self.regret.families()
        yield from self.groups.families()
        yield self.extras
        yield from (self.resets, self.connected)
        yield from (self.per_stream[a] for a in ("batches", "gaps", "replayed", "lost", "abandoned"))
        yield from (self.bad, self.per_stream["restarts"])


class _GroupFamilies:
    """Per KV cache group (hybrid models): its physical blocks. Only for a medium whose stream
    announced more than one group; a single-group engine's are the medium's own counts."""

    COUNTERS = (
        ("stored", "stored", "KV blocks stored"),
        ("removed", "removed", "KV blocks evicted"),
        ("removed_young", "removed_young", "KV blocks evicted within engines.thrash_seconds of being stored"),
        ("regretted", "regretted", "KV blocks stored again after the engine removed them"),
        ("restored", "restored", "KV blocks stored again while the engine still held them"),
        ("announced", "announced", "KV blocks announced again while held: prefix-cache hits reported"),
    )

    def __init__(self, labels: list[str]) -> None:
        g = [*labels, "medium", "group", "kind"]
        self.counters = {
            attr: CounterMetricFamily(f"kvwatch_kv_group_blocks_{name}", f"{doc}, per KV cache group", labels=g)
            for attr, name, doc in self.COUNTERS
        }
        self.resident = GaugeMetricFamily(
            "kvwatch_kv_group_blocks_resident", "KV blocks held now, per KV cache group", labels=g
        )
        self.info = GaugeMetricFamily(
            "kvwatch_kv_cache_group_info",
            "a KV cache group the engine announced: its attention kind, its sliding window in tokens, "
            "whether the medium's logical counts follow it (reference), where the medium lives (locality)",
            labels=[*g, "sliding_window", "reference", "locality"],
        )

    def add(self, v: list[str], e: EngineView) -> None:
        groups = e.groups
        per_medium: dict[str, int] = {}
        for g in groups:
            per_medium[g.medium] = per_medium.get(g.medium, 0) + 1
        localities = e.localities
        for g in groups:
            gv = [*v, g.medium, str(g.group), g.kind or "unknown"]
            if g.kind:
                window = str(g.sliding_window or "")
                ref = "true" if g.reference else "false"
                self.info.add_metric([*gv, window, ref, localities.get(g.medium, "")], 1)
            if per_medium[g.medium] < 2:
                continue
            for attr, fam in self.counters.items():
                fam.add_metric(gv, getattr(g.totals, attr))
            self.resident.add_metric(gv, g.totals.resident)

    def families(self) -> Iterator[Metric]:
        yield from self.counters.values()
        yield from (self.resident, self.info)


class _RegretFamilies:
    """Evictions the engine regretted: removed blocks it stored again, from its KV event stream."""

    def __init__(self, labels: list[str]) -> None:
        self.blocks = CounterMetricFamily(
            "kvwatch_kv_blocks_regretted",
            "KV blocks stored again after the engine removed them (a removal within "
            "kvwatch_kv_regret_horizon_seconds): evictions the engine regretted",
            labels=labels,
        )
        self.restored = CounterMetricFamily(
            "kvwatch_kv_blocks_restored",
            "KV blocks stored again while the engine still held them: prefixes its cache did not serve",
            labels=labels,
        )
        self.tokens = CounterMetricFamily(
            "kvwatch_kv_regret_recomputed_tokens",
            "tokens of the regretted blocks (block_size each): what their eviction made the engine compute again",
            labels=labels,
        )
        self.seconds = HistogramMetricFamily(
            "kvwatch_kv_regret_seconds", "time from a regretted block's removal to its store again", labels=labels
        )
        self.horizon = GaugeMetricFamily(
            "kvwatch_kv_regret_horizon_seconds",
            "seconds of removals remembered now, back from the stream's last batch (the shortest of its "
            "data-parallel ranks'): a block stored again after longer than this may be a regret not counted",
            labels=labels,
        )
        self.ratio = GaugeMetricFamily(
            "kvwatch_kv_regret_ratio",
            "regretted over removed KV blocks, over the KVEvictionBurst window (absent without removals)",
            labels=labels,
        )

    def add(self, v: list[str], m: MediumTotals, ratio: float | None, horizon: float | None) -> None:
        self.blocks.add_metric(v, m.regretted)
        self.restored.add_metric(v, m.restored)
        self.tokens.add_metric(v, m.regret_tokens)
        cumulative, buckets = 0, []
        for le, n in zip((*map(str, REGRET_BUCKETS), "+Inf"), m.regret_buckets, strict=True):
            cumulative += n
            buckets.append((le, cumulative))
        self.seconds.add_metric(v, buckets, m.regret_seconds)
        if ratio is not None:
            self.ratio.add_metric(v, ratio)
        if horizon is not None:
            self.horizon.add_metric(v, horizon)

    def families(self) -> Iterator[Metric]:
        yield from (self.blocks, self.restored, self.tokens, self.seconds, self.horizon, self.ratio)


class _ScrapeFamilies:
    """How the engine's /metrics scrapes fare, and the KV usage and hit ratio read from them."""

    def __init__(self, labels: list[str]) -> None:
        self.scrapes = CounterMetricFamily(
            "kvwatch_engine_scrapes",
            "scrapes of the engine's /metrics by result (ok, deadline, connect, redirect, http_NNN, protocol, "
            "tls, too_large, parse, url, other)",
            labels=[*labels, "result"],
        )
        self.rejected = CounterMetricFamily(
            "kvwatch_engine_samples_rejected",
            "samples of the engine's /metrics that kvwatch reads, dropped from pages that counted, by reason "
            "(nan, infinite, negative, too_large, above_one, bad_label)",
            labels=[*labels, "reason"],
        )
        self.refused = GaugeMetricFamily(
            "kvwatch_engine_taps_refused",
            "taps the engine's command line asked for that kvwatch refused, by reason (metrics_host: not the "
            "engine's own address; metrics_port; kv_event_streams: data-parallel ranks past 256; "
            "kv_event_endpoint: a port out of range, a path outside the engine's root)",
            labels=[*labels, "reason"],
        )
        self.usage = GaugeMetricFamily(
            "kvwatch_engine_kv_usage_ratio", "KV pool usage the engine reports (0..1)", labels=labels
        )
        self.hit = GaugeMetricFamily(
            "kvwatch_engine_prefix_cache_hit_ratio",
            "prefix-cache hits over queried tokens, over the detector window",
            labels=labels,
        )

    def add(self, v: list[str], e: EngineView) -> None:
        if e.scrape is not None:
            self._add_scrape(v, e.scrape)
        if e.hit_ratio is not None:
            self.hit.add_metric(v, e.hit_ratio)
        for reason, n in sorted(e.plan.refused.items()):
            self.refused.add_metric([*v, reason], n)

    def _add_scrape(self, v: list[str], scrape: TargetState) -> None:
        self.scrapes.add_metric([*v, "ok"], scrape.ok)
        for reason, n in sorted(scrape.failures.items()):
            self.scrapes.add_metric([*v, reason], n)
        for reason, n in sorted(scrape.rejected.items()):
            self.rejected.add_metric([*v, reason], n)
        if scrape.last is not None and scrape.last.usage is not None:
            self.usage.add_metric(v, scrape.last.usage)

    def families(self) -> Iterator[Metric]:
        yield from (self.scrapes, self.rejected, self.refused, self.usage, self.hit)


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
        self.generated = CounterMetricFamily(
            "kvwatch_engine_generation_tokens",
            "tokens the engine generated (vLLM / SGLang generation_tokens)",
            labels=labels,
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
        if x.generation_tokens is not None:
            self.generated.add_metric(v, x.generation_tokens)
        for direction, b in (("d2h", x.offload_store_bytes), ("h2d", x.offload_load_bytes)):
            if b is not None:
                self.offload.add_metric([*v, direction], b)
        if x.sleeping is not None:
            self.sleeping.add_metric(v, 1.0 if x.sleeping else 0.0)

    def families(self) -> Iterator[Metric]:
        yield from (self.queried, self.hit, self.preemptions, self.generated, self.offload, self.sleeping)
