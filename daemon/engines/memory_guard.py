"""A guard on kvwatch's memory against what libzmq holds for a KV event stream and nothing else
bounds.

libzmq bounds a stream's queue by messages (RCVHWM) and each frame by MAXMSGSIZE, not the frames
of one message: the parts of a multipart message are kept until its last part arrives, so a
publisher that never sends the last part grows kvwatch's memory without bound, whatever RCVHWM
(measured: 600 MiB for 600 parts of 1 MiB). No libzmq call shows that buffer; the process's RSS
does. So the hub reads its RSS every CHECK_SECONDS. Past the limit it first gives the freed heap
back (``malloc_trim``: what libzmq and Python freed stays in the heap otherwise); if RSS is still
past it, the hub closes and reopens every stream's sockets (their buffers go with them; the
batches missed show as gaps, replayed or lost) and gives the heap back again once libzmq's I/O
thread has freed them. While RSS stays past the limit for another reason, resets back off
(doubling, up to MAX_BACKOFF_SECONDS); once it is back under, the next one may come at once.

The limit: LIMIT_SHARE of the ``memory.max`` of kvwatch's own cgroup (the chart's 768 MiB, the
systemd unit's 1 GiB); no guard where that cgroup has no limit.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

from kvwatch.daemon.host.procfs import ProcError, ProcFS

CHECK_SECONDS = 0.1
MAX_BACKOFF_SECONDS = 60.0
LIMIT_SHARE = 0.75  # of memory.max: room left for what the guard's reaction time lets through


def rss_bytes(procfs: ProcFS) -> int:
    """kvwatch's own resident memory (0 when it cannot be read: no reset on a guess)."""
    try:
        value = procfs.status_value("self", "VmRSS") or "0 kB"
    except ProcError:
        return 0
    return int(value.split()[0]) << 10


def trim_heap() -> None:
    """Give the heap's free pages back to the kernel (glibc; elsewhere nothing to do)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def cgroup_limit(procfs: ProcFS) -> int | None:
    """LIMIT_SHARE of kvwatch's own cgroup v2 ``memory.max``; None without one (or no v2)."""
    mount = procfs.cgroup2_mount()
    try:
        line = next((x for x in procfs.cgroup(os.getpid()) if x.startswith("0::")), None)
        if mount is None or line is None:
            return None
        text = (mount / line[3:].lstrip("/") / "memory.max").read_text().strip()
    except (ProcError, OSError):
        return None
    return int(int(text) * LIMIT_SHARE) if text.isdigit() else None


class MemoryGuard:
    """``limit``: RSS bytes past which the hub resets its sockets; None: no guard."""

    def __init__(
        self,
        limit: int | None,
        *,
        read_rss: Callable[[], int] | None = None,
        trim: Callable[[], None] = trim_heap,
    ) -> None:
        self.limit = limit
        procfs = ProcFS()
        self.read_rss = read_rss or (lambda: rss_bytes(procfs))
        self.trim = trim
        self.resets = 0
        self.last_rss = 0
        self._next = 0.0  # the next check
        self._quiet_until = 0.0  # no reset before (the back-off)
        self._backoff = 0.0
        self._trim_due = False  # sockets were closed at the last check: their memory is free by now

    def check(self, now: float) -> bool:
        """True when the hub must reset its sockets now."""
        if self.limit is None or now < self._next:
            return False
        self._next = now + CHECK_SECONDS
        if self._trim_due:
            self._trim_due = False
            self.trim()
        self.last_rss = self.read_rss()
        if self.last_rss <= self.limit:
            self._backoff = 0.0
            return False
        self.trim()
        self.last_rss = self.read_rss()
        if self.last_rss <= self.limit or now < self._quiet_until:
            return False
        self._backoff = min(max(2 * self._backoff, CHECK_SECONDS), MAX_BACKOFF_SECONDS)
        self._quiet_until = now + self._backoff
        self._trim_due = True
        self.resets += 1
        return True
