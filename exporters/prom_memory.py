"""Prometheus families of host memory: page frees and direct reclaim of each watched process,
its GPU memory (NVML), KV-tier page-cache eviction (and who reclaimed it) and refaults, OOM
kills, node memory PSI."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvwatch.daemon.model.snapshot import Snapshot
from kvwatch.exporters.labels import PROCESS_LABELS, label_values

OOM_LABELS = ("engine", "role", "container", "pod")
RECLAIMER_LABELS = ("tier", "reclaimer", "scope", "reclaimer_cgroup", "reclaimer_pod_uid", "reclaimer_container")


def process_families(s: Snapshot) -> Iterator[Metric]:
    labels = list(PROCESS_LABELS)
    pages = CounterMetricFamily(
        "kvwatch_page_free_pages", "pages released by a watched process (in its context)", labels=labels
    )
    reclaim = CounterMetricFamily(
        "kvwatch_direct_reclaim_seconds",
        "time a watched process spent stalled in direct reclaim (scope: global or memcg limit)",
        labels=[*labels, "scope"],
    )
    stalls = CounterMetricFamily(
        "kvwatch_direct_reclaim_stalls",
        "direct reclaim episodes of a watched process",
        labels=[*labels, "scope"],
    )
    gpu = GaugeMetricFamily("kvwatch_gpu_memory_used_bytes", "GPU memory held by the process (NVML)", labels=labels)
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
    evicted = CounterMetricFamily(
        "kvwatch_pagecache_evicted_bytes",
        "page-cache bytes of KV-tier files evicted; cause=reclaim (memory pressure) or policy (deleted/truncated)",
        labels=["tier", "cause"],
    )
    reclaimed = CounterMetricFamily(
        "kvwatch_pagecache_reclaimed_bytes",
        "page-cache bytes of KV-tier files evicted by reclaim, by who reclaimed them (summed: the tier's"
        " cause=reclaim); reclaimer=cgroup (a task in reclaim: its cgroup), kswapd, kdamond, other (cgroups"
        " past the per-tier cap) or unknown; scope=global (node-wide pressure) or memcg (a cgroup's limit)",
        labels=list(RECLAIMER_LABELS),
    )
    refault = CounterMetricFamily(
        "kvwatch_pagecache_refault_pages",
        "KV-tier file pages read back after reclaim evicted them",
        labels=["tier"],
    )
    files = GaugeMetricFamily("kvwatch_kv_tier_files", "files tracked in the KV tier", labels=["tier", "source"])
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
    oom = CounterMetricFamily("kvwatch_oom_kills", "OOM kills of watched processes", labels=list(OOM_LABELS))
    for key, n in sorted(s.oom_kills.items()):
        oom.add_metric(list(key), n)
    yield oom


def psi_family(s: Snapshot) -> Iterator[Metric]:
    """Only when the node's memory PSI could be read: no series rather than a 0 that reads as no pressure."""
    if s.psi_memory_some_avg10 is not None:
        psi = GaugeMetricFamily("kvwatch_memory_pressure_some_avg10", "node memory PSI 'some' avg10 (percent)")
        psi.add_metric([], s.psi_memory_some_avg10)
        yield psi
