"""The hub's memory guard (``engines/memory_guard.py``) with an injected RSS and clock: when it
resets, how it backs off, where its limit comes from. Against a real never-ending multipart
message: ``tests/integration/test_kv_events_hostile.py``."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

from kvwatch.daemon.engines.memory_guard import (
    CHECK_SECONDS,
    MAX_BACKOFF_SECONDS,
    MemoryGuard,
    cgroup_limit,
    rss_bytes,
)
from kvwatch.daemon.host.procfs import ProcFS

MiB = 1 << 20


class Process:
    """An RSS that a test sets; a trim gives back ``freeable`` bytes."""

    def __init__(self, rss: int) -> None:
        self.rss = rss
        self.freeable = 0
        self.trims = 0

    def read(self) -> int:
        return self.rss

    def trim(self) -> None:
        self.trims += 1
        self.rss -= self.freeable
        self.freeable = 0


def guard(p: Process, limit: int = 100 * MiB) -> MemoryGuard:
    return MemoryGuard(limit, read_rss=p.read, trim=p.trim)


def test_under_the_limit_nothing_happens_and_checks_are_spaced() -> None:
    p = Process(50 * MiB)
    g = guard(p)
    assert not g.check(0.0)
    p.rss = 500 * MiB
    assert not g.check(CHECK_SECONDS / 2)  # not due yet
    assert g.check(CHECK_SECONDS)


def test_freed_heap_given_back_is_not_a_reset() -> None:
    p = Process(150 * MiB)
    p.freeable = 80 * MiB
    g = guard(p)
    assert not g.check(0.0)
    assert (p.trims, g.resets) == (1, 0)


def test_a_reset_then_a_trim_once_the_sockets_are_gone() -> None:
    p = Process(300 * MiB)
    g = guard(p)
    assert g.check(0.0) and g.resets == 1
    p.freeable = 250 * MiB  # what the closed sockets held, freed by libzmq since
    assert not g.check(CHECK_SECONDS)
    assert p.rss == 50 * MiB
    p.rss = 300 * MiB  # the publisher floods again: the next reset comes at once
    assert g.check(2 * CHECK_SECONDS)


def test_rss_past_the_limit_for_another_reason_backs_resets_off() -> None:
    p = Process(300 * MiB)  # live memory: no trim gives it back
    g = guard(p)
    ticks = [i for i in range(int(600 / CHECK_SECONDS)) if g.check(i * CHECK_SECONDS)]
    gaps = [b - a for a, b in itertools.pairwise(ticks)]  # in checks
    assert all(b >= a - 1 for a, b in itertools.pairwise(gaps))  # doubling, then capped (a tick of float slack)
    assert max(gaps) * CHECK_SECONDS <= MAX_BACKOFF_SECONDS + CHECK_SECONDS
    assert len(ticks) < 20  # about one a minute once backed off


def test_the_limit_is_a_share_of_the_own_cgroups_memory_max(tmp_path: Path) -> None:
    """Read as kvwatch reads its own: its cgroup v2 mount (mountinfo), its cgroup (the 0:: line)."""
    me = tmp_path / "proc" / "self"
    me.mkdir(parents=True)
    (tmp_path / "proc" / str(os.getpid())).symlink_to(me)
    (me / "mountinfo").write_text("30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n")
    unit = tmp_path / "sys" / "fs" / "cgroup" / "system.slice" / "kvwatch.service"
    unit.mkdir(parents=True)
    (unit / "memory.max").write_text("1073741824\n")  # the systemd unit's MemoryMax=1G
    (me / "cgroup").write_text("0::/system.slice/kvwatch.service\n")
    fs = ProcFS(tmp_path)
    assert cgroup_limit(fs) == 768 * MiB
    (unit / "memory.max").write_text("max\n")
    assert cgroup_limit(fs) is None
    (me / "cgroup").write_text("4:memory:/x\n")  # no unified hierarchy
    assert cgroup_limit(fs) is None
    (me / "status").write_text("Name:\tkvwatch\nVmRSS:\t  2048 kB\n")
    assert rss_bytes(fs) == 2 * MiB
    assert MemoryGuard(None).check(0.0) is False
