"""Prometheus families of the KV metric-truth audit: per engine process and pair, what the
engine's counter and kvwatch's own evidence said over the last judged window, how far apart,
and how many windows agreed or diverged."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from kvwatch.daemon.model.snapshot import Snapshot
from kvwatch.exporters.labels import PROCESS_LABELS, label_values
from kvwatch.exporters.metric_specs import COUNTER, GAUGE, Metrics, MetricSpec

METRICS = Metrics(
    (
        MetricSpec(
            "kvwatch_engine_metric_audit_value",
            GAUGE,
            (
                "KV metric-truth audit, last judged window: the engine's counter (source engine) and "
                "kvwatch's own evidence of the same quantity (source kvwatch), in unit; "
                "resident_blocks is a bound (kvwatch <= engine)"
            ),
            (*PROCESS_LABELS, "pair", "source", "unit"),
        ),
        MetricSpec(
            "kvwatch_engine_metric_divergence_ratio",
            GAUGE,
            "(engine - kvwatch) / the larger of the two, last judged audit window: below 0 the engine reports less",
            (*PROCESS_LABELS, "pair"),
        ),
        MetricSpec(
            "kvwatch_engine_metric_audit_windows",
            COUNTER,
            "audit windows judged per pair, by result: agree, or diverge (apart by more than the tolerance)",
            (*PROCESS_LABELS, "pair", "result"),
        ),
    )
)


def audit_families(s: Snapshot) -> Iterator[Metric]:
    value = METRICS.gauge("kvwatch_engine_metric_audit_value")
    ratio = METRICS.gauge("kvwatch_engine_metric_divergence_ratio")
    windows = METRICS.counter("kvwatch_engine_metric_audit_windows")
    for p in s.processes:
        v = label_values(p.labels, PROCESS_LABELS)
        for row in p.kv_audit:
            value.add_metric([*v, row.pair, "engine", row.unit], row.engine)
            value.add_metric([*v, row.pair, "kvwatch", row.unit], row.kvwatch)
            ratio.add_metric([*v, row.pair], row.divergence)
            windows.add_metric([*v, row.pair, "agree"], row.window - row.windows_diverged)
            windows.add_metric([*v, row.pair, "diverge"], row.windows_diverged)
    yield from (value, ratio, windows)
