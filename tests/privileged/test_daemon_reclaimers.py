"""`kvwatch run` names who squeezed a KV tier: the cgroup whose limit reclaim evicted it, by its
cgroup v2 path, on ``kvwatch_pagecache_reclaimed_bytes_total``, whose rows add up to the tier's
reclaimed bytes."""

from __future__ import annotations

import os
from pathlib import Path

from kvwatch.daemon.lab.memcg import MemoryCgroup
from kvwatch.daemon.lab.workloads import MIB, PAGE, drop_file_cache, make_files
from tests.support.daemon import DaemonProcess, daemon, wait_until
from tests.support.kernel import Child, resident_at_rest

TOML = """
[daemon]
tick_seconds = 0.5
[discovery]
interval_seconds = 0.5
[kv_tiers]
dirs = [{{ path = "{kvdir}", name = "test-tier" }}]
rescan_seconds = 1
"""


def rows(d: DaemonProcess) -> tuple[float, dict[tuple[str, str, str], float]]:
    """From one scrape: the tier's reclaimed bytes, and its rows by (reclaimer, scope, cgroup)."""
    m = d.metrics()
    total = d.value_in(m)("kvwatch_pagecache_evicted_bytes_total", tier="test-tier", cause="reclaim")
    by = {
        (lab["reclaimer"], lab["scope"], lab["reclaimer_cgroup"]): v
        for lab, v in m.get("kvwatch_pagecache_reclaimed_bytes_total", [])
        if lab["tier"] == "test-tier"
    }
    return total, by


def test_the_cgroup_that_squeezed_the_tier_is_named(tmp_path: Path, kvdir: Path) -> None:
    files = make_files(kvdir, 6, 32 * MIB)
    drop_file_cache(files)
    with daemon(tmp_path, TOML.format(kvdir=kvdir)) as d:
        wait_until(lambda: d.value("kvwatch_kv_tier_files", tier="test-tier") == 6, 10, "tier files tracked")
        with (
            MemoryCgroup(f"kvwatch-e2e-reclaimers-{os.getpid()}", 256 * MIB) as parent,
            parent.child("A") as a,
            parent.child("B") as b,
            Child("read", *map(str, files)) as reader,
            Child("hog", "--mb", "32") as hog,
        ):
            a.add(reader.pid)
            b.add(hog.pid)
            reader.step("go", "read")

            def published() -> tuple[float, dict[tuple[str, str, str], float]]:
                return d.settled(lambda: rows(d))  # every eviction before the call is in it

            # nothing deletes the tier: what left it between two readings at rest is reclaim
            (total0, _), r0 = resident_at_rest(files, published)
            for _ in range(5):
                hog.step("go", "held")  # B at the parent's limit: memcg reclaim of A's tier
            (total, by), r1 = resident_at_rest(files, published)
            print(f"squeezed {(r0 - r1) * PAGE} bytes; rows {by}")
            assert (r0 - r1) * PAGE > 40 * MIB, (r0, r1)
            assert total - total0 == (r0 - r1) * PAGE, (total0, total, r0, r1)  # closes against mincore
            assert sum(by.values()) == total, (total, by)
            b_row = by.get(("cgroup", "memcg", f"/{b.name}"), 0.0)  # its path under the v2 mount
            assert b_row > total / 2, by
            assert not [k for k in by if k[2] == f"/{a.name}"], by
