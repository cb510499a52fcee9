"""`kvwatch run --kv-dir D` counts the pages of KV files that live for less than a tick: each
file is created, written, read and deleted back to back (tens of milliseconds) while the daemon
ticks once a second, and every page resident when its deletion began is counted, exactly.

A deletion is policy; a page the kernel reclaimed first (kdamond's pageout runs on the test VM)
is counted as reclaim, so policy + reclaim is closed against mincore's count taken just before
each unlink."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvwatch.daemon.lab.workloads import MIB, PAGE, read_files, resident_pages
from tests.support.daemon import DaemonProcess, daemon, wait_until

FILES = 23  # a prime
TOML = """
[daemon]
tick_seconds = 1.0
[kv_tiers]
rescan_seconds = 3600
"""


def evicted_pages(d: DaemonProcess, tier: str) -> int:
    """The tier's policy + reclaim pages, from one scrape."""
    value = d.value_in(d.metrics())
    total = value("kvwatch_pagecache_evicted_bytes_total", tier=tier)
    assert total % PAGE == 0, total
    return int(total) // PAGE


def churn(directory: Path, count: int, size: int, *, sync: bool) -> tuple[int, list[float]]:
    """Create, write (and fsync), read and delete ``count`` files one after the other; the pages
    each had resident just before its unlink, summed, and each file's life in seconds."""
    block = os.urandom(MIB)
    resident, lives = 0, []
    for i in range(count):
        path = directory / f"chunk-{i:03d}.bin"
        born = time.monotonic()
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            for _ in range(size // MIB):
                os.write(fd, block)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        assert read_files([path]) == size
        resident += resident_pages(path)
        path.unlink()
        lives.append(time.monotonic() - born)
    return resident, lives


@pytest.mark.parametrize(("size_mib", "sync"), [(24, False), (48, True)], ids=["unsynced", "synced"])
def test_files_deleted_within_a_tick_are_counted(tmp_path: Path, kvdir: Path, size_mib: int, sync: bool) -> None:
    tier = str(kvdir)
    with daemon(tmp_path, TOML, "--kv-dir", tier) as d:
        wait_until(lambda: "kvwatch_kv_tier_files" in d.metrics(), 30, "the tier tracked")
        before = d.settled(lambda: evicted_pages(d, tier))
        resident, lives = churn(kvdir, FILES, size_mib * MIB, sync=sync)
        wait_until(lambda: evicted_pages(d, tier) - before >= resident, 60, "every deleted page counted")
        counted = d.settled(lambda: evicted_pages(d, tier)) - before
        lives.sort()
        print(
            f"{FILES} files of {size_mib} MiB (sync={sync}): {resident} pages resident at deletion, "
            f"{counted} counted; lives {lives[0] * 1e3:.0f}-{lives[-1] * 1e3:.0f} ms "
            f"(median {lives[len(lives) // 2] * 1e3:.0f} ms)"
        )
        assert resident > 0.9 * FILES * size_mib * MIB // PAGE, resident  # the churn really was cached
        assert counted == resident, (counted, resident)
