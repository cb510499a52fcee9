"""Prometheus families of kvwatch itself: build, readiness, loop health, probe attachment and
hits, events lost, errors, the watched-process count, and uprobe releases in flight."""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator

from prometheus_client.core import Metric

from kvwatch.daemon.model.snapshot import Snapshot
from kvwatch.exporters.metric_specs import COUNTER, GAUGE, Metrics, MetricSpec
from kvwatch.exporters.prom_aggregates import snapshot_age

METRICS = Metrics(
    (
        MetricSpec("kvwatch_build_info", GAUGE, "kvwatch version labels", ("version", "bcc_version", "kernel")),
        MetricSpec("kvwatch_ready", GAUGE, "1 when every probe the config asks for is attached", ()),
        MetricSpec("kvwatch_snapshot_age_seconds", GAUGE, "seconds since the loop published the data served", ()),
        MetricSpec("kvwatch_loop_duration_seconds", GAUGE, "duration of the last loop tick", ()),
        MetricSpec("kvwatch_probe_attached", GAUGE, "1 attached, 0 not (state says why)", ("probe", "family", "state")),
        MetricSpec("kvwatch_probe_hits", COUNTER, "times the probe fired", ("probe", "family")),
        MetricSpec(
            "kvwatch_events_lost",
            COUNTER,
            "events dropped anywhere (ring buffer full, map full, queue full, probe runs the kernel skipped)",
            ("source",),
        ),
        MetricSpec("kvwatch_errors", COUNTER, "errors counted by the daemon, by kind", ("kind",)),
        MetricSpec("kvwatch_watched_processes", GAUGE, "inference processes being watched", ("engine",)),
        MetricSpec(
            "kvwatch_watched_processes_overflow", COUNTER, "processes not watched because the label cap was reached", ()
        ),
        MetricSpec(
            "kvwatch_uprobe_releases_pending",
            GAUGE,
            (
                "uprobes detached (process gone) whose release by the kernel is still in progress; "
                "each costs the kernel ~0.1 s, done in the background"
            ),
            (),
        ),
    )
)


def health_families(s: Snapshot, version: str, bcc_version: str, clock: Callable[[], float]) -> Iterator[Metric]:
    info = METRICS.gauge("kvwatch_build_info")
    info.add_metric([version, bcc_version, platform.release()], 1)
    yield info

    ready = METRICS.gauge("kvwatch_ready")
    ready.add_metric([], 1 if s.ready else 0)
    yield ready
    age = METRICS.gauge("kvwatch_snapshot_age_seconds")
    age.add_metric([], snapshot_age(s.wall_time, clock()))
    yield age
    loop = METRICS.gauge("kvwatch_loop_duration_seconds")
    loop.add_metric([], s.loop_seconds)
    yield loop


def probe_families(s: Snapshot) -> Iterator[Metric]:
    attached = METRICS.gauge("kvwatch_probe_attached")
    hits = METRICS.counter("kvwatch_probe_hits")
    for p in s.probes:
        attached.add_metric([p.name, p.family, p.state], 1 if p.state == "attached" else 0)
        hits.add_metric([p.name, p.family], p.hits)
    yield attached
    yield hits

    lost = METRICS.counter("kvwatch_events_lost")
    for source, n in sorted(s.lost.items()):
        lost.add_metric([source], n)
    yield lost
    errors = METRICS.counter("kvwatch_errors")
    for kind, n in sorted(s.errors.items()):
        errors.add_metric([kind], n)
    yield errors


def watch_families(s: Snapshot) -> Iterator[Metric]:
    watched = METRICS.gauge("kvwatch_watched_processes")
    for engine, n in sorted(s.watched_by_engine.items()):
        watched.add_metric([engine], n)
    yield watched
    overflow = METRICS.counter("kvwatch_watched_processes_overflow")
    overflow.add_metric([], s.label_overflow)
    yield overflow


def uprobe_release_family(s: Snapshot) -> Iterator[Metric]:
    yield METRICS.gauge("kvwatch_uprobe_releases_pending", value=s.uprobe_releases_pending)
