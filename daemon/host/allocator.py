"""The C allocator's settings for a long-running agent that takes bursts (glibc only; elsewhere
nothing is changed).

Under a KV event flood the daemon's resident memory is mostly what glibc keeps after the burst,
not what it still uses: each thread that allocates gets its own 64 MiB arena, a freed large
buffer raises the size from which buffers are mapped on their own (up to 32 MiB), so later
numpy temporaries land in the arenas and fragment them, and freed arena memory is returned
only from the top. So, before any thread starts:

* one arena for every thread (ARENA_MAX): the hub's and the tick's threads take their turns
  under the GIL anyway, and a second arena only keeps a second pool of freed pages;
* every buffer of MMAP_THRESHOLD or more mapped on its own and unmapped when freed (a fixed
  threshold: glibc then stops raising it);
* and ``trim`` (every TRIM_SECONDS from the tick: under 1 ms with 20 MiB of scattered free
  chunks) hands free arena pages back to the kernel, wherever they are (``malloc_trim``), so a
  burst's leftovers do not stay resident.

Measured in ``bench/results/daemon_rss_flood.md``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time

import structlog

log = structlog.get_logger("kvwatch.allocator")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
ARENA_MAX = 1
MMAP_THRESHOLD = 128 << 10
TRIM_THRESHOLD = 4 << 20  # free memory at a heap's top above this is returned at once
TRIM_SECONDS = 1.0


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt.argtypes, libc.malloc_trim.argtypes = [ctypes.c_int, ctypes.c_int], [ctypes.c_size_t]
    except (OSError, AttributeError):  # not glibc: its allocator is left as it is
        return None
    return libc


class Allocator:
    def __init__(self) -> None:
        self._libc = _libc()
        self._next_trim = 0.0
        self.trims = 0

    def tune(self) -> bool:
        """The settings above; False where this C library has no ``mallopt`` (nothing changed)."""
        if self._libc is None:
            log.info("allocator left as it is", reason="not glibc")
            return False
        settings = ((M_ARENA_MAX, ARENA_MAX), (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        return all(self._libc.mallopt(param, value) == 1 for param, value in settings)

    def trim(self, now: float | None = None) -> bool:
        """Free pages back to the kernel, at most once in TRIM_SECONDS; whether it ran."""
        now = time.monotonic() if now is None else now
        if self._libc is None or now < self._next_trim:
            return False
        self._next_trim = now + TRIM_SECONDS
        self._libc.malloc_trim(0)
        self.trims += 1
        return True
