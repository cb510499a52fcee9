"""The KV metric-truth audit in ``kvwatch run``: a simulated vLLM with a CPU tier that tells the
truth (every window agrees, no alert), then under-reports its offload bytes by half
(KVEngineMetricDivergence fires, info, naming both numbers), then tells the truth again (clears).

Kernel probes are off (engine taps need no BPF), so no root is needed."""

from __future__ import annotations

from pathlib import Path

from kvwatch.daemon.lab.engine_sim import BLOCK_BYTES
from tests.support.daemon import DaemonProcess, daemon, wait_until
from tests.support.engine_sim import alert, engine, engines_only, tapped

CONFIG = (
    engines_only()
    + f"""
[engines]
scrape_interval_seconds = 1.0
kv_block_bytes = {BLOCK_BYTES}
[detectors.engine_metric_divergence]
window_seconds = 3
floor_bytes = 4194304
confirm_windows = 3
clear_windows = 2
"""
)
UNIQUE = "traffic 20 50 8 1"  # 20 requests/s of new 8-block prompts: every block offloaded once
ALERT = "KVEngineMetricDivergence"


def windows(d: DaemonProcess, pid: int, pair: str, result: str) -> float:
    return d.value("kvwatch_engine_metric_audit_windows_total", pid=str(pid), pair=pair, result=result)


def test_under_reported_offload_bytes_fire_and_clear(tmp_path: Path) -> None:
    with daemon(tmp_path, CONFIG) as d, engine(tmp_path, extra=["--kv-offloading-size", "1"]) as sim:
        tapped(d, sim.pid)
        sim.do(UNIQUE)
        pair = "offload_store_blocks"
        wait_until(lambda: windows(d, sim.pid, pair, "agree") >= 4, 60, "four agreeing windows")
        wait_until(lambda: windows(d, sim.pid, "resident_blocks", "agree") >= 4, 30, "resident bound judged")
        m = d.metrics()
        value = DaemonProcess.value_in(m)
        pid = str(sim.pid)
        assert value("kvwatch_engine_metric_audit_windows_total", pid=pid, result="diverge") == 0
        assert value("kvwatch_alerts_fired_total", alert=ALERT) == 0
        pool = value("kvwatch_engine_metric_audit_value", pid=pid, pair="resident_blocks", source="engine")
        resident = value("kvwatch_engine_metric_audit_value", pid=pid, pair="resident_blocks", source="kvwatch")
        assert pool == 4000 and 0 < resident <= pool

        sim.do("underreport 0.5")
        wait_until(lambda: alert(d, sim.pid, ALERT) is not None, 60, ALERT)
        labels = alert(d, sim.pid, ALERT)
        assert labels is not None and labels["cause"] == pair and labels["severity"] == "info"
        m = d.metrics()
        value = DaemonProcess.value_in(m)
        assert windows(d, sim.pid, pair, "diverge") >= 3
        engine_bytes = value("kvwatch_engine_metric_audit_value", pid=pid, pair=pair, source="engine")
        kvwatch_bytes = value("kvwatch_engine_metric_audit_value", pid=pid, pair=pair, source="kvwatch")
        ratio = value("kvwatch_engine_metric_divergence_ratio", pid=pid, pair=pair)
        assert engine_bytes < kvwatch_bytes and -0.6 < ratio < -0.4, (engine_bytes, kvwatch_bytes, ratio)
        firing = [e for e in d.log_events() if e.get("event") == "alert firing" and e.get("alert") == ALERT]
        assert firing and "vllm:kv_offload_store_bytes" in str(firing[0]["summary"])
        assert "KV event stream CPU blocks stored" in str(firing[0]["summary"])

        sim.do("underreport 1")
        wait_until(lambda: alert(d, sim.pid, ALERT) is None, 60, "cleared")
