"""Prometheus families of the detectors: alerts firing now, onsets per alert, and what the direct
Alertmanager sink did with the alert states."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from kvwatch.daemon.model.snapshot import Snapshot
from kvwatch.exporters.labels import PROCESS_LABELS, label_values
from kvwatch.exporters.metric_specs import COUNTER, GAUGE, Metrics, MetricSpec

METRICS = Metrics(
    (
        MetricSpec(
            "kvwatch_alert_active",
            GAUGE,
            "1 while a detector's alert is firing",
            ("alert", "cause", "severity", *PROCESS_LABELS),  # and every alert spec's labels
        ),
        MetricSpec("kvwatch_alerts_fired", COUNTER, "alert onsets", ("alert",)),
        MetricSpec(
            "kvwatch_alertmanager_alerts",
            COUNTER,
            (
                "alert states posted to Alertmanager (sent), posts that failed (failed, retried), "
                "states dropped at the pending bound (dropped)"
            ),
            ("result",),
        ),
    )
)


def active_family(s: Snapshot) -> Iterator[Metric]:
    """Labelled with what every alert's spec declares (``Snapshot.alert_labels``), so a label a
    detector sets is exported, or is caught by the specs' test before it ships."""
    names = ("alert", "cause", "severity", *PROCESS_LABELS, *s.alert_labels)
    active = METRICS.gauge("kvwatch_alert_active", more_labels=s.alert_labels)
    for a in s.alerts:
        active.add_metric(
            label_values({"alert": a.alert, "cause": a.cause, "severity": a.severity, **a.labels}, names),
            1,
        )
    yield active


def alertmanager_family(s: Snapshot) -> Iterator[Metric]:
    """Only while the direct sink is configured."""
    if s.alertmanager is None:
        return
    am = METRICS.counter("kvwatch_alertmanager_alerts")
    for result in ("sent", "failed", "dropped"):
        am.add_metric([result], s.alertmanager.get(result, 0))
    yield am


def fired_family(s: Snapshot) -> Iterator[Metric]:
    fired = METRICS.counter("kvwatch_alerts_fired")
    for name, n in sorted(s.alerts_fired.items()):  # every alert the detectors raise, from zero
        fired.add_metric([name], n)
    yield fired
