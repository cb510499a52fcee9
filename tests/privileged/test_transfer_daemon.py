"""A real KV-transfer slowdown: two NIXL peers in network namespaces joined by a veth pair,
UCX forced onto TCP, the link throttled mid-run with `tc tbf` (netem is not built into
this kernel). KVTransferBandwidthCollapse must fire during the throttled phase and not
before, and clear once the throttle is released."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvwatch.daemon.lab.netlab import Link, veth_pair
from kvwatch.daemon.lab.nixl_peer import NixlPeer
from kvwatch.daemon.lab.workloads import workload_rule
from tests.support.daemon import DaemonProcess, daemon, wait_attached, wait_until

SIZE = 2 << 20
RULE = workload_rule("nixltest", "initiator", module="nixl_peer")
CONFIG = rf"""
[daemon]
tick_seconds = 0.5
[discovery]
interval_seconds = 0.5
rules = [{RULE}]
[probes]
transfer_rescan_seconds = 1
[detectors.transfer_collapse]
warmup_seconds = 0
baseline_min_seconds = 3
window_seconds = 3
min_transfers = 10
peer_grace_seconds = 1
confirm_windows = 2
clear_windows = 2
"""


@pytest.fixture
def link() -> Iterator[Link]:
    with veth_pair("kvt") as net:
        yield net


def collapse_active(d: DaemonProcess, pid: int) -> bool:
    return d.value("kvwatch_alert_active", alert="KVTransferBandwidthCollapse", pid=str(pid)) == 1


def test_throttled_link_fires_and_release_clears(tmp_path: Path, link: Link) -> None:
    meta = tmp_path / "meta.json"
    tcp = {"UCX_TLS": "tcp"}
    target = NixlPeer("target", meta, SIZE, netns=link.b, env={**tcp, "UCX_NET_DEVICES": link.dev_b})
    with daemon(tmp_path, CONFIG) as d:
        init = NixlPeer("initiator", meta, SIZE, handles=64, netns=link.a, env={**tcp, "UCX_NET_DEVICES": link.dev_a})
        try:
            wait_attached(d, init.pid, family="transfer")
            base = init.ask("rate 20 8")  # ~40 MB/s over a ~1 GB/s link: the normal
            assert base["errors"] == 0 and base["completed"] == base["posted"] > 100
            assert not collapse_active(d, init.pid)
            assert d.value("kvwatch_alerts_fired_total", alert="KVTransferBandwidthCollapse") == 0

            def moved() -> float:
                return d.value("kvwatch_transfer_bytes_total", pid=str(init.pid), lib="nixl", op="write")

            assert d.settled(moved) == base["bytes"]  # every byte the application moved, and nothing else

            link.throttle("100mbit")  # 12.5 MB/s: demand now exceeds the link
            result: dict[str, Any] = {}
            runner = threading.Thread(target=lambda: result.update(init.ask("rate 20 8")))
            t0 = time.monotonic()
            runner.start()
            seen: list[tuple[float, float, float]] = []

            def fired() -> bool:
                seen.append(
                    (
                        round(time.monotonic() - t0, 1),
                        d.value("kvwatch_transfer_effective_bandwidth_bytes", pid=str(init.pid)) / 1e6,
                        d.value("kvwatch_transfer_completed_total", pid=str(init.pid)),
                    )
                )
                return collapse_active(d, init.pid)

            # while the throttled run lasts (8 s of demand): how soon is bench_detection's
            wait_until(lambda: fired() or not runner.is_alive(), 60, "the alert or the run's end", interval=0.5)
            assert fired(), f"no KVTransferBandwidthCollapse during the throttle; (t, MB/s, completed): {seen}"
            runner.join(60)
            lab = next(
                lab
                for lab, v in d.metrics()["kvwatch_alert_active"]
                if lab["alert"] == "KVTransferBandwidthCollapse" and v == 1
            )
            assert lab["engine"] == "nixltest" and lab["cause"] == "bandwidth"
            assert result["posted"] > 40  # demand held: the application kept posting

            link.release()
            init.ask("rate 20 10")
            wait_until(lambda: not collapse_active(d, init.pid), 10, "alert cleared after the release")
            assert d.value("kvwatch_alerts_fired_total", alert="KVTransferBandwidthCollapse") == 1
            events = [e for e in d.log_events() if e.get("alert") == "KVTransferBandwidthCollapse"]
            assert [e["event"] for e in events] == ["alert firing", "alert resolved"]
        finally:
            init.close()
            target.close()
