"""An engine in its own network namespace (a pod, reached over a veth pair): kvwatch finds the
engine's address in that namespace (/proc/PID/net/fib_trie) and taps its KV event stream and
/metrics there, as a DaemonSet would on a Kubernetes node; an address a command line names is
scraped only when it is the process's own."""

from __future__ import annotations

import subprocess
import sys
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


def test_a_pod_address_is_scraped_only_for_the_pods_own_engine(tmp_path: Path) -> None:
    """A process in the node's namespace names a pod's address as its own ``--host``: that is
    another process's engine, whose numbers it would pass off as its own (kvwatch gives an
    endpoint to the oldest process naming it). Refused and counted; the engine in the pod,
    started after it and naming its pod address, is scraped there as its own."""
    liar_script = tmp_path / "liar" / "vllm"
    liar_script.parent.mkdir()
    liar_script.write_text(f"#!{sys.executable}\nimport sys\nsys.stdin.read()\n")  # looks like vLLM, serves nothing
    liar_script.chmod(0o755)
    with pod_netns("kvq", subnet=96) as pod, daemon(tmp_path, CONFIG) as d:
        argv = [str(liar_script), "serve", "m", "--host", pod.pod_addr, "--port", "8000"]
        liar = subprocess.Popen(argv, stdin=subprocess.PIPE)
        sim = None
        try:
            liar_pid = str(liar.pid)
            wait_until(
                lambda: d.value("kvwatch_engine_taps_refused", pid=liar_pid, reason="metrics_host") == 1,
                20,
                "the liar's --host refused",
            )
            sim = SimulatedEngineProcess(
                tmp_path / "bin", http_port=8000, kv_events=None, netns=pod.netns, extra=["--host", pod.pod_addr]
            )
            pid = str(sim.pid)
            wait_until(lambda: d.value("kvwatch_engine_scrapes_total", pid=pid, result="ok") > 0, 20, "pod scraped")
            scrapes = d.metrics().get("kvwatch_engine_scrapes_total", [])
            assert [lab for lab, _ in scrapes if lab["pid"] == liar_pid] == []
        finally:
            liar.kill()
            liar.wait()
            if sim is not None:
                sim.close()
