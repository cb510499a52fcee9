"""An alert declared once, as data, beside the detector that raises it (``SPECS`` in each module of
detectors/). deploy/prometheus/generate.py writes the Prometheus rules (the file, the chart's copy,
the manifest's PrometheusRule) and the README's table from the specs; the exporters label
``kvwatch_alert_active`` with the labels they declare; docs/runbook.md has a section per anchor."""

from __future__ import annotations

from dataclasses import dataclass

RUNBOOK = "https://github.com/kvwatch/kvwatch/blob/main/docs/runbook.md"


@dataclass(frozen=True, slots=True)
class AlertSpec:
    name: str
    fires_when: str  # the condition, in a line (the README's table; docs/metrics.md has the rest)
    severities: tuple[str, ...]  # what its findings carry
    causes: tuple[str, ...]  # every cause it reports; () where the cause names a thing (a pair, a family)
    labels: tuple[str, ...]  # its subject's labels beyond alert, cause, severity and a process's
    summary: str  # the rule's annotations: Prometheus templates
    description: str  # one paragraph
    page_on: str = ""  # matchers beyond the alert's name: only these findings page
    page_severity: str = "warning"  # the rule's severity label; "" keeps the finding's own
    expr: str = ""  # a rule on other series (kvwatch's own health); "" pages on kvwatch_alert_active
    for_: str = ""  # the rule's `for:`; the daemon's detectors confirm and clear before they fire
    group: str = "kvwatch.detectors"
    process: bool = True  # its subject is a process (and carries the process's labels)

    @property
    def anchor(self) -> str:
        return self.name.lower()

    @property
    def runbook_url(self) -> str:
        return f"{RUNBOOK}#{self.anchor}"

    @property
    def rule_expr(self) -> str:
        if self.expr:
            return self.expr
        extra = f",{self.page_on}" if self.page_on else ""
        return f'kvwatch_alert_active{{alert="{self.name}"{extra}}} == 1'


# kvwatch's own health, paged on its own series (not a detector's)
HEALTH_SPECS = (
    AlertSpec(
        name="KVWatchEventsLost",
        fires_when="",
        severities=("info",),
        causes=(),
        labels=(),
        summary="kvwatch is losing {{ $labels.source }} events on {{ $labels.instance }}",
        description=(
            "{{ $value | humanize }} events/s lost at {{ $labels.source }} for 10 minutes; counts "
            "from that source are lower bounds. Raise the ring buffer / map sizes or lower the event "
            "rate."
        ),
        page_severity="info",
        expr=('sum by (instance, source) (rate(kvwatch_events_lost_total{source!~".*_skipped"}[5m])) > 0'),
        for_="10m",
        group="kvwatch.agent",
        process=False,
    ),
    AlertSpec(
        name="KVWatchNotReady",
        fires_when="",
        severities=("warning",),
        causes=(),
        labels=(),
        summary="kvwatch on {{ $labels.instance }} has not been ready for 5 minutes",
        description="Probes the configuration requires are not attached; /readyz says which.",
        page_severity="warning",
        expr="kvwatch_ready == 0",
        for_="5m",
        group="kvwatch.agent",
        process=False,
    ),
)
