"""An engine in its own network namespace (a pod, reached over a veth pair): kvwatch finds the
engine's address in that namespace (/proc/PID/net/fib_trie) and taps its KV event stream and
/metrics there, as a DaemonSet would on a Kubernetes node."""

from __future__ import annotations

from pathlib import Path

from kvwatch.daemon.lab.engine_sim_cli import SimulatedEngineProcess
from kvwatch.daemon.lab.netlab import pod_netns

from tests.support.daemon import daemon, wait_until
from tests.support.engine_sim import CONFIG, kv_config, quiesce


def test_engine_in_a_pod_namespace(tmp_path: Path) -> None:
    with pod_netns("kvp") as pod, daemon(tmp_path, CONFIG) as d:
        sim = SimulatedEngineProcess(tmp_path / "bin", http_port=8000, kv_events=kv_config(5557), netns=pod.netns)
        try:
            pid = str(sim.pid)
            wait_until(lambda: d.value("kvwatch_kv_event_stream_connected", pid=pid) == 1, 20, "stream connected")
            (labels,) = [lab for lab, _ in d.metrics()["kvwatch_kv_event_stream_connected"] if lab["pid"] == pid]
            assert labels["endpoint"] == f"tcp://{pod.pod_addr}:5557"  # not 127.0.0.1: the pod's own address
            wait_until(lambda: d.value("kvwatch_engine_scrapes_total", pid=pid, result="ok") > 0, 20, "scrape")
            sim.do("traffic 50 20 8 1")
            d.run_for(3)
            st = quiesce(sim, d)
            assert d.value("kvwatch_kv_blocks_stored_total", pid=pid, medium="GPU") == st["stored"] > 0
        finally:
            sim.close()
