"""Every metric family kvwatch exports is declared once, as data: its name, type, help and label
names, in a ``Metrics`` table at the top of the collector module that fills it
(``exporters/prom_*.py``, ``http_conns.py``). The collector builds the family from its
declaration by name and only adds samples; docs/metrics.md and the dashboard are checked against
the declarations (``tests/unit/test_exporters.py``, ``test_deploy.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str  # as exposed, without a counter's _total
    kind: str  # counter / gauge / histogram
    help: str
    labels: tuple[str, ...] = ()


class Metrics:
    """One collector module's families, by name; every table made is kept in ``Metrics.tables``."""

    tables: ClassVar[list[Metrics]] = []

    def __init__(self, specs: Iterable[MetricSpec]) -> None:
        self.specs: dict[str, MetricSpec] = {}
        for s in specs:
            if s.name in self.specs:
                raise ValueError(f"metric {s.name} declared twice")
            self.specs[s.name] = s
        Metrics.tables.append(self)

    def _spec(self, name: str, kind: str) -> MetricSpec:
        spec = self.specs[name]
        if spec.kind != kind:
            raise TypeError(f"metric {name} is declared a {spec.kind}, built as a {kind}")
        return spec

    def counter(self, name: str) -> CounterMetricFamily:
        s = self._spec(name, COUNTER)
        return CounterMetricFamily(name, s.help, labels=list(s.labels) if s.labels else None)

    def gauge(self, name: str, value: float | None = None, more_labels: Sequence[str] = ()) -> GaugeMetricFamily:
        """``more_labels``: label names known only at the scrape (the alert specs' own), after the declared."""
        s = self._spec(name, GAUGE)
        labels = [*s.labels, *more_labels]
        return GaugeMetricFamily(name, s.help, value=value, labels=labels or None)

    def histogram(self, name: str) -> HistogramMetricFamily:
        s = self._spec(name, HISTOGRAM)
        return HistogramMetricFamily(name, s.help, labels=list(s.labels) if s.labels else None)


def declared() -> Iterator[MetricSpec]:
    """Every family declared by the collector modules imported so far."""
    for t in Metrics.tables:
        yield from t.specs.values()
