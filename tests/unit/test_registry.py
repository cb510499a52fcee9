"""The detectors' registry and their alert specs (daemon/model/alerts.py): every alert a detector
raises is declared once, with a runbook section, and nothing else names an alert that is not."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kvwatch.daemon.config import DetectorsConfig
from kvwatch.daemon.detectors.registry import ALERT_SPECS, alert_label_names, alert_names, build_detectors
from kvwatch.daemon.model.alerts import HEALTH_SPECS

REPO = Path(__file__).resolve().parents[2]


def test_every_alert_a_detector_raises_has_one_spec() -> None:
    raised = alert_names(build_detectors(DetectorsConfig(), 1e9))
    declared = [s.name for s in ALERT_SPECS]
    assert sorted(raised) == sorted(declared) and len(set(declared)) == len(declared)
    assert not {s.name for s in HEALTH_SPECS} & set(declared)


def test_every_spec_has_a_runbook_section_and_a_severity() -> None:
    runbook = (REPO / "docs" / "runbook.md").read_text()
    sections = {m.lower() for m in re.findall(r"^## (\w+)$", runbook, re.M)}
    for s in (*ALERT_SPECS, *HEALTH_SPECS):
        assert s.anchor in sections, f"docs/runbook.md has no section for {s.name}"
        assert s.severities and set(s.severities) <= {"info", "warning", "critical"}, s.name
        assert s.page_severity in {"", *s.severities}, s.name
        assert s.description and s.summary, s.name


def test_alert_labels_are_the_specs_own_once() -> None:
    labels = alert_label_names()
    assert len(set(labels)) == len(labels)
    assert {"tenant", "aggressor", "medium", "tier", "probe", "family"} <= set(labels)
    assert not {"alert", "cause", "severity", "pid"} & set(labels)


def _alert_names_spelled(folder: str) -> set[tuple[str, str]]:
    shape = re.compile(r"^(KV|CUDA|Inference)[A-Z][A-Za-z]+$")
    spelled = set()
    for f in (REPO / folder).glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and shape.match(node.value):
                spelled.add((f.name, node.value))
    return spelled


def test_exporters_name_no_alert() -> None:
    """An alert is named in its detector's spec only: top and the timeline find what they need by
    the labels the specs declare (probe, aggressor), never by an alert's name."""
    declared = {s.name for s in ALERT_SPECS}
    assert {name for _, name in _alert_names_spelled("daemon/detectors")} >= declared  # the scan sees names
    assert sorted(_alert_names_spelled("exporters")) == []
