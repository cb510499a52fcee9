"""LMCache's disk tier on the real kernel, replayed from the H200 run
(tests/gpu/results/h200-2026-12-02-issue25-lmcache) at a size this machine holds.

A stand-in for vLLM with LMCache in process (tests/support/lmcache_standin.py): a ``vllm serve``
command line, ``LMCACHE_CONFIG_FILE`` in its environment naming the disk tier, its /metrics the
page LMCache served at the end of that run, its chunk files written, read back and deleted as
LMCache's LocalDiskBackend does. kvwatch runs with no KV directory configured. As on the H200:
the tier is found from the engine's config; a hog in the engine's memory cgroup while the
chunks are read back raises KVHostTierEvictionUnderPressure; what the kernel took at rest is
exactly mincore's residency lost, in the tier's counter, the loss ledger and the reclaimer's row;
LMCache deleting its oldest chunks at its size limit is ``policy`` and raises nothing.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from kvwatch.daemon.lab.memcg import MemoryCgroup
from kvwatch.daemon.lab.workloads import MIB, resident_total
from tests.support.daemon import DaemonProcess, daemon, wait_until
from tests.support.kernel import Child
from tests.support.vllm_replay import Pages, serve

PAGE = 4096
CHUNK_MIB = 8  # LMCache's chunk of 256 tokens of the tiny model: 8 MiB, as on the H200
CHUNKS = 29
EVICTED = 7
ALERT = "KVHostTierEvictionUnderPressure"
PAGE_FILE = Path(__file__).parent.parent / "fixtures" / "engine_metrics" / "lmcache-0.5.3-h200.txt"
STANDIN = Path(__file__).parent.parent / "support" / "lmcache_standin.py"

TOML = """
[daemon]
tick_seconds = 0.5
[discovery]
interval_seconds = 0.5
[engines]
scrape_interval_seconds = 0.5
[kv_tiers]
rescan_seconds = 1
[detectors.host_tier_eviction]
warmup_seconds = 0
window_seconds = 2
floor_bytes_per_second = 33554432
"""


@contextlib.contextmanager
def metrics_page(text: str) -> Iterator[int]:
    """The page LMCache served, at every scrape (the replay's server, one page)."""
    srv = serve(Pages([[0.0, text]]))
    try:
        yield srv.server_port
    finally:
        srv.shutdown()
        srv.server_close()


class StandIn(Child):
    """The stand-in run as a console script named ``vllm``, as pip installs vLLM: discovery's rule
    is anchored at the program."""

    def __init__(self, bin_dir: Path, port: int, config: Path) -> None:  # the workload protocol, another program
        bin_dir.mkdir(parents=True, exist_ok=True)
        script = bin_dir / "vllm"
        script.write_text(f'#!{sys.executable}\nimport runpy\nrunpy.run_path("{STANDIN}", run_name="__main__")\n')
        script.chmod(0o755)
        argv = [str(script), "serve", "/tmp/tiny", "--host", "127.0.0.1", "--port", str(port)]
        env = {**os.environ, "LMCACHE_CONFIG_FILE": str(config), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in, self._out = self.proc.stdin, self.proc.stdout


def counters(d: DaemonProcess, tier: str) -> tuple[float, float, float, float, float]:
    """(reclaim, policy, ledger disk/reclaim, every reclaimer's row, the memory cgroups' rows) of one scrape."""
    v = d.value_in(d.metrics())
    return (
        v("kvwatch_pagecache_evicted_bytes_total", tier=tier, cause="reclaim"),
        v("kvwatch_pagecache_evicted_bytes_total", tier=tier, cause="policy"),
        v("kvwatch_kv_lost_bytes_total", tier="disk", cause="reclaim"),
        v("kvwatch_pagecache_reclaimed_bytes_total", tier=tier),
        v("kvwatch_pagecache_reclaimed_bytes_total", tier=tier, reclaimer="cgroup", scope="memcg"),
    )


def at_rest(d: DaemonProcess, tier: str, files: list[Path]) -> tuple[tuple[float, ...], int]:
    """kvwatch's counts and mincore's pages, read while nothing left the page cache: the counts
    settled over three ticks before mincore looked and the same two ticks after."""
    for _ in range(20):
        before = d.settled(lambda: counters(d, tier))
        pages = resident_total(files)
        d.wait_ticks(2)
        if counters(d, tier) == before and resident_total(files) == pages:
            return before, pages
    raise AssertionError("the tier's pages kept leaving")


def test_lmcache_disk_tier_squeezed_then_evicted_by_lmcache(tmp_path: Path, kvdir: Path) -> None:
    config = tmp_path / "lmcache.yaml"
    config.write_text(f'chunk_size: 256\nlocal_cpu: true\nlocal_disk: "file://{kvdir}/"\nmax_local_disk_size: 3.0\n')
    tier = f"lmcache:{kvdir}"
    chunk = CHUNK_MIB * MIB
    with (
        metrics_page(PAGE_FILE.read_text()) as port,
        daemon(tmp_path, TOML) as d,
        MemoryCgroup(f"kvwatch-lmcache-{os.getpid()}", None) as cg,
        StandIn(tmp_path / "bin", port, config) as eng,
    ):
        cg.add(eng.pid)
        pid = str(eng.pid)
        wait_until(
            lambda: any(lab["tier"] == tier for lab, _ in d.metrics().get("kvwatch_kv_tier_files", [])),
            20,
            "tier found",
        )
        eng.step(f"write {CHUNKS} {CHUNK_MIB}", "written")
        os.sync()  # the run's chunks were minutes old when the squeeze came: written back
        files = sorted(kvdir.iterdir())
        assert len(files) == CHUNKS
        wait_until(lambda: d.value("kvwatch_kv_tier_files", tier=tier) == CHUNKS, 10, "every chunk file tracked")
        wait_until(lambda: d.value("kvwatch_engine_kv_tier_used_bytes", pid=pid, tier="disk") > 0, 20, "scraped")
        assert d.value("kvwatch_engine_kv_tier_used_bytes", pid=pid, tier="disk", source="lmcache") == 384 * chunk
        eng.step("reads on", "ok")
        d.run_for(3)
        assert d.value("kvwatch_alert_active", alert=ALERT) == 0

        # the squeeze: the cgroup held to what it has, a hog grows inside it while chunks are read
        cg_limit(cg, cg.usage() + 16 * MIB)
        eng.step(f"hog {CHUNKS * CHUNK_MIB * 6 // 10} 200", "held", timeout=60)
        wait_until(lambda: d.value("kvwatch_alert_active", alert=ALERT) == 1, 30, ALERT)
        (labels,) = [lab for lab, v in d.metrics()["kvwatch_alert_active"] if lab["alert"] == ALERT and v == 1]
        assert (labels["tier"], labels["pid"], labels["engine"]) == (tier, pid, "vllm")
        assert labels["cause"] in ("refault", "reclaim_stall", "psi")
        assert d.value("kvwatch_pagecache_refault_pages_total", tier=tier) > 0

        # at rest: no reads; more of the hog takes page cache, counted exactly against mincore
        eng.step("reads off", "ok")
        before, pages0 = at_rest(d, tier, files)
        eng.step(f"hog {pages0 * PAGE // MIB // 2} 200", "held", timeout=60)
        after, pages1 = at_rest(d, tier, files)
        lost = (pages0 - pages1) * PAGE
        assert lost > 0
        reclaim, policy, ledger, reclaimers, memcg = (a - b for a, b in zip(after, before, strict=True))
        assert (reclaim, policy, ledger, reclaimers) == (lost, 0, lost, lost)
        # the hog's limit reclaimed them, apart from what kswapd or DAMON's proactive reclaim took meanwhile
        assert 0 < memcg <= lost

        # release, then LMCache at its size limit: its oldest chunks deleted, policy, no alert
        eng.step("free", "freed")
        cg_limit(cg, None)
        wait_until(lambda: d.value("kvwatch_alert_active", alert=ALERT) == 0, 30, "the alert clears")
        fired = d.value("kvwatch_alerts_fired_total", alert=ALERT)
        # the chunks to be deleted read back whole first: after the squeeze few of their pages are
        # left, and the kernel's background reclaim (kswapd, DAMON) may take those few before the
        # deletion, leaving nothing for the deletion itself to count
        for f in files[:EVICTED]:
            f.read_bytes()
        (reclaim0, policy0, *_), cached = at_rest(d, tier, files[:EVICTED])
        assert cached * PAGE > EVICTED * CHUNK_MIB * MIB // 2, cached
        eng.step(f"evict {EVICTED}", "evicted")

        def gone() -> tuple[float, float]:
            reclaim, policy, *_ = counters(d, tier)
            return reclaim - reclaim0, policy - policy0

        wait_until(lambda: sum(gone()) >= cached * PAGE, 30, "every cached page of the deleted chunks counted")
        d.run_for(3)
        reclaim, policy = gone()
        # each page cached when LMCache deleted its file left by the deletion (policy) or, taken
        # by reclaim first (kswapd, DAMON), by reclaim; reclaim may also take other chunks' pages
        assert policy <= cached * PAGE <= policy + reclaim, (policy, reclaim, cached)
        assert policy > 0
        assert d.value("kvwatch_kv_tier_files", tier=tier) == CHUNKS - EVICTED
        assert d.value("kvwatch_alerts_fired_total", alert=ALERT) == fired
        assert d.value("kvwatch_alert_active", alert=ALERT) == 0
        eng.send("quit")


def cg_limit(cg: MemoryCgroup, limit: int | None) -> None:
    if cg.version == 2:
        (cg.path / "memory.max").write_text("max" if limit is None else str(limit))
    else:
        (cg.path / "memory.limit_in_bytes").write_text("-1" if limit is None else str(limit))
