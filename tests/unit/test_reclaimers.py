"""Who reclaimed a KV tier (daemon/families/reclaimers.py): cgroup ids resolved against a cgroup
tree in tmp_path, the rows folded under the cap, rows that only grow, and entries of gone
cgroups freed without losing a page."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kvwatch.daemon.families.reclaimers import (
    UNKNOWN,
    CgroupPaths,
    Reclaimer,
    ReclaimerBook,
    TierReclaimers,
    other,
    reclaimer_of,
)
from kvwatch.daemon.host.procfs import ProcFS
from kvwatch.probes.records import ReclaimerKey

POD = "8d4e1f2a-1b2c-4d5e-8f90-123456789abc"
CONTAINER = "0123456789abcdef" * 4
KUBE = (
    f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD.replace('-', '_')}.slice"
    f"/cri-containerd-{CONTAINER}.scope"
)


def tree(root: Path, *paths: str) -> dict[str, int]:
    """Cgroup directories under ``root``; path → id (the directory's inode)."""
    root.mkdir(exist_ok=True)
    out = {"/": root.stat().st_ino}
    for p in paths:
        d = root / p.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        out[p] = d.stat().st_ino
    return out


def test_ids_resolve_to_paths_by_inode_walking_once_a_tick(tmp_path: Path) -> None:
    procfs = ProcFS(tmp_path)
    mount = tmp_path / "cgroup"
    ids = tree(mount, "/parent/A", "/parent/B", KUBE)
    walks: list[Path] = []

    def walk(m: Path) -> list[tuple[int, str]]:
        walks.append(m)
        return list(procfs.cgroup2_dirs(m))

    paths = CgroupPaths(mount, walk)
    assert paths.path(ids["/parent/B"], 1.0) == "/parent/B"
    assert paths.path(ids[KUBE], 1.0) == KUBE and paths.path(ids["/"], 1.0) == "/"
    assert len(walks) == 1  # one walk answered all three
    ids |= tree(mount, "/parent/C")  # made after the walk: the next tick's miss walks again
    assert paths.path(ids["/parent/C"], 1.0) is None  # not twice in one tick
    assert paths.path(ids["/parent/C"], 2.0) is None  # an id a walk did not find is not looked for again
    assert len(walks) == 1
    paths.forget(ids["/parent/C"])
    assert paths.path(ids["/parent/C"], 3.0) == "/parent/C" and len(walks) == 2
    ids |= tree(mount, "/parent/D")
    (mount / "parent" / "D").rmdir()  # came and went between two walks
    assert paths.path(ids["/parent/D"], 4.0) is None and len(walks) == 3
    (mount / "parent" / "A").rmdir()
    assert paths.path(ids["/parent/A"], 5.0) == "/parent/A"  # a path found is kept
    assert procfs.cgroup2_id(mount, "/parent/B") == ids["/parent/B"]
    assert procfs.cgroup2_id(mount, "/parent/A") is None
    assert CgroupPaths(None, walk).path(ids["/parent/B"], 6.0) is None and len(walks) == 3  # no v2 hierarchy


def test_the_hosts_hierarchy_is_found_through_pid_1(tmp_path: Path) -> None:
    info = "30 20 0:26 / {m} rw,relatime shared:4 - cgroup2 cgroup2 rw\n"
    (tmp_path / "proc" / "1" / "root" / "sys" / "fs" / "cgroup" / "unified").mkdir(parents=True)
    (tmp_path / "proc" / "1" / "mountinfo").write_text(info.format(m="/sys/fs/cgroup/unified"))
    (tmp_path / "proc" / "self").mkdir()
    (tmp_path / "proc" / "self" / "mountinfo").write_text(info.format(m="/sys/fs/cgroup"))
    procfs = ProcFS(tmp_path)
    assert procfs.host_cgroup2_mount() == tmp_path / "proc" / "1" / "root" / "sys" / "fs" / "cgroup" / "unified"
    (tmp_path / "proc" / "1" / "mountinfo").unlink()  # PID 1 out of reach: kvwatch's own mount
    assert procfs.host_cgroup2_mount() == tmp_path / "sys" / "fs" / "cgroup"


def test_rows_name_the_reclaimer() -> None:
    assert reclaimer_of(ReclaimerKey(0, "kswapd", 0), None) == Reclaimer("kswapd", "global")
    assert reclaimer_of(ReclaimerKey(0, "kdamond", 0), None) == Reclaimer("kdamond", "global")
    assert reclaimer_of(ReclaimerKey(0, "memcg", 9), KUBE) == Reclaimer("cgroup", "memcg", KUBE, POD, CONTAINER[:12])
    assert reclaimer_of(ReclaimerKey(0, "direct", 9), "/parent/B") == Reclaimer("cgroup", "global", "/parent/B")
    assert reclaimer_of(ReclaimerKey(0, "memcg", 9), None) == Reclaimer("cgroup", "memcg", "cgroup-id:9")
    assert reclaimer_of(ReclaimerKey(0, "what", 9), None) == UNKNOWN


def cg(name: str, scope: str = "memcg") -> Reclaimer:
    return Reclaimer("cgroup", scope, f"/{name}")


def key(cgroup_id: int, kind: str = "memcg", tier: int = 0) -> ReclaimerKey:
    return ReclaimerKey(tier, kind, cgroup_id)


def label(k: ReclaimerKey) -> Reclaimer:
    return reclaimer_of(k, f"/g{k.cgroup_id}")


def test_the_largest_are_named_the_rest_folded_into_other_and_rows_stay() -> None:
    book = ReclaimerBook(named_per_tier=2)
    book.update({key(1): 10, key(2): 300, key(3): 200, key(4, "kswapd"): 5}, {}, label, 1.0)
    assert book.rows(0) == {cg("g2"): 300, cg("g3"): 200, other("memcg"): 10, Reclaimer("kswapd", "global"): 5}
    # g1 grows past the named ones: it stays in other, which never gives pages back
    book.update({key(1): 1000, key(2): 301, key(3): 200, key(4, "kswapd"): 5, key(5, "direct"): 7}, {0: 3}, label, 2.0)
    assert book.rows(0) == {
        cg("g2"): 301,
        cg("g3"): 200,
        other("memcg"): 1000,
        other("global"): 7,
        Reclaimer("kswapd", "global"): 5,
        UNKNOWN: 3,
    }
    # a second tier has a cap of its own; kernel threads take no place in it
    book.update({key(1, tier=1): 4}, {}, label, 3.0)
    assert book.rows(1) == {cg("g1"): 4}


def test_a_gone_cgroup_is_freed_lingers_then_makes_room() -> None:
    book = ReclaimerBook(named_per_tier=1, linger_seconds=100.0)
    book.update({key(1): 10}, {}, label, 1.0)
    alive = {"/g1": 1}

    def exists(path: str, cgroup_id: int) -> bool:
        return alive.get(path) == cgroup_id

    assert book.gone(1.0, exists) == []  # just read
    book.update({key(1): 12}, {}, label, 2.0)
    del alive["/g1"]
    assert book.gone(2.0, exists) == []  # it moved at the last read
    book.update({key(1): 12}, {}, label, 3.0)
    assert book.gone(3.0, exists) == [key(1)]
    book.forget([key(1)], 3.0)
    book.update({key(2): 5}, {}, label, 4.0)  # no room while g1 lingers
    assert book.rows(0) == {cg("g1"): 12, other("memcg"): 5}
    assert book.expire(50.0) == []
    assert book.expire(103.0) == [(0, cg("g1"))]
    assert book.rows(0) == {other("memcg"): 17}  # its pages kept, in other
    book.update({key(2): 5, key(3): 1}, {}, label, 104.0)
    assert book.rows(0) == {other("memcg"): 17, cg("g3"): 1}  # g3 gets the room; g2 stays in other


def test_a_cgroup_never_found_is_freed_after_standing_still_and_counts_again_from_zero() -> None:
    book = ReclaimerBook(linger_seconds=100.0)
    never = lambda k: reclaimer_of(k, None)  # noqa: E731
    book.update({key(7): 10}, {}, never, 1.0)
    book.update({key(7): 10}, {}, never, 50.0)
    assert book.gone(50.0, lambda p, i: False) == []
    book.update({key(7): 10}, {}, never, 101.0)
    assert book.gone(101.0, lambda p, i: False) == [key(7)]
    book.forget([key(7)], 101.0)
    book.update({key(7): 3}, {}, never, 102.0)  # counted again after the kernel freed it
    assert book.rows(0) == {Reclaimer("cgroup", "memcg", "cgroup-id:7"): 13}


class FakeKernel:
    def __init__(self) -> None:
        self.freed: list[ReclaimerKey] = []

    def forget_reclaimer(self, key: ReclaimerKey) -> None:
        self.freed.append(key)


def test_the_keeper_frees_gone_entries_in_the_kernel(tmp_path: Path) -> None:
    procfs = ProcFS(tmp_path)
    ids = tree(tmp_path, "/a", "/b")
    kernel = FakeKernel()

    def exists(path: str, cgroup_id: int) -> bool:
        return procfs.cgroup2_id(tmp_path, path) == cgroup_id

    keeper = TierReclaimers(kernel, CgroupPaths(tmp_path, procfs.cgroup2_dirs), exists)
    counts = {key(ids["/a"]): 4, key(ids["/b"]): 9}
    keeper.ingest(counts, {}, 0.0)
    (tmp_path / "a").rmdir()
    assert keeper.ingest(counts, {}, 10.0) == []
    assert kernel.freed == []  # checked every 30 s
    assert keeper.ingest(counts, {}, 31.0) == []
    assert kernel.freed == [key(ids["/a"])]
    assert keeper.book.rows(0) == {Reclaimer("cgroup", "memcg", "/a"): 4, Reclaimer("cgroup", "memcg", "/b"): 9}
    del counts[key(ids["/a"])]
    assert keeper.ingest(counts, {}, 1000.0) == [(0, Reclaimer("cgroup", "memcg", "/a"))]
    assert keeper.book.rows(0) == {other("memcg"): 4, Reclaimer("cgroup", "memcg", "/b"): 9}


reads = st.lists(
    st.tuples(
        st.dictionaries(
            st.tuples(st.integers(0, 1), st.sampled_from(["memcg", "direct", "kswapd"]), st.integers(1, 6)),
            st.integers(0, 50),
            max_size=8,
        ),
        st.integers(0, 5),  # unattributed pages added
        st.sets(st.integers(1, 6), max_size=2),  # cgroups that go away
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(reads)
def test_rows_add_up_to_every_page_and_never_shrink(
    steps: list[tuple[dict[tuple[int, str, int], int], int, set[int]]],
) -> None:
    """Whatever the kernel's counts do (entries growing, appearing, freed by the keeper), each
    tier's rows add up to the pages the kernel counted, and no row ever gives pages back, except
    a row folded into other, which takes them all."""
    book = ReclaimerBook(named_per_tier=2, linger_seconds=2.0)
    kernel: dict[ReclaimerKey, int] = {}
    counted = {0: 0, 1: 0}
    unattributed = {0: 0, 1: 0}
    gone: set[int] = set()
    before: dict[tuple[int, Reclaimer], int] = {}
    for now, (adds, lost, leaving) in enumerate(steps):
        for (tier, kind, cid), n in adds.items():
            k = ReclaimerKey(tier, kind, 0 if kind == "kswapd" else cid)
            if kind != "kswapd" and cid in gone:
                continue  # nothing counts in a gone cgroup
            kernel[k] = kernel.get(k, 0) + n
            counted[tier] += n
        unattributed[0] += lost
        counted[0] += lost
        gone |= leaving
        book.update(dict(kernel), unattributed, label, float(now))
        freed = book.gone(float(now), lambda p, i, gone=frozenset(gone): int(p[2:]) not in gone)
        for k in freed:
            del kernel[k]
        book.forget(freed, float(now))
        folded = book.expire(float(now))
        for tier in (0, 1):
            rows = book.rows(tier)
            assert sum(rows.values()) == counted[tier]
            for (t, row), n in before.items():
                if t == tier and (t, row) not in folded:
                    assert rows.get(row, 0) >= n, (row, n, rows)
            assert sum(1 for r in rows if r.reclaimer == "cgroup") <= 2
        before = {(t, row): n for t in (0, 1) for row, n in book.rows(t).items()}
