"""KVEngineMetricDivergence: an engine's KV counter disagrees with kvwatch's own evidence of the
same quantity for ``confirm_windows`` audit windows in a row (``engines/audit.py`` judges each
window; this detector only counts them). Info severity by default: it says whose number to
distrust, not that the cache is failing. Clears after ``clear_windows`` windows that agree.

One finding per engine process; its cause is the first pair that fires, in the audit's order,
and the summary names both numbers and their sources. A pair left unjudged for a window's time
(too little traffic, kvwatch's own evidence incomplete) counts as a window that agrees: an alert
does not outlive its evidence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvwatch.daemon.config import MetricDivergenceConfig
from kvwatch.daemon.detectors.base import Hysteresis
from kvwatch.daemon.detectors.per_process import ProcessDetector
from kvwatch.daemon.model.alerts import AlertSpec
from kvwatch.daemon.model.engines import AuditRow
from kvwatch.daemon.model.findings import Finding, Subject
from kvwatch.daemon.model.windows import ProcessWindow

ALERT = "KVEngineMetricDivergence"
SPECS = (
    AlertSpec(
        name=ALERT,
        fires_when="engine KV counter vs kvwatch's evidence > 10 % apart, 3 × 30 s",
        severities=("info",),
        causes=(),
        labels=(),
        summary=(
            "{{ $labels.engine }} pid {{ $labels.pid }} reports KV numbers its own evidence "
            "contradicts ({{ $labels.cause }}) on {{ $labels.instance }}"
        ),
        description=(
            "kvwatch audits {{ $labels.engine }} pid {{ $labels.pid }} (pod {{ $labels.pod }}): for "
            "{{ $labels.cause }} the engine's counter said {{ with printf "
            "\"kvwatch_engine_metric_audit_value{instance='%s',pid='%s',pair='%s',source='engine'}\" "
            "$labels.instance $labels.pid $labels.cause | query }}{{ . | first | value | humanize "
            "}}{{ else }}unknown{{ end }} and kvwatch's own evidence {{ with printf "
            "\"kvwatch_engine_metric_audit_value{instance='%s',pid='%s',pair='%s',source='kvwatch'}\" "
            "$labels.instance $labels.pid $labels.cause | query }}{{ . | first | value | humanize "
            "}}{{ else }}unknown{{ end }} over the last audit window, for several windows in a row. "
            "Dashboards and autoscalers reading that engine counter are misled; the log line names "
            "both sources."
        ),
        page_severity="",
    ),
)


@dataclass(slots=True)
class _Pair:
    hysteresis: Hysteresis
    window: int = 0
    stepped_at: float = 0.0


@dataclass(slots=True)
class _State:
    pairs: dict[str, _Pair] = field(default_factory=dict)


def _amount(row: AuditRow, v: float) -> str:
    return f"{v / (1 << 20):,.1f} MiB" if row.unit == "bytes" else f"{v:,.0f} blocks"


def describe(row: AuditRow) -> str:
    return (
        f"{row.pair}: engine {_amount(row, row.engine)} ({row.engine_source}) vs kvwatch "
        f"{_amount(row, row.kvwatch)} ({row.kvwatch_source}) over {row.window_seconds:.0f} s, "
        f"{row.divergence:+.0%}"
    )


class EngineMetricDivergence(ProcessDetector[MetricDivergenceConfig, _State]):
    name = ALERT

    def applies(self, p: ProcessWindow) -> bool:
        return bool(p.audit)

    def new_state(self) -> _State:
        return _State()

    def _step(self, st: _State, row: AuditRow, now: float) -> bool:
        """One pair's count of windows; True while it fires."""
        ps = st.pairs.get(row.pair)
        if ps is None:
            ps = st.pairs[row.pair] = _Pair(Hysteresis(self.config.confirm_windows, self.config.clear_windows))
        if row.window != ps.window:  # a new window: one step of the count
            ps.window, ps.stepped_at = row.window, now
            ps.hysteresis.step(row.diverged, not row.diverged, now)
        elif now - ps.stepped_at >= self.config.window_seconds:
            # no window judged in a window's time (traffic under the floor, kvwatch's own
            # evidence incomplete): nothing says it still diverges, so that counts as cool
            ps.stepped_at = now
            ps.hysteresis.step(False, True, now)
        return ps.hysteresis.firing

    def judge(self, key: str, st: _State, p: ProcessWindow, now: float) -> Finding:
        firing = [row for row in p.audit if self._step(st, row, now)]
        lead = firing[0] if firing else p.audit[0]
        values = {f"{r.pair}_{side}": v for r in p.audit for side, v in (("engine", r.engine), ("kvwatch", r.kvwatch))}
        values.update({f"{r.pair}_divergence": round(r.divergence, 6) for r in p.audit})
        return Finding(
            alert=ALERT,
            subject=Subject(key, p.subject.labels),
            firing=bool(firing),
            cause=lead.pair if firing else "",
            values=values,
            summary=f"pid {p.subject.labels.get('pid', '?')} " + "; ".join(describe(r) for r in (firing or [lead])),
            severity=self.config.severity,
        )
