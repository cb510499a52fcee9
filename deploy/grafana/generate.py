"""Writes kvwatch.json, the Grafana dashboard (provisionable; Grafana 9+), with grafana-foundation-sdk.

    .venv/bin/python deploy/grafana/generate.py   # after adding a metric family: regenerate, commit

The SDK comes with kvwatch's test extras (deploy/setup.sh test installs them). The panels and
their queries are in panels.py; this module lays them out with the SDK's builders and adds
template variables for the Prometheus data source, node, engine and pod, and kvwatch's alerts as
annotations. tests/unit/test_deploy.py fails when a family kvwatch exports has no panel or the
file is stale.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, TypeVar

from grafana_foundation_sdk.builders import dashboard, table, timeseries
from grafana_foundation_sdk.builders import prometheus as prom
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models.prometheus import PromQueryFormat
from panels import NODE, ROWS, Graph, sel

OUT = Path(__file__).with_name("kvwatch.json")
DS = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
HEIGHT = 8

# Grafana's own defaults for a time series panel; the SDK's tooltip would sort ascending.
LEGEND = common.VizLegendOptions(
    display_mode=common.LegendDisplayMode.LIST, placement=common.LegendPlacement.BOTTOM, show_legend=True, calcs=[]
)
TOOLTIP = common.VizTooltipOptions(mode=common.TooltipDisplayMode.SINGLE, sort=common.SortOrder.NONE)


T = TypeVar("T")


class _Model(cogbuilder.Builder[T]):
    """Hands a finished SDK model to a builder method (the SDK's builders take builders)."""

    def __init__(self, built: T) -> None:
        self.built = built

    def build(self) -> T:
        return self.built


class _PromAnnotation(model.AnnotationQuery):
    """The SDK's annotation query knows `expr` but not the rest of the Prometheus data source's
    annotation fields (step, title and text templates, tag labels); they are added to its JSON."""

    def __init__(self, prometheus: dict[str, str], **fields: Any) -> None:
        super().__init__(**fields)
        self.prometheus = prometheus

    def to_json(self) -> dict[str, object]:
        return super().to_json() | self.prometheus


class _QueryVariable(model.VariableModel):
    """The SDK's variable has no `definition`, the query text Grafana's variable editor lists."""

    def __init__(self, definition: str, **fields: Any) -> None:
        super().__init__(**fields)
        self.definition = definition

    def to_json(self) -> dict[str, object]:
        return super().to_json() | {"definition": self.definition}


def target(ref_id: str, expr: str, legend: str, instant: bool) -> prom.Dataquery:
    query = prom.Dataquery().datasource(DS).expr(expr).legend_format(legend).ref_id(ref_id)
    return query.instant().format(PromQueryFormat.TABLE) if instant else query


def panel(pid: int, spec: Graph) -> table.Panel | timeseries.Panel:
    """A full-width table or a half-width time series; the dashboard builder lays them out left to right."""
    built: table.Panel | timeseries.Panel
    if spec.table:
        built = table.Panel().show_header(True).span(24)
    else:
        built = timeseries.Panel().legend(_Model(LEGEND)).tooltip(_Model(TOOLTIP)).span(12)
    built.id(pid).title(spec.title).datasource(DS).unit(spec.unit).height(HEIGHT)
    for i, (expr, legend) in enumerate(spec.queries):
        built.with_target(target(chr(ord("A") + i), expr, legend, spec.table))
    return built


def variable(name: str, query: str) -> _Model[model.VariableModel]:
    """A multi-value picker over a label, All by default (matching every value, unset labels too)."""
    every = model.VariableOption(selected=True, text=["All"], value=["$__all"])
    return _Model(
        _QueryVariable(
            query,
            type_val=model.VariableType.QUERY,
            name=name,
            label=name,
            datasource=DS,
            query={"query": query, "refId": name},
            refresh=model.VariableRefresh.ON_TIME_RANGE_CHANGED,
            include_all=True,
            multi=True,
            all_value=".*",
            current=every,
            sort=model.VariableSort.ALPHABETICAL_ASC,
        )
    )


def alerts() -> _Model[model.AnnotationQuery]:
    """kvwatch's alerts as annotations: a mark where an alert series starts or stops."""
    fields = {
        "step": "30s",
        "titleFormat": "{{alert}} ({{cause}})",
        "textFormat": "{{engine}} pid {{pid}} {{pod}} {{tier}}{{probe}} on {{instance}}",
        "tagKeys": "alert,cause,engine",
    }
    where = f'{NODE},engine=~"$engine"'
    expr = f"changes({sel('kvwatch_alert_active', where)}[1m]) > 0"
    return _Model(
        _PromAnnotation(fields, name="kvwatch alerts", datasource=DS, enable=True, icon_color="red", expr=expr)
    )


def build() -> dashboard.Dashboard:
    board = (
        dashboard.Dashboard("kvwatch: KV cache of LLM inference")
        .uid("kvwatch")
        .description("Generated by deploy/grafana/generate.py; metric names are kvwatch's public contract.")
        .tags(["kvwatch", "llm", "inference", "ebpf"])
        .timezone("browser")
        .version(1)
        .editable()
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(variable("node", "label_values(kvwatch_build_info, instance)"))
        .with_variable(variable("engine", f"label_values({sel('kvwatch_watched_processes')}, engine)"))
        .with_variable(variable("pod", f"label_values({sel('kvwatch_page_free_pages_total')}, pod)"))
        .annotation(alerts())
    )
    ids = itertools.count(1)  # rows and panels share one sequence of ids
    for title, graphs in ROWS:
        board.with_row(dashboard.Row(title).id(next(ids)))
        for spec in graphs:
            board.with_panel(panel(next(ids), spec))
    return board


def render() -> str:
    return json.dumps(build().build(), cls=JSONEncoder, indent=1) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
