"""Who reclaimed whose KV tier, on the real kernel: the pages a memory cgroup's limit forced out
are charged to the cgroup whose task ran the reclaim, and every reclaimed page to exactly one
reclaimer.

Two children of one limited parent: A's process reads the KV tier (its page cache is charged to
A), B's process allocates anonymous memory until the parent's limit makes B reclaim, and the
page cache it finds is A's. The ground truth is ``mincore`` on A's files."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvwatch.daemon.lab.memcg import MemoryCgroup
from kvwatch.daemon.lab.workloads import MIB, PAGE, drop_file_cache, make_files
from kvwatch.probes.memory import MemoryProbeOptions, MemoryProbes, kernel_dev
from kvwatch.probes.records import HookState, MemorySample, ReclaimerKey, TierCounters
from tests.support.daemon import wait_until
from tests.support.kernel import Child, resident_at_rest

TIER = 7
FILES, FILE_MB = 6, 32  # 192 MiB of KV in A
LIMIT_MB = 256  # the parent's: A's tier and B's memory cannot both fit
HOG_STEP_MB, HOG_STEPS = 32, 5  # B: 160 MiB in the squeeze, one step more during the deletion


@pytest.fixture
def probes() -> Iterator[MemoryProbes]:
    p = MemoryProbes()
    statuses = p.start()
    bad = [s for s in statuses if s.state is not HookState.ATTACHED]
    assert not bad, f"hooks not attached on this kernel: {bad}"
    yield p
    p.close()


def moved(s0: MemorySample, s1: MemorySample) -> tuple[int, int, int]:
    """(reclaim, policy, unattributed) pages of the test tier between two samples."""
    t0, t1 = s0.tiers.get(TIER, TierCounters(TIER)), s1.tiers.get(TIER, TierCounters(TIER))
    return (
        t1.reclaim_pages - t0.reclaim_pages,
        t1.policy_pages - t0.policy_pages,
        t1.unattributed_pages - t0.unattributed_pages,
    )


def by_reclaimer(s0: MemorySample, s1: MemorySample) -> dict[ReclaimerKey, int]:
    """Pages the test tier lost to each reclaimer between two samples."""
    out = {k: v - s0.reclaimers.get(k, 0) for k, v in s1.reclaimers.items() if k.tier_id == TIER}
    return {k: v for k, v in out.items() if v}


def at_rest(probes: MemoryProbes, files: list[Path]) -> tuple[MemorySample, int]:
    """A sample and the tier's residency, with no eviction between them."""
    s = [probes.sample()]

    def evicted() -> tuple[int, int]:
        s[0] = probes.sample()
        t = s[0].tiers.get(TIER, TierCounters(TIER))
        return t.reclaim_pages, t.policy_pages

    _, resident = resident_at_rest(files, evicted)
    return s[0], resident  # the sample read after the residency, equal to the one before


@dataclass
class Squeeze:
    """A's process holding the tier in A's page cache; B's process, in a sibling cgroup under
    the same limit, ready to allocate."""

    files: list[Path]
    a: MemoryCgroup
    b: MemoryCgroup
    hog: Child


@contextlib.contextmanager
def squeeze_setup(probes: MemoryProbes, kvdir: Path) -> Iterator[Squeeze]:
    files = make_files(kvdir, FILES, FILE_MB * MIB)
    drop_file_cache(files)  # the writer's pages leave before the tier is watched: A reads them in
    dev = kernel_dev(files[0].stat().st_dev)
    for f in files:
        assert probes.set_kv_inode(dev, f.stat().st_ino, TIER)
    with (
        MemoryCgroup(f"kvwatch-test-reclaimers-{os.getpid()}", LIMIT_MB * MIB) as parent,
        parent.child("A") as a,
        parent.child("B") as b,
        Child("read", *map(str, files)) as reader,
        Child("hog", "--mb", str(HOG_STEP_MB)) as hog,
    ):
        a.add(reader.pid)
        b.add(hog.pid)
        reader.step("go", "read")  # the tier in A's page cache
        yield Squeeze(files, a, b, hog)


