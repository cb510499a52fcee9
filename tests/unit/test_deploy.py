"""What deploy/ ships, checked offline: Kubernetes manifests against the Kubernetes schemas,
chart values against their JSON schema, the chart and manifests against each other and the
shipped rules, the ConfigMap's config through kvwatch's own loader, the systemd unit with
systemd-analyze, the Grafana dashboard against the metric families kvwatch exports."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvwatch.daemon.config.load import load_config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CHART = DEPLOY / "helm" / "kvwatch"
MANIFEST = DEPLOY / "kubernetes" / "kvwatch.yaml"
RULES = DEPLOY / "prometheus" / "kvwatch-rules.yaml"
UNIT = DEPLOY / "systemd" / "kvwatch.service"


def docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def by_kind(kind: str) -> dict[str, Any]:
    (d,) = [d for d in docs() if d["kind"] == kind]
    return d


def test_manifests_valid_against_kubernetes_schemas() -> None:
    version = kubernetes_validate.latest_version()
    core = [d for d in docs() if not d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert {d["kind"] for d in core} == {"Namespace", "ServiceAccount", "ConfigMap", "DaemonSet", "Service"}
    for d in core:
        kubernetes_validate.validate(d, version, strict=True)
    bad = copy.deepcopy(by_kind("DaemonSet"))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "9740"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, version, strict=True)


def test_prometheus_operator_objects() -> None:
    rule = by_kind("PrometheusRule")
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    mon = by_kind("ServiceMonitor")
    svc = by_kind("Service")
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert mon["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "metrics"
    assert (CHART / "files" / "kvwatch-rules.yaml").read_bytes() == RULES.read_bytes()  # the chart's copy


def test_daemonset_is_what_the_chart_defaults_say() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    spec = by_kind("DaemonSet")["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert spec["hostPID"] is True and spec["hostNetwork"] is values["hostNetwork"]
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["capabilities"] == {"drop": ["ALL"], "add": values["capabilities"]}
    assert c["resources"] == values["resources"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert f"0.0.0.0:{values['port']}" in c["args"]
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/sys/kernel/tracing", "/sys/kernel/btf", "/lib/modules", "/usr/src", "/host/proc"} <= mounts
    template = (CHART / "templates" / "daemonset.yaml").read_text()
    for m in mounts:
        assert f"mountPath: {m}" in template, m
    # the unit and the chart grant the same capabilities
    unit_caps = re.search(r"^CapabilityBoundingSet=(.*)$", UNIT.read_text(), re.M)
    assert unit_caps and sorted(unit_caps.group(1).split()) == sorted(f"CAP_{c}" for c in values["capabilities"])


def test_configmap_config_loads_in_kvwatch(tmp_path: Path) -> None:
    toml = tmp_path / "kvwatch.toml"
    toml.write_text(by_kind("ConfigMap")["data"]["kvwatch.toml"])
    cfg = load_config(toml, overrides={}, sets=[])
    assert str(cfg.discovery.proc_root) == "/host/proc" and cfg.alerts.alertmanager.url == ""


def test_values_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(values, schema)
    for key, bad in (
        ("port", 80),
        ("capabilities", ["NET_RAW"]),
        ("serviceMonitor", {"enabled": "yes"}),
        ("prometheusRule", {"enabled": True, "runbookBaseUrl": "ftp://x"}),
        ("nosuchkey", 1),
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**values, key: bad}, schema)


def test_chart_templates_use_only_defined_values() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "kvwatch"
    used = set()
    for t in (CHART / "templates").iterdir():
        text = t.read_text()
        assert "{{" not in re.sub(r"\{\{.*?\}\}", "", text, flags=re.S), t.name  # every action closed
        used |= set(re.findall(r"\.Values\.([A-Za-z0-9_.]+)", text))
    for path in used:
        node: Any = values
        for part in path.split("."):
            assert isinstance(node, dict) and part in node, f".Values.{path} not in values.yaml"
            node = node[part]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_unit_verifies(tmp_path: Path) -> None:
    kvwatch = Path(sys.executable).parent / "kvwatch"
    unit = tmp_path / "kvwatch.service"
    unit.write_text(UNIT.read_text().replace("/opt/kvwatch/venv/bin/kvwatch", str(kvwatch)))
    res = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, check=False)
    assert res.returncode == 0 and res.stdout + res.stderr == "", res.stdout + res.stderr
    res = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(unit)], capture_output=True, text=True, check=False
    )
    m = re.search(r"Overall exposure level for kvwatch.service: ([0-9.]+)", res.stdout)
    assert m and float(m.group(1)) <= 4.0, res.stdout[-500:]


def test_grafana_dashboard_covers_every_metric_family(monkeypatch: pytest.MonkeyPatch) -> None:
    dash = json.loads((DEPLOY / "grafana" / "kvwatch.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []) if "expr" in t)
    golden = (REPO / "tests" / "fixtures" / "golden_metrics.txt").read_text()
    families = set(re.findall(r"^# TYPE (kvwatch_\w+) ", golden, re.M))
    missing = [f for f in sorted(families) if f not in exprs]
    assert missing == [], missing
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "node", "engine", "pod"} <= names
    assert any("kvwatch_alert_active" in a.get("expr", "") for a in dash["annotations"]["list"])
    assert dash["uid"] == "kvwatch" and dash["schemaVersion"] >= 36
    for p in dash["panels"]:
        for t in p.get("targets", []):
            assert 'instance=~"$node"' in t["expr"], t["expr"]  # every panel follows the node picker
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    monkeypatch.syspath_prepend(DEPLOY / "grafana")  # as when run as a script: panels.py beside it
    spec = importlib.util.spec_from_file_location("generate", DEPLOY / "grafana" / "generate.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.render() == (DEPLOY / "grafana" / "kvwatch.json").read_text()  # regenerated, not edited by hand


def test_alert_rules_and_readme_table_are_generated_from_the_specs() -> None:
    """deploy/prometheus/generate.py's outputs are what is committed: the rules file, the chart's
    copy, the manifest's PrometheusRule and the README's table (edit the specs, regenerate)."""
    spec = importlib.util.spec_from_file_location("generate_rules", DEPLOY / "prometheus" / "generate.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    stale = [str(p.relative_to(REPO)) for p, text in gen.outputs().items() if p.read_text() != text]
    assert stale == [], "run deploy/prometheus/generate.py"
    rules = yaml.safe_load((DEPLOY / "prometheus" / "kvwatch-rules.yaml").read_text())
    names = [r["alert"] for g in rules["groups"] for r in g["rules"]]
    assert names == [s.name for s in gen.specs()] and len(set(names)) == len(names)
