"""The simulated vLLM as the integration tests drive it: a daemon configuration with short
detector windows, the traffic scenarios, and what kvwatch publishes about the engine (its
alerts, the causes it fired with, the stream's state)."""

from __future__ import annotations

from pathlib import Path

from kvwatch.daemon.lab.engine_sim_cli import SimulatedEngineProcess
from tests.support.daemon import DaemonProcess, free_port, wait_until


def engines_only(tick_seconds: float = 0.5) -> str:
    """The head of a config for the engine taps alone: kernel probes and NVML off (no BPF, no
    root), discovery every half second."""
    return f"""
[daemon]
tick_seconds = {tick_seconds}
[discovery]
interval_seconds = 0.5
nvml = "off"
[probes]
memory = []
cuda = false
transfer = false
"""


CONFIG = (
    engines_only()
    + """
[engines]
scrape_interval_seconds = 1.0
replay_timeout_seconds = 1.0
[detectors.eviction_burst]
warmup_seconds = 0
baseline_min_seconds = 8
window_seconds = 4
confirm_windows = 2
clear_windows = 2
quiet_after_reset_seconds = 10
[detectors.prefix_cache_ineffective]
warmup_seconds = 8            # a cold cache's first seconds share nothing yet
window_seconds = 6
min_queried_tokens = 1000
min_stored_blocks = 20
confirm_windows = 2
clear_windows = 2
[detectors.preemption_livelock]
warmup_seconds = 0
baseline_min_seconds = 5
window_seconds = 4
confirm_windows = 2
clear_windows = 2
"""
)
HOT = "traffic 20 250 8 0"  # 20 requests/s over 250 prefixes of 8 blocks: 2000 hot blocks, reused
IDLE = "traffic 0 1 1 0"


def kv_config(port: int, replay: int | None = None) -> dict[str, object]:
    cfg: dict[str, object] = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    if replay:
        cfg["replay_endpoint"] = f"tcp://*:{replay}"
    return cfg


def engine(tmp_path: Path, replay: bool = False, **kw: object) -> SimulatedEngineProcess:
    return SimulatedEngineProcess(
        tmp_path / "bin",
        http_port=free_port(),
        kv_events=kv_config(free_port(), free_port() if replay else None),
        **kw,  # type: ignore[arg-type]
    )


def alert(d: DaemonProcess, pid: int, name: str = "KVEvictionBurst") -> dict[str, str] | None:
    for labels, v in d.metrics().get("kvwatch_alert_active", []):
        if labels.get("alert") == name and labels.get("pid") == str(pid) and v == 1:
            return labels
    return None


def alert_values(d: DaemonProcess, pid: int, name: str) -> dict[str, float]:
    """The numbers of an alert's onset, from the daemon's log."""
    return next(
        e["values"]  # type: ignore[misc]
        for e in d.log_events()
        if e.get("event") == "alert firing" and e.get("alert") == name and e.get("label_pid") == str(pid)
    )


def fired(d: DaemonProcess, name: str) -> set[str]:
    """The causes an alert fired with, from the daemon's log."""
    return {str(e["cause"]) for e in d.log_events() if e.get("event") == "alert firing" and e.get("alert") == name}


def tapped(d: DaemonProcess, pid: int) -> None:
    wait_until(lambda: d.value("kvwatch_kv_event_stream_connected", pid=str(pid)) == 1, 20, "stream connected")
    wait_until(lambda: d.value("kvwatch_engine_scrapes_total", pid=str(pid), result="ok") > 0, 20, "first scrape")


def quiesce(sim: SimulatedEngineProcess, d: DaemonProcess) -> dict[str, int]:
    """Stop the engine's traffic and wait until kvwatch publishes every batch it sent; returns the
    engine's own counts (its answer to ``traffic`` comes after its last step of traffic)."""
    sim.do(IDLE)
    st = sim.stats()
    wait_until(
        lambda: d.value("kvwatch_kv_event_batches_total", pid=str(sim.pid)) >= st["batches"], 30, "all batches counted"
    )
    d.wait_ticks(2)  # the tick that took in the last batch has published what it says
    return st
