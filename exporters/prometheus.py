"""Prometheus custom collector: fresh metric families from the latest snapshot on every scrape.

Per-process series exist exactly while the process is watched (no labelled
Gauge leaking dead label sets); nothing here touches BPF maps, so concurrent
scrapers always agree.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterator

from kvwatch.daemon.records import ALERT_NAMES
from kvwatch.daemon.snapshot import Snapshot
from kvwatch.exporters.engine_families import engine_families
from kvwatch.exporters.labels import PROCESS_LABELS, label_values
from kvwatch.probes.records import BUCKET_BOUNDS, ApiCounters, XferCounters
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

ALERT_LABELS = ("alert", "cause", "severity", *PROCESS_LABELS, "tier", "probe", "medium")
OOM_LABELS = ("engine", "role", "container", "pod")


def _uprobe_release_family(s: Snapshot) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "kvwatch_uprobe_releases_pending",
        "uprobes detached (process gone) whose release by the kernel is still in progress; "
        "each costs the kernel ~0.1 s, done in the background",
        value=s.uprobe_releases_pending,
    )


def _alertmanager_family(s: Snapshot) -> Iterator[Metric]:
    if s.alertmanager is None:
        return
    am = CounterMetricFamily(
        "kvwatch_alertmanager_alerts",
        "alert states posted to Alertmanager (sent), posts that failed (failed, retried), "
        "states dropped at the pending bound (dropped)",
        labels=["result"],
    )
    for result in ("sent", "failed", "dropped"):
        am.add_metric([result], s.alertmanager.get(result, 0))
    yield am


class SnapshotCollector(Collector):
    def __init__(
        self,
        get_snapshot: Callable[[], Snapshot],
        *,
        version: str = "",
        bcc_version: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.get_snapshot = get_snapshot
        self.version = version
        self.bcc_version = bcc_version
        self.clock = clock

    def describe(self) -> Iterator[Metric]:
        # Families are the same on every scrape; describing them from an empty
        # snapshot lets the registry check names without a live daemon.
        yield from self._families(Snapshot.empty())

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self.get_snapshot())

    def _families(self, s: Snapshot) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "kvwatch_build_info", "kvwatch version labels", labels=["version", "bcc_version", "kernel"]
        )
        info.add_metric([self.version, self.bcc_version, platform.release()], 1)
        yield info

        ready = GaugeMetricFamily("kvwatch_ready", "1 when every probe the config asks for is attached")
        ready.add_metric([], 1 if s.ready else 0)
        yield ready
        age = GaugeMetricFamily("kvwatch_snapshot_age_seconds", "seconds since the loop published the data served")
        age.add_metric([], max(0.0, self.clock() - s.wall_time) if s.wall_time else 0.0)
        yield age
        loop = GaugeMetricFamily("kvwatch_loop_duration_seconds", "duration of the last loop tick")
        loop.add_metric([], s.loop_seconds)
        yield loop

        attached = GaugeMetricFamily(
            "kvwatch_probe_attached",
            "1 attached, 0 not (state says why)",
            labels=["probe", "family", "state"],
        )
        hits = CounterMetricFamily("kvwatch_probe_hits", "times the probe fired", labels=["probe", "family"])
        for p in s.probes:
            attached.add_metric([p.name, p.family, p.state], 1 if p.state == "attached" else 0)
            hits.add_metric([p.name, p.family], p.hits)
        yield attached
        yield hits

        lost = CounterMetricFamily(
            "kvwatch_events_lost",
            "events dropped anywhere (ring buffer full, map full, queue full, probe runs the kernel skipped)",
            labels=["source"],
        )
        for source, n in sorted(s.lost.items()):
            lost.add_metric([source], n)
        yield lost
        errors = CounterMetricFamily("kvwatch_errors", "errors counted by the daemon, by kind", labels=["kind"])
        for kind, n in sorted(s.errors.items()):
            errors.add_metric([kind], n)
        yield errors

        watched = GaugeMetricFamily("kvwatch_watched_processes", "inference processes being watched", labels=["engine"])
        for engine, n in sorted(s.watched_by_engine.items()):
            watched.add_metric([engine], n)
        yield watched
        overflow = CounterMetricFamily(
            "kvwatch_watched_processes_overflow", "processes not watched because the label cap was reached"
        )
        overflow.add_metric([], s.label_overflow)
        yield overflow

        yield from self._process_families(s)
        yield from self._cuda_families(s)
        yield from self._transfer_families(s)
        yield from engine_families(s)
        yield from self._tier_families(s)

        oom = CounterMetricFamily("kvwatch_oom_kills", "OOM kills of watched processes", labels=list(OOM_LABELS))
        for key, n in sorted(s.oom_kills.items()):
            oom.add_metric(list(key), n)
        yield oom

        active = GaugeMetricFamily(
            "kvwatch_alert_active", "1 while a detector's alert is firing", labels=list(ALERT_LABELS)
        )
        for a in s.alerts:
            active.add_metric(
                label_values({"alert": a.alert, "cause": a.cause, "severity": a.severity, **a.labels}, ALERT_LABELS),
                1,
            )
        yield active
        yield from _alertmanager_family(s)
        yield from _uprobe_release_family(s)
        fired = CounterMetricFamily("kvwatch_alerts_fired", "alert onsets", labels=["alert"])
        for name in sorted(set(ALERT_NAMES) | set(s.alerts_fired)):
            fired.add_metric([name], s.alerts_fired.get(name, 0))
        yield fired

        if s.psi_memory_some_avg10 is not None:
            psi = GaugeMetricFamily("kvwatch_memory_pressure_some_avg10", "node memory PSI 'some' avg10 (percent)")
            psi.add_metric([], s.psi_memory_some_avg10)
            yield psi

    def _process_families(self, s: Snapshot) -> Iterator[Metric]:
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
            pages.add_metric(v, p.totals.get("page_free_pages", 0.0))
            reclaim.add_metric([*v, "global"], p.totals.get("direct_reclaim_seconds", 0.0))
            reclaim.add_metric([*v, "memcg"], p.totals.get("memcg_reclaim_seconds", 0.0))
            stalls.add_metric([*v, "global"], p.totals.get("direct_reclaim_count", 0.0))
            stalls.add_metric([*v, "memcg"], p.totals.get("memcg_reclaim_count", 0.0))
            if p.gpu_used_bytes is not None:
                gpu.add_metric(v, p.gpu_used_bytes)
        yield pages
        yield reclaim
        yield stalls
        yield gpu

    def _cuda_families(self, s: Snapshot) -> Iterator[Metric]:
        labels = list(PROCESS_LABELS)
        alloc_calls = CounterMetricFamily(
            "kvwatch_cuda_alloc_calls",
            "CUDA allocation calls (result ok / error)",
            labels=[*labels, "api", "result"],
        )
        alloc_bytes = CounterMetricFamily(
            "kvwatch_cuda_alloc_bytes", "bytes successfully allocated", labels=[*labels, "api"]
        )
        free_calls = CounterMetricFamily(
            "kvwatch_cuda_free_calls", "CUDA free calls", labels=[*labels, "api", "result"]
        )
        freed_bytes = CounterMetricFamily(
            "kvwatch_cuda_freed_bytes", "bytes freed (allocations kvwatch saw)", labels=[*labels, "api"]
        )
        unknown = CounterMetricFamily(
            "kvwatch_cuda_free_unknown",
            "successful frees of allocations made before kvwatch attached (size unknown)",
            labels=[*labels, "api"],
        )
        maps = CounterMetricFamily("kvwatch_cuda_vmm_map_calls", "cuMemMap / cuMemUnmap calls", labels=[*labels, "api"])
        mapped = CounterMetricFamily(
            "kvwatch_cuda_vmm_mapped_bytes", "bytes mapped / unmapped by the VMM API", labels=[*labels, "api"]
        )
        outstanding = GaugeMetricFamily(
            "kvwatch_cuda_outstanding_bytes",
            "allocated minus freed since kvwatch attached (kind: device, host, vmm)",
            labels=[*labels, "kind"],
        )
        failures = CounterMetricFamily(
            "kvwatch_cuda_alloc_failures",
            "failed allocation calls by CUDA error code",
            labels=[*labels, "api", "code"],
        )
        attached = GaugeMetricFamily(
            "kvwatch_cuda_probes_attached", "CUDA API symbols probed in the process", labels=labels
        )
        copy_calls = CounterMetricFamily(
            "kvwatch_cuda_copy_calls",
            "host/device copy calls by direction (h2d, d2h, d2d, default) and result",
            labels=[*labels, "api", "direction", "result"],
        )
        copy_bytes = CounterMetricFamily(
            "kvwatch_cuda_copy_bytes",
            "bytes copied between host and device (KV offload d2h, reload h2d)",
            labels=[*labels, "api", "direction"],
        )
        for p in s.processes:
            if p.cuda is None:
                continue
            v = label_values(p.labels, PROCESS_LABELS)
            attached.add_metric(v, p.cuda.symbols_attached)
            for kind, n in sorted(p.cuda.outstanding.items()):
                outstanding.add_metric([*v, kind], n)
            for (label, code), n in sorted(p.cuda.failures.items()):
                failures.add_metric([*v, label, str(code)], n)
            for label, c in sorted(p.cuda.apis.items()):
                api_label, sep, direction = label.partition(":")
                if sep:  # copies: one row per direction
                    copy_calls.add_metric([*v, api_label, direction, "ok"], c.ok)
                    copy_calls.add_metric([*v, api_label, direction, "error"], c.err)
                    copy_bytes.add_metric([*v, api_label, direction], c.bytes)
            for label, klass in p.cuda.api_classes.items():
                c = p.cuda.apis.get(label) or ApiCounters()
                if klass == "alloc":
                    alloc_calls.add_metric([*v, label, "ok"], c.ok)
                    alloc_calls.add_metric([*v, label, "error"], c.err)
                    alloc_bytes.add_metric([*v, label], c.bytes)
                elif klass == "free":
                    free_calls.add_metric([*v, label, "ok"], c.ok)
                    free_calls.add_metric([*v, label, "error"], c.err)
                    freed_bytes.add_metric([*v, label], c.bytes)
                    unknown.add_metric([*v, label], c.unknown)
                else:
                    maps.add_metric([*v, label], c.ok)
                    mapped.add_metric([*v, label], c.bytes)
        yield from (
            alloc_calls,
            alloc_bytes,
            free_calls,
            freed_bytes,
            unknown,
            maps,
            mapped,
            outstanding,
            failures,
            attached,
            copy_calls,
            copy_bytes,
        )

    def _transfer_families(self, s: Snapshot) -> Iterator[Metric]:
        labels = list(PROCESS_LABELS)
        nbytes = CounterMetricFamily(
            "kvwatch_transfer_bytes",
            "bytes moved by KV transfer calls (nixl: completed transfers; ucx, nccl: submitted)",
            labels=[*labels, "lib", "op"],
        )
        calls = CounterMetricFamily(
            "kvwatch_transfer_calls", "transfer calls (nixl: posts) by result", labels=[*labels, "lib", "op", "result"]
        )
        completed = CounterMetricFamily(
            "kvwatch_transfer_completed", "NIXL transfers completed", labels=[*labels, "lib"]
        )
        duration = HistogramMetricFamily(
            "kvwatch_transfer_duration_seconds", "per-transfer completion time (post to done)", labels=[*labels, "lib"]
        )
        bandwidth = GaugeMetricFamily(
            "kvwatch_transfer_effective_bandwidth_bytes",
            "bytes over the summed per-transfer completion times, last 5 s",
            labels=[*labels, "lib"],
        )
        utilization = GaugeMetricFamily(
            "kvwatch_transfer_link_utilization_ratio",
            "effective bandwidth over the configured link bandwidth",
            labels=[*labels, "lib"],
        )
        registered = GaugeMetricFamily(
            "kvwatch_rdma_registered_bytes",
            "memory registered for RDMA (ibv_reg_mr*) minus deregistered",
            labels=labels,
        )
        registrations = CounterMetricFamily(
            "kvwatch_rdma_registrations", "RDMA memory registrations by result", labels=[*labels, "result"]
        )
        attached = GaugeMetricFamily("kvwatch_transfer_probes_attached", "transfer API symbols probed", labels=labels)
        for p in s.processes:
            x = p.transfers
            if x is None:
                continue
            v = label_values(p.labels, PROCESS_LABELS)
            attached.add_metric(v, x.symbols_attached)
            registered.add_metric(v, x.registered_bytes)
            registrations.add_metric([*v, "ok"], x.registrations)
            registrations.add_metric([*v, "error"], x.registration_errors)
            per_lib: dict[str, XferCounters] = {}
            for (lib, op), c in sorted(x.xfers.items()):
                nbytes.add_metric([*v, lib, op], c.bytes)
                calls.add_metric([*v, lib, op, "ok"], c.calls - c.errors if lib == "nixl" else c.calls)
                calls.add_metric([*v, lib, op, "error"], c.errors)
                agg = per_lib.get(lib)
                per_lib[lib] = (
                    c
                    if agg is None
                    else XferCounters(
                        completed=agg.completed + c.completed,
                        duration_ns=agg.duration_ns + c.duration_ns,
                        buckets=tuple(a + b for a, b in zip(agg.buckets, c.buckets, strict=True)),
                    )
                )
            nixl = per_lib.get("nixl")
            if nixl is not None:
                completed.add_metric([*v, "nixl"], nixl.completed)
                running = 0
                buckets = []
                for bound, n in zip(BUCKET_BOUNDS, nixl.buckets, strict=False):
                    running += n
                    buckets.append((f"{bound:.9g}", running))
                buckets.append(("+Inf", nixl.completed))
                duration.add_metric([*v, "nixl"], buckets, nixl.duration_ns / 1e9)
                bandwidth.add_metric([*v, "nixl"], x.effective_bytes_per_second)
                if s.link_bytes_per_second > 0:
                    utilization.add_metric([*v, "nixl"], x.effective_bytes_per_second / s.link_bytes_per_second)
        yield from (nbytes, calls, completed, duration, bandwidth, utilization, registered, registrations, attached)
        link = GaugeMetricFamily(
            "kvwatch_transfer_link_bandwidth_bytes", "configured KV transfer link bandwidth (bytes/s, 0: unknown)"
        )
        link.add_metric([], s.link_bytes_per_second)
        yield link
        pending = GaugeMetricFamily("kvwatch_transfer_pending", "NIXL transfers posted and not completed yet")
        pending.add_metric([], s.transfers_pending)
        yield pending

    def _tier_families(self, s: Snapshot) -> Iterator[Metric]:
        evicted = CounterMetricFamily(
            "kvwatch_pagecache_evicted_bytes",
            "page-cache bytes of KV-tier files evicted; cause=reclaim (memory pressure) or policy (deleted/truncated)",
            labels=["tier", "cause"],
        )
        refault = CounterMetricFamily(
            "kvwatch_pagecache_refault_pages",
            "KV-tier file pages read back after reclaim evicted them",
            labels=["tier"],
        )
        files = GaugeMetricFamily("kvwatch_kv_tier_files", "files tracked in the KV tier", labels=["tier", "source"])
        for t in s.tiers:
            evicted.add_metric([t.name, "reclaim"], t.totals.get("reclaim_bytes", 0.0))
            evicted.add_metric([t.name, "policy"], t.totals.get("policy_bytes", 0.0))
            refault.add_metric([t.name], t.totals.get("refault_pages", 0.0))
            files.add_metric([t.name, t.source], t.files)
        yield evicted
        yield refault
        yield files


def build_registry(collector: SnapshotCollector, *, self_process: bool = True) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    if self_process:
        ProcessCollector(namespace="kvwatch", registry=registry)
    return registry
