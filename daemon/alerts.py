"""From per-tick findings to alert onsets and clears, and the sinks that hear about them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Protocol, runtime_checkable

import structlog

from kvwatch.daemon.model.findings import Finding
from kvwatch.daemon.model.snapshot import Alert, AlertsView

log = structlog.get_logger("kvwatch.alerts")


class AlertSink(Protocol):
    def onset(self, alert: Alert) -> None: ...

    def clear(self, alert: Alert) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class CountingSink(Protocol):
    """A sink that counts what it delivered (the Alertmanager sender): its counts are published."""

    stats: Mapping[str, int]


class LogSink:
    """Alert onsets and clears as structured log lines with the numbers that tripped them."""

    def onset(self, alert: Alert) -> None:
        log.warning(
            "alert firing",
            alert=alert.alert,
            cause=alert.cause,
            severity=alert.severity,
            subject=alert.subject_key,
            **{f"label_{k}": v for k, v in alert.labels.items() if v},
            values={k: round(v, 6) for k, v in alert.values.items()},
            summary=alert.summary,
        )

    def clear(self, alert: Alert) -> None:
        log.info(
            "alert resolved",
            alert=alert.alert,
            cause=alert.cause,
            subject=alert.subject_key,
            duration_seconds=round((alert.ended_at or alert.started_at) - alert.started_at, 3),
        )

    def close(self) -> None:
        return None


class AlertBook:
    """Active alerts and onset counts; notifies sinks exactly once per onset and per clear."""

    def __init__(
        self,
        sinks: Iterable[AlertSink],
        names: Iterable[str] = (),
        lasting: Iterable[str] = (),
        labels: Iterable[str] = (),
    ) -> None:
        """``names``: every alert the detectors raise (counted from zero); ``lasting``: those that
        stay when their subject goes; ``labels``: the labels their specs declare beyond a
        process's (``detectors/registry.py``)."""
        self.sinks = list(sinks)
        self.labels = tuple(labels)
        self.active: dict[tuple[str, str], Alert] = {}
        self.fired: dict[str, int] = dict.fromkeys(names, 0)
        self.lasting = frozenset(lasting)
        self.sink_errors = 0
        self.history: list[Alert] = []  # recent onsets and clears, bounded (for top/record)

    def _notify(self, method: str, alert: Alert) -> None:
        for sink in self.sinks:
            try:
                getattr(sink, method)(alert)
            except Exception:  # a sink must never stop the loop
                self.sink_errors += 1
                log.exception("alert sink failed", sink=type(sink).__name__, alert=alert.alert)

    def _remember(self, alert: Alert) -> None:
        self.history.append(alert)
        if len(self.history) > 1000:
            del self.history[:500]

    def apply(self, findings: Iterable[Finding], wall_now: float) -> list[Alert]:
        """Update from this tick's findings; returns the alerts whose state changed."""
        changed: list[Alert] = []
        for f in findings:
            key = (f.alert, f.subject.key)
            current = self.active.get(key)
            if f.firing and current is None:
                alert = Alert(
                    alert=f.alert,
                    subject_key=f.subject.key,
                    labels=dict(f.subject.labels),
                    cause=f.cause,
                    severity=f.severity,
                    started_at=wall_now,
                    values=dict(f.values),
                    summary=f.summary,
                )
                self.active[key] = alert
                self.fired[f.alert] = self.fired.get(f.alert, 0) + 1
                self._remember(alert)
                self._notify("onset", alert)
                changed.append(alert)
            elif f.firing and current is not None:
                self.active[key] = replace(current, values=dict(f.values), summary=f.summary)
            elif not f.firing and current is not None:
                ended = replace(current, ended_at=wall_now)
                del self.active[key]
                self._remember(ended)
                self._notify("clear", ended)
                changed.append(ended)
        return changed

    def drop_subject(self, subject_key: str, wall_now: float) -> None:
        """A subject went away (process exit): its alerts clear (those of its parts too: a
        tenant's, ``KEY/tenant:NAME``), except those that outlive it."""
        part = subject_key + "/"
        for key in [k for k in self.active if k[1] == subject_key or k[1].startswith(part)]:
            if key[0] in self.lasting:
                continue
            ended = replace(self.active.pop(key), ended_at=wall_now)
            self._remember(ended)
            self._notify("clear", ended)

    def view(self, recent: int = 50) -> AlertsView:
        return AlertsView(
            active=tuple(self.active.values()),
            fired=dict(self.fired),
            recent=tuple(self.history[-recent:]),
            sink_errors=self.sink_errors,
            alertmanager=self.sink_stats(),
            labels=self.labels,
        )

    def sink_stats(self) -> dict[str, int] | None:
        """The delivery counts of the first sink that keeps them (sent / failed / dropped)."""
        return next((dict(s.stats) for s in self.sinks if isinstance(s, CountingSink)), None)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception:
                self.sink_errors += 1
                log.exception("alert sink close failed", sink=type(sink).__name__)