def test_limit_reclaim_is_charged_to_the_cgroup_that_forced_it(probes: MemoryProbes, kvdir: Path) -> None:
    with squeeze_setup(probes, kvdir) as sq:
        files, a, b, hog = sq.files, sq.a, sq.b, sq.hog
        b_key = ReclaimerKey(TIER, "memcg", b.cgroup_id)
        s0, r0 = at_rest(probes, files)
        for _ in range(HOG_STEPS):
            hog.step("go", "held")  # B at the parent's limit: memcg reclaim, in B's context
        s1, r1 = at_rest(probes, files)
        reclaim, policy, unattributed = moved(s0, s1)
        who = by_reclaimer(s0, s1)
        print(f"squeeze: resident {r0} -> {r1}, reclaim {reclaim}, policy {policy}, by reclaimer {who}")
        assert r0 >= 0.95 * FILES * FILE_MB * MIB // PAGE, r0  # A really holds its tier
        assert r0 - r1 > 10_000, (r0, r1)  # tens of MiB squeezed out of A
        assert reclaim + policy == r0 - r1, (reclaim, policy, r0, r1)  # mincore closes exactly
        assert sum(who.values()) + unattributed == reclaim, (who, unattributed, reclaim)
        b_memcg = who.get(b_key, 0)
        a_any = sum(v for k, v in who.items() if k.cgroup_id == a.cgroup_id)
        # B's limit reclaim took the tier; node-wide pressure (kswapd, another task's direct
        # reclaim) may take a share on a busy machine, and is named as such
        assert b_memcg > reclaim // 2, (b.cgroup_id, who)
        assert a_any <= 0.01 * b_memcg, (a.cgroup_id, who)

        # A's tier deleted while B takes one step more: each page cached when the deletion began
        # leaves once, by the deletion (policy) or by B's reclaim when it got there first
        s2, r2 = at_rest(probes, files)
        hog.send("go")
        for f in files:
            f.unlink()
        hog.expect("held")

        wait_until(lambda: sum(moved(s2, probes.sample())[:2]) >= r2, 30, "every cached page counted as it left")
        s3 = probes.sample()
        reclaim, policy, unattributed = moved(s2, s3)
        who = by_reclaimer(s2, s3)
        print(f"deletion: resident {r2}, reclaim {reclaim}, policy {policy}, by reclaimer {who}")
        assert reclaim + policy == r2, (reclaim, policy, r2)
        assert sum(who.values()) + unattributed == reclaim, (who, unattributed, reclaim)
        assert not [k for k in who if k.cgroup_id == a.cgroup_id], who
    # over the whole test, every reclaimed page of the tier has exactly one reclaimer
    end = probes.sample()
    total = end.tiers[TIER]
    attributed = sum(v for k, v in end.reclaimers.items() if k.tier_id == TIER)
    assert attributed + total.unattributed_pages == total.reclaim_pages, (attributed, total)
    # B's cgroup is gone: its entry can be freed, and nothing else goes with it
    probes.forget_reclaimer(b_key)
    assert probes.reclaimers() == {k: v for k, v in end.reclaimers.items() if k != b_key}


def test_a_full_reclaimer_map_loses_no_page_of_the_tier(kvdir: Path) -> None:
    """With the reclaimer map full, the tier's reclaimed pages are counted unattributed (and the
    overflow as lost), never dropped."""
    probes = MemoryProbes(MemoryProbeOptions(max_reclaimers=1, features=frozenset({"pagecache", "reclaim"})))
    probes.start()
    try:
        table = probes.program.table("tier_reclaimers")
        table[table.Key(0, 63, 1)] = table.Leaf(0)  # the map's one entry taken by another tier
        with squeeze_setup(probes, kvdir) as sq:
            s0, r0 = at_rest(probes, sq.files)
            for _ in range(HOG_STEPS):
                sq.hog.step("go", "held")
            s1, r1 = at_rest(probes, sq.files)
        reclaim, policy, unattributed = moved(s0, s1)
        print(f"map full: resident {r0} -> {r1}, reclaim {reclaim}, unattributed {unattributed}")
        assert reclaim + policy == r0 - r1 and reclaim > 10_000, (reclaim, policy, r0, r1)
        assert unattributed == reclaim and by_reclaimer(s0, s1) == {}
        assert s1.lost["reclaimers_full"] > s0.lost["reclaimers_full"]
    finally:
        probes.close()
