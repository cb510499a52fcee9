"""Prometheus families of kvwatch itself: build, readiness, loop health, probe attachment and
hits, events lost, errors, the watched-process count, and uprobe releases in flight."""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvwatch.daemon.model.snapshot import Snapshot
from kvwatch.exporters.prom_aggregates import snapshot_age


def health_families(s: Snapshot, version: str, bcc_version: str, clock: Callable[[], float]) -> Iterator[Metric]:
    info = GaugeMetricFamily(
        "kvwatch_build_info", "kvwatch version labels", labels=["version", "bcc_version", "kernel"]
    )
    info.add_metric([version, bcc_version, platform.release()], 1)
    yield info

    ready = GaugeMetricFamily("kvwatch_ready", "1 when every probe the config asks for is attached")
    ready.add_metric([], 1 if s.ready else 0)
    yield ready
    age = GaugeMetricFamily("kvwatch_snapshot_age_seconds", "seconds since the loop published the data served")
    age.add_metric([], snapshot_age(s.wall_time, clock()))
    yield age
    loop = GaugeMetricFamily("kvwatch_loop_duration_seconds", "duration of the last loop tick")
    loop.add_metric([], s.loop_seconds)
    yield loop


def probe_families(s: Snapshot) -> Iterator[Metric]:
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


def watch_families(s: Snapshot) -> Iterator[Metric]:
    watched = GaugeMetricFamily("kvwatch_watched_processes", "inference processes being watched", labels=["engine"])
    for engine, n in sorted(s.watched_by_engine.items()):
        watched.add_metric([engine], n)
    yield watched
    overflow = CounterMetricFamily(
        "kvwatch_watched_processes_overflow", "processes not watched because the label cap was reached"
    )
    overflow.add_metric([], s.label_overflow)
    yield overflow


def uprobe_release_family(s: Snapshot) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "kvwatch_uprobe_releases_pending",
        "uprobes detached (process gone) whose release by the kernel is still in progress; "
        "each costs the kernel ~0.1 s, done in the background",
        value=s.uprobe_releases_pending,
    )
