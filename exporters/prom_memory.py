"""Prometheus families of host memory: page frees and direct reclaim of each watched process,
its GPU memory (NVML), KV-tier page-cache eviction (and who reclaimed it) and refaults, OOM
kills, node memory PSI."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from kvwatch.daemon.model.snapshot import Snapshot
from kvwatch.exporters.labels import PROCESS_LABELS, label_values
from kvwatch.exporters.metric_specs import COUNTER, GAUGE, Metrics, MetricSpec

METRICS = Metrics(
    (
        MetricSpec(
            "kvwatch_page_free_pages", COUNTER, "pages released by a watched process (in its context)", PROCESS_LABELS
        ),
        MetricSpec(
            "kvwatch_direct_reclaim_seconds",
            COUNTER,
            "time a watched process spent stalled in direct reclaim (scope: global or memcg limit)",
            (*PROCESS_LABELS, "scope"),
        ),
        MetricSpec(
            "kvwatch_direct_reclaim_stalls",
            COUNTER,
            "direct reclaim episodes of a watched process",
            (*PROCESS_LABELS, "scope"),
        ),
        MetricSpec("kvwatch_gpu_memory_used_bytes", GAUGE, "GPU memory held by the process (NVML)", PROCESS_LABELS),
        MetricSpec(
            "kvwatch_pagecache_evicted_bytes",
            COUNTER,
            (
                "page-cache bytes of KV-tier files evicted; cause=reclaim (memory pressure) or policy"
                " (deleted/truncated)"
            ),
            ("tier", "cause"),
        ),
        MetricSpec(
            "kvwatch_pagecache_reclaimed_bytes",
            COUNTER,
            (
                "page-cache bytes of KV-tier files evicted by reclaim, by who reclaimed them (summed:"
                " the tier's cause=reclaim); reclaimer=cgroup (a task in reclaim: its cgroup), "
                "kswapd, kdamond, other (cgroups past the per-tier cap) or unknown; scope=global "
                "(node-wide pressure) or memcg (a cgroup's limit)"
            ),
            ("tier", "reclaimer", "scope", "reclaimer_cgroup", "reclaimer_pod_uid", "reclaimer_container"),
        ),
        MetricSpec(
            "kvwatch_pagecache_refault_pages",
            COUNTER,
            "KV-tier file pages read back after reclaim evicted them",
            ("tier",),
        ),
        MetricSpec("kvwatch_kv_tier_files", GAUGE, "files tracked in the KV tier", ("tier", "source")),
        MetricSpec(
            "kvwatch_oom_kills", COUNTER, "OOM kills of watched processes", ("engine", "role", "container", "pod")
        ),
        MetricSpec("kvwatch_memory_pressure_some_avg10", GAUGE, "node memory PSI 'some' avg10 (percent)", ()),
    )
)

OOM_LABELS = ("engine", "role", "container", "pod")
RECLAIMER_LABELS = ("tier", "reclaimer", "scope", "reclaimer_cgroup", "reclaimer_pod_uid", "reclaimer_container")


def process_families(s: Snapshot) -> Iterator[Metric]:
    pages = METRICS.counter("kvwatch_page_free_pages")
    reclaim = METRICS.counter("kvwatch_direct_reclaim_seconds")
    stalls = METRICS.counter("kvwatch_direct_reclaim_stalls")
    gpu = METRICS.gauge("kvwatch_gpu_memory_used_bytes")
    for p in s.processes:
        v = label_values(p.labels, PROCESS_LABELS)
        m = p.memory
        pages.add_metric(v, m.page_free_pages)
        reclaim.add_metric([*v, "global"], m.direct_reclaim_seconds)
        reclaim.add_metric([*v, "memcg"], m.memcg_reclaim_seconds)
        stalls.add_metric([*v, "global"], m.direct_reclaim_count)
        stalls.add_metric([*v, "memcg"], m.memcg_reclaim_count)
        if p.gpu_used_bytes is not None:
            gpu.add_metric(v, p.gpu_used_bytes)
    yield pages
    yield reclaim
    yield stalls
    yield gpu


def tier_families(s: Snapshot) -> Iterator[Metric]:
    evicted = METRICS.counter("kvwatch_pagecache_evicted_bytes")
    reclaimed = METRICS.counter("kvwatch_pagecache_reclaimed_bytes")
    refault = METRICS.counter("kvwatch_pagecache_refault_pages")
    files = METRICS.gauge("kvwatch_kv_tier_files")
    for t in s.tiers:
        evicted.add_metric([t.name, "reclaim"], t.totals.reclaim_bytes)
        evicted.add_metric([t.name, "policy"], t.totals.policy_bytes)
        for r in t.reclaimers:
            reclaimed.add_metric([t.name, r.reclaimer, r.scope, r.cgroup, r.pod_uid, r.container], r.bytes)
        refault.add_metric([t.name], t.totals.refault_pages)
        files.add_metric([t.name, t.source], t.files)
    yield evicted
    yield reclaimed
    yield refault
    yield files


def oom_family(s: Snapshot) -> Iterator[Metric]:
    oom = METRICS.counter("kvwatch_oom_kills")
    for key, n in sorted(s.oom_kills.items()):
        oom.add_metric(list(key), n)
    yield oom


def psi_family(s: Snapshot) -> Iterator[Metric]:
    """Only when the node's memory PSI could be read: no series rather than a 0 that reads as no pressure."""
    if s.psi_memory_some_avg10 is not None:
        psi = METRICS.gauge("kvwatch_memory_pressure_some_avg10")
        psi.add_metric([], s.psi_memory_some_avg10)
        yield psi
