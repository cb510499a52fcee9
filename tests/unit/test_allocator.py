"""The C allocator's settings (daemon/host/allocator.py): applied on glibc, trimming at most once
in TRIM_SECONDS, and memory freed by a burst handed back to the kernel."""

from __future__ import annotations

import ctypes

from kvwatch.daemon.host import allocator as al


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def test_the_settings_take_on_glibc() -> None:
    assert al.Allocator().tune() is True


def test_trim_runs_at_most_once_in_its_period() -> None:
    a = al.Allocator()
    assert a.trim(100.0) is True
    assert a.trim(100.0 + al.TRIM_SECONDS / 2) is False
    assert a.trim(100.0 + al.TRIM_SECONDS) is True
    assert a.trims == 2


def test_a_bursts_small_buffers_are_handed_back_by_trim() -> None:
    """64 MiB of 4 KiB C buffers (below the mmap threshold: they live in the arena), all freed but
    the last (which pins the heap's top, so glibc's own top trim returns nothing): only
    malloc_trim gives the freed pages back."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    a = al.Allocator()
    a.tune()
    bufs = [libc.malloc(4096) for _ in range(16_384)]
    for b in bufs:
        libc.memset(b, 1, 4096)
    full = rss_kib()
    for b in bufs[:-1]:
        libc.free(b)
    held = rss_kib()
    assert a.trim(0.0)
    trimmed = rss_kib()
    libc.free(bufs[-1])
    assert held - full > -16 * 1024, (full, held)  # freeing alone keeps the pages
    assert held - trimmed >= 48 * 1024, (full, held, trimmed)
