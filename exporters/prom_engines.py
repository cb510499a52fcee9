"""Prometheus families of the engine taps: KV event streams, engine /metrics scrapes, and the
engine's own counters re-exported as its last scrape read them."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

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
from kvwatch.exporters.metric_specs import COUNTER, GAUGE, HISTOGRAM, Metrics, MetricSpec
from kvwatch.exporters.prom_aggregates import cache_resets

METRICS = Metrics(
    (
        MetricSpec(
            "kvwatch_kv_blocks_stored",
            COUNTER,
            "KV blocks stored, from the engine's KV event stream",
            (*PROCESS_LABELS, "medium"),
        ),
        MetricSpec(
            "kvwatch_kv_blocks_removed",
            COUNTER,
            "KV blocks evicted, from the engine's KV event stream",
            (*PROCESS_LABELS, "medium"),
        ),
        MetricSpec(
            "kvwatch_kv_blocks_removed_young",
            COUNTER,
            "KV blocks evicted within engines.thrash_seconds of being stored (hot blocks)",
            (*PROCESS_LABELS, "medium"),
        ),
        MetricSpec(
            "kvwatch_kv_blocks_announced",
            COUNTER,
            (
                "KV blocks the engine announced again while it held them, as a request's prefix: "
                "prefix-cache hits it reports (vLLM kv_cache_report_mode full), not stores"
            ),
            (*PROCESS_LABELS, "medium"),
        ),
        MetricSpec(
            "kvwatch_kv_blocks_regretted",
            COUNTER,
            (
                "KV blocks stored again after the engine removed them (a removal within "
                "kvwatch_kv_regret_horizon_seconds): evictions the engine regretted"
            ),
            (*PROCESS_LABELS, "medium"),
        ),
        MetricSpec(
            "kvwatch_kv_blocks_restored",
            COUNTER,
            "KV blocks stored again while the engine still held them: prefixes its cache did not serve",
            (*PROCESS_LABELS, "medium"),
        ),
        MetricSpec(
            "kvwatch_kv_regret_recomputed_tokens",
            COUNTER,
            "tokens of the regretted blocks (block_size each): what their eviction made the engine compute again",
            (*PROCESS_LABELS, "medium"),
        ),
        MetricSpec(
            "kvwatch_kv_regret_seconds",
            HISTOGRAM,
            "time from a regretted block's removal to its store again",
            (*PROCESS_LABELS, "medium"),
        ),
        MetricSpec(
            "kvwatch_kv_regret_horizon_seconds",
            GAUGE,
            (
                "seconds of removals remembered now, back from the stream's last batch (the shortest "
                "of its data-parallel ranks'): a block stored again after longer than this may be a "
                "regret not counted"
            ),
            (*PROCESS_LABELS, "medium"),
        ),
        MetricSpec(
            "kvwatch_kv_regret_ratio",
            GAUGE,
            "regretted over removed KV blocks, over the KVEvictionBurst window (absent without removals)",
            (*PROCESS_LABELS, "medium"),
        ),
        MetricSpec(
            "kvwatch_kv_group_blocks_stored",
            COUNTER,
            "KV blocks stored, per KV cache group",
            (*PROCESS_LABELS, "medium", "group", "kind"),
        ),
        MetricSpec(
            "kvwatch_kv_group_blocks_removed",
            COUNTER,
            "KV blocks evicted, per KV cache group",
            (*PROCESS_LABELS, "medium", "group", "kind"),
        ),
        MetricSpec(
            "kvwatch_kv_group_blocks_removed_young",
            COUNTER,
            "KV blocks evicted within engines.thrash_seconds of being stored, per KV cache group",
            (*PROCESS_LABELS, "medium", "group", "kind"),
        ),
        MetricSpec(
            "kvwatch_kv_group_blocks_regretted",
            COUNTER,
            "KV blocks stored again after the engine removed them, per KV cache group",
            (*PROCESS_LABELS, "medium", "group", "kind"),
        ),
        MetricSpec(
            "kvwatch_kv_group_blocks_restored",
            COUNTER,
            "KV blocks stored again while the engine still held them, per KV cache group",
            (*PROCESS_LABELS, "medium", "group", "kind"),
        ),
        MetricSpec(
            "kvwatch_kv_group_blocks_announced",
            COUNTER,
            "KV blocks announced again while held: prefix-cache hits reported, per KV cache group",
            (*PROCESS_LABELS, "medium", "group", "kind"),
        ),
        MetricSpec(
            "kvwatch_kv_group_blocks_resident",
            GAUGE,
            "KV blocks held now, per KV cache group",
            (*PROCESS_LABELS, "medium", "group", "kind"),
        ),
        MetricSpec(
            "kvwatch_kv_cache_group_info",
            GAUGE,
            (
                "a KV cache group the engine announced: its attention kind, its sliding window in "
                "tokens, whether the medium's logical counts follow it (reference), where the medium "
                "lives (locality)"
            ),
            (*PROCESS_LABELS, "medium", "group", "kind", "sliding_window", "reference", "locality"),
        ),
        MetricSpec(
            "kvwatch_kv_blocks_stored_extra_keys",
            COUNTER,
            (
                "KV blocks stored whose hash carries an extra key: a LoRA adapter (lora), a request's"
                " cache salt (cache_salt, its first block), multimodal inputs, prompt embeddings"
            ),
            (*PROCESS_LABELS, "key"),
        ),
        MetricSpec(
            "kvwatch_kv_cache_resets", COUNTER, "AllBlocksCleared events (prefix-cache reset, sleep)", PROCESS_LABELS
        ),
        MetricSpec(
            "kvwatch_kv_event_stream_connected",
            GAUGE,
            "1 while the KV event subscriber is connected",
            (*PROCESS_LABELS, "endpoint", "dp_rank"),
        ),
        MetricSpec(
            "kvwatch_kv_event_batches", COUNTER, "KV event batches decoded", (*PROCESS_LABELS, "endpoint", "dp_rank")
        ),
        MetricSpec(
            "kvwatch_kv_event_gaps",
            COUNTER,
            "sequence gaps seen (batches missed)",
            (*PROCESS_LABELS, "endpoint", "dp_rank"),
        ),
        MetricSpec(
            "kvwatch_kv_event_batches_replayed",
            COUNTER,
            "missed batches recovered from the replay endpoint",
            (*PROCESS_LABELS, "endpoint", "dp_rank"),
        ),
        MetricSpec(
            "kvwatch_kv_event_batches_lost",
            COUNTER,
            "missed batches not recovered",
            (*PROCESS_LABELS, "endpoint", "dp_rank"),
        ),
        MetricSpec(
            "kvwatch_kv_event_batches_abandoned",
            COUNTER,
            (
                "of the lost, batches given up without asking the replay endpoint: more awaited "
                "replay than a replay buffer holds (10,000, vLLM's default buffer_steps)"
            ),
            (*PROCESS_LABELS, "endpoint", "dp_rank"),
        ),
        MetricSpec(
            "kvwatch_kv_event_publisher_restarts",
            COUNTER,
            "the publisher's sequence began again",
            (*PROCESS_LABELS, "endpoint", "dp_rank"),
        ),
        MetricSpec(
            "kvwatch_kv_event_decode_errors",
            COUNTER,
            (
                "messages dropped as malformed or implausible (kind frames, sequence, payload, "
                "nesting, timestamp, block_size, size, internal), events dropped (event) or kept "
                "undescribed (field)"
            ),
            (*PROCESS_LABELS, "endpoint", "dp_rank", "kind"),
        ),
        MetricSpec(
            "kvwatch_engine_scrapes",
            COUNTER,
            (
                "scrapes of the engine's /metrics by result (ok, deadline, connect, redirect, "
                "http_NNN, protocol, tls, too_large, parse, url, other)"
            ),
            (*PROCESS_LABELS, "result"),
        ),
        MetricSpec(
            "kvwatch_engine_samples_rejected",
            COUNTER,
            (
                "samples of the engine's /metrics that kvwatch reads, dropped from pages that "
                "counted, by reason (nan, infinite, negative, too_large, above_one, bad_label)"
            ),
            (*PROCESS_LABELS, "reason"),
        ),
        MetricSpec(
            "kvwatch_engine_taps_refused",
            GAUGE,
            (
                "taps the engine's command line asked for that kvwatch refused, by reason "
                "(metrics_host: not the engine's own address; metrics_port; kv_event_streams: "
                "data-parallel ranks past 256; kv_event_endpoint: a port out of range, a path outside"
                " the engine's root)"
            ),
            (*PROCESS_LABELS, "reason"),
        ),
        MetricSpec("kvwatch_engine_kv_usage_ratio", GAUGE, "KV pool usage the engine reports (0..1)", PROCESS_LABELS),
        MetricSpec(
            "kvwatch_engine_prefix_cache_hit_ratio",
            GAUGE,
            "prefix-cache hits over queried tokens, over the detector window",
            PROCESS_LABELS,
        ),
        MetricSpec(
            "kvwatch_engine_prefix_cache_queried_tokens",
            COUNTER,
            "tokens the engine looked up in its prefix cache (medium GPU) or its KV connector's tier (CPU)",
            (*PROCESS_LABELS, "medium"),
        ),
        MetricSpec(
            "kvwatch_engine_prefix_cache_hit_tokens",
            COUNTER,
            "of those, tokens found (vLLM prefix_cache_hits / external_prefix_cache_hits)",
            (*PROCESS_LABELS, "medium"),
        ),
        MetricSpec(
            "kvwatch_engine_preemptions",
            COUNTER,
            "requests the engine preempted (vLLM num_preemptions)",
            PROCESS_LABELS,
        ),
        MetricSpec(
            "kvwatch_engine_generation_tokens",
            COUNTER,
            "tokens the engine generated (vLLM / SGLang generation_tokens)",
            PROCESS_LABELS,
        ),
        MetricSpec(
            "kvwatch_engine_kv_offload_bytes",
            COUNTER,
            "KV bytes the engine reports copying to its CPU tier (d2h) and back (h2d): vLLM kv_offload_*_bytes",
            (*PROCESS_LABELS, "direction"),
        ),
        MetricSpec(
            "kvwatch_engine_sleeping", GAUGE, "1 while the engine reports sleep mode (KV pool released)", PROCESS_LABELS
        ),
    )
)

# per KV event stream: StreamStats attribute, metric name
STREAM_COUNTERS = (
    ("batches", "kvwatch_kv_event_batches"),
    ("gaps", "kvwatch_kv_event_gaps"),
    ("replayed", "kvwatch_kv_event_batches_replayed"),
    ("lost", "kvwatch_kv_event_batches_lost"),
    ("abandoned", "kvwatch_kv_event_batches_abandoned"),
    ("restarts", "kvwatch_kv_event_publisher_restarts"),
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
        self.stored = METRICS.counter("kvwatch_kv_blocks_stored")
        self.removed = METRICS.counter("kvwatch_kv_blocks_removed")
        self.young = METRICS.counter("kvwatch_kv_blocks_removed_young")
        self.announced = METRICS.counter("kvwatch_kv_blocks_announced")
        self.regret = _RegretFamilies([*labels, "medium"])
        self.groups = _GroupFamilies(labels)
        self.extras = METRICS.counter("kvwatch_kv_blocks_stored_extra_keys")
        self.resets = METRICS.counter("kvwatch_kv_cache_resets")
        self.connected = METRICS.gauge("kvwatch_kv_event_stream_connected")
        self.per_stream = {attr: METRICS.counter(name) for attr, name in STREAM_COUNTERS}
        self.bad = METRICS.counter("kvwatch_kv_event_decode_errors")

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

    COUNTERS = ("stored", "removed", "removed_young", "regretted", "restored", "announced")  # GroupTotals attributes

    def __init__(self, labels: list[str]) -> None:
        self.counters = {attr: METRICS.counter(f"kvwatch_kv_group_blocks_{attr}") for attr in self.COUNTERS}
        self.resident = METRICS.gauge("kvwatch_kv_group_blocks_resident")
        self.info = METRICS.gauge("kvwatch_kv_cache_group_info")

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
        self.blocks = METRICS.counter("kvwatch_kv_blocks_regretted")
        self.restored = METRICS.counter("kvwatch_kv_blocks_restored")
        self.tokens = METRICS.counter("kvwatch_kv_regret_recomputed_tokens")
        self.seconds = METRICS.histogram("kvwatch_kv_regret_seconds")
        self.horizon = METRICS.gauge("kvwatch_kv_regret_horizon_seconds")
        self.ratio = METRICS.gauge("kvwatch_kv_regret_ratio")

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
        self.scrapes = METRICS.counter("kvwatch_engine_scrapes")
        self.rejected = METRICS.counter("kvwatch_engine_samples_rejected")
        self.refused = METRICS.gauge("kvwatch_engine_taps_refused")
        self.usage = METRICS.gauge("kvwatch_engine_kv_usage_ratio")
        self.hit = METRICS.gauge("kvwatch_engine_prefix_cache_hit_ratio")

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
        self.queried = METRICS.counter("kvwatch_engine_prefix_cache_queried_tokens")
        self.hit = METRICS.counter("kvwatch_engine_prefix_cache_hit_tokens")
        self.preemptions = METRICS.counter("kvwatch_engine_preemptions")
        self.generated = METRICS.counter("kvwatch_engine_generation_tokens")
        self.offload = METRICS.counter("kvwatch_engine_kv_offload_bytes")
        self.sleeping = METRICS.gauge("kvwatch_engine_sleeping")

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
