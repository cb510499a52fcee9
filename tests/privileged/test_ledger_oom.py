"""The loss ledger's oom row on the real kernel: a simulated vLLM holding KV blocks is OOM-killed
in its memory cgroup; its resident blocks are lost with cause oom, and the row outlives the
process (engines.loss_linger_seconds) so a scrape sees it."""

from __future__ import annotations

import os
from pathlib import Path

from kvwatch.daemon.lab.memcg import MemoryCgroup
from kvwatch.daemon.lab.workloads import MIB
from tests.support.daemon import daemon, wait_until, watched
from tests.support.engine_sim import engine, quiesce, tapped

CONFIG = """
[daemon]
tick_seconds = 0.5
[discovery]
interval_seconds = 0.5
nvml = "off"
[probes]
cuda = false
transfer = false
[engines]
scrape_interval_seconds = 1.0
"""


def test_oom_kill_loses_the_resident_blocks(tmp_path: Path) -> None:
    with daemon(tmp_path, CONFIG) as d, engine(tmp_path) as sim:
        tapped(d, sim.pid)
        pid = str(sim.pid)
        sim.do("traffic 20 10 4 0")  # 10 shared prefixes of 4 blocks: the cache fills, then hits
        d.run_for(3)
        quiesce(sim, d)
        resident = d.value("kvwatch_kv_blocks_stored_total", pid=pid, medium="GPU") - d.value(
            "kvwatch_kv_blocks_removed_total", pid=pid, medium="GPU"
        )
        assert resident > 0
        with MemoryCgroup(f"kvwatch-e2e-oom-engine-{os.getpid()}", 200 * MIB) as cg:
            cg.add(sim.pid)  # what it used before stays charged where it was: 200 MiB from here
            sim._in.write("balloon 400\n")
            sim._in.flush()
            sim.proc.wait(30)
            wait_until(lambda: d.value("kvwatch_oom_kills_total", engine="vllm") == 1, 10, "OOM counted")
            wait_until(lambda: not watched(d, sim.pid), 10, "the killed engine left the snapshot")
            assert d.value("kvwatch_kv_lost_blocks_total", pid=pid, tier="gpu", cause="oom") == resident
