"""The alert path end to end with Debian's real Prometheus and Alertmanager on loopback.

kvwatch watches the stub CUDA runtime; the workload turns the allocator into an
empty_cache() storm, the daemon's KVCacheReuseCollapse fires, and the test polls
Alertmanager's v2 API until the alert arrives twice, with the process's labels:

* through the rules path — Prometheus scrapes kvwatch, evaluates the shipped
  deploy/prometheus/kvwatch-rules.yaml and notifies Alertmanager;
* through the direct sink — the daemon posts to Alertmanager itself.

Also: promtool's checks on the real exposition and on the shipped rules and their tests.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvwatch.daemon.lab.workloads import workload_rule
from tests.support.daemon import daemon, free_port, wait_attached, wait_until
from tests.support.kernel import Child

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "kvwatch-rules.yaml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "kvwatch-rules.test.yaml"
PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.skipif(
    not (PROMETHEUS and ALERTMANAGER and PROMTOOL), reason="prometheus / alertmanager / promtool not installed"
)

CONFIG = r"""
[daemon]
tick_seconds = 0.5
[discovery]
interval_seconds = 0.5
rules = [{rule}]
[probes]
cuda_rescan_seconds = 1
[detectors.reuse_collapse]
warmup_seconds = 0.5
baseline_min_seconds = 2
window_seconds = 2
confirm_windows = 2
clear_windows = 2
[alerts.alertmanager]
url = "http://127.0.0.1:{am_port}"
resend_seconds = 2
labels = {{ cluster = "e2e" }}
"""


class Server:
    def __init__(self, name: str, cmd: list[str], log: Path, ready_url: str) -> None:
        self.name = name
        self.log = log
        self._out = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT)

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"{name} exited {self.proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(ready_url, timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(ready, 60, f"{name} ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._out.close()


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    assert ALERTMANAGER
    port = free_port()
    cfg = tmp_path / "alertmanager.yml"
    cfg.write_text(
        "route:\n  receiver: sink\n  group_by: [alertname]\n  group_wait: 1s\n  group_interval: 1s\n"
        "receivers:\n  - name: sink\n"
    )
    url = f"http://127.0.0.1:{port}"
    s = Server(
        "alertmanager",
        [
            ALERTMANAGER,
            f"--config.file={cfg}",
            f"--storage.path={tmp_path / 'am-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        tmp_path / "alertmanager.log",
        f"{url}/-/ready",
    )
    try:
        yield url
    finally:
        s.stop()


def prometheus(tmp_path: Path, kvwatch_port: int, am_url: str) -> Server:
    assert PROMETHEUS
    port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: ["{RULES}"]
alerting:
  alertmanagers:
    - static_configs:
        - targets: ["{am_url.removeprefix("http://")}"]
scrape_configs:
  - job_name: kvwatch
    static_configs:
      - targets: ["127.0.0.1:{kvwatch_port}"]
"""
    )
    return Server(
        "prometheus",
        [
            PROMETHEUS,
            f"--config.file={cfg}",
            f"--storage.tsdb.path={tmp_path / 'prom-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        tmp_path / "prometheus.log",
        f"http://127.0.0.1:{port}/-/ready",
    )


def am_alerts(am_url: str, name: str) -> list[dict[str, Any]]:
    return [a for a in get_json(f"{am_url}/api/v2/alerts") if a["labels"].get("alertname") == name]


def test_reuse_collapse_reaches_alertmanager_both_ways(tmp_path: Path, alertmanager: str, stub: Path) -> None:
    am_port = int(alertmanager.rsplit(":", 1)[1])
    with daemon(tmp_path, CONFIG.format(am_port=am_port, rule=workload_rule("stubengine", "cuda"))) as d:
        prom = prometheus(tmp_path, d.port, alertmanager)
        try:
            with Child("cuda", "--lib-dir", str(stub)) as w:
                w.expect("ready")
                wait_attached(d, w.pid)
                w.step("cached 1 3.5", "done", timeout=30)  # a quiet baseline
                assert am_alerts(alertmanager, "KVCacheReuseCollapse") == []
                t0 = time.monotonic()
                w.send("emptycache 40 8")

                def both() -> bool:
                    got = am_alerts(alertmanager, "KVCacheReuseCollapse")
                    return {a["labels"].get("source", "rules") for a in got} >= {"kvwatch", "rules"}

                wait_until(both, 30, "KVCacheReuseCollapse in Alertmanager from the rules and from the sink", 0.5)
                latency = time.monotonic() - t0
                print(f"onset -> both alerts in Alertmanager: {latency:.1f} s")
                got = am_alerts(alertmanager, "KVCacheReuseCollapse")
                (direct,) = [a for a in got if a["labels"].get("source") == "kvwatch"]
                (ruled,) = [a for a in got if "source" not in a["labels"]]
                for a in (direct, ruled):
                    lab = a["labels"]
                    assert (lab["pid"], lab["engine"], lab["cause"], lab["severity"]) == (
                        str(w.pid),
                        "stubengine",
                        "empty_cache",
                        "warning",
                    )
                    assert a["annotations"]["runbook_url"].endswith("docs/runbook.md#kvcachereusecollapse")
                    assert a["status"]["state"] == "active"
                assert direct["labels"]["cluster"] == "e2e"  # the sink's configured labels
                assert ruled["labels"]["job"] == "kvwatch" and ruled["labels"]["instance"] == f"127.0.0.1:{d.port}"
                assert f"pid {w.pid}" in ruled["annotations"]["summary"]
                assert latency < 20, latency
                assert d.value("kvwatch_alertmanager_alerts_total", result="sent") >= 1
                assert d.value("kvwatch_alertmanager_alerts_total", result="dropped") == 0
                w.expect("done", timeout=30)
        finally:
            prom.stop()


def test_promtool_on_the_real_exposition_and_the_shipped_rules(tmp_path: Path) -> None:
    assert PROMTOOL
    with daemon(tmp_path, "[daemon]\ntick_seconds = 0.5\n") as d:
        body = d.get("/metrics")[1]
    res = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True, text=True, check=False)
    assert res.returncode == 0 and res.stdout.strip() == "" and res.stderr.strip() == "", res.stdout + res.stderr
    res = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, check=False)
    rules = RULES.read_text().count("\n      - alert: ")
    assert rules == 14 and f"SUCCESS: {rules} rules found" in res.stdout, res.stdout + res.stderr  # promtool read each
    res = subprocess.run(
        [PROMTOOL, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, check=False, cwd=RULES.parent
    )
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr


def test_every_alert_name_has_a_rule_and_a_runbook_section() -> None:
    from kvwatch.daemon.config import DetectorsConfig
    from kvwatch.daemon.detectors.registry import alert_names, build_detectors

    rules = RULES.read_text()
    runbook = (REPO / "docs" / "runbook.md").read_text()
    for name in alert_names(build_detectors(DetectorsConfig(), 0.0)):
        assert f"- alert: {name}\n" in rules, name
        assert f"\n## {name}\n" in runbook, name
        assert f"runbook.md#{name.lower()}" in rules, name
