"""The ``kvwatch-kv-files`` thread: applies the KV-tier directories' inotify events as they
arrive, so a file is in the kernel's KV-inode set milliseconds after its creation rather than
at the next tick.

A KV file's pages are counted when they leave the page cache, which for a deleted file is at
its unlink; the file must be registered before then. Chunk files of a busy disk tier can live
for less than a tick, and once a file's create and delete wait in the same drain its inode can
no longer be looked up. The thread blocks in ``poll`` on the inotify descriptor and a wake-up
pipe (no periodic wake-ups) and hands each batch to ``KVTierRegistry.drain_inotify``, which
takes the registry's lock: the thread and the tick never write the kernel's set at once.

The tick still drains inotify itself (whichever reads first applies the events), so the
registry works without the thread; a thread that fails logs why and stops, leaving the tick's
drain.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
from typing import Protocol

import structlog

log = structlog.get_logger("kvwatch.kvtiers")

THREAD_NAME = "kvwatch-kv-files"
_READY = select.POLLIN | select.POLLPRI
_CLOSED = select.POLLERR | select.POLLHUP | select.POLLNVAL


class Drainable(Protocol):
    """What the thread needs from the registry (``KVTierRegistry`` provides it)."""

    def inotify_fd(self) -> int | None: ...

    def drain_inotify(self) -> None: ...


class KVFileWatcher:
    """Drains the registry's inotify events as they arrive, on its own thread."""

    def __init__(self, registry: Drainable) -> None:
        self.registry = registry
        self.drains = 0  # batches applied by the thread
        self._thread: threading.Thread | None = None
        self._wake_r = self._wake_w = -1

    def start(self) -> bool:
        """Start the thread; False (and nothing started) when the registry has no inotify."""
        fd = self.registry.inotify_fd()
        if fd is None or self._thread is not None:
            return False
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._run, args=(fd,), name=THREAD_NAME, daemon=True)
        self._thread.start()
        return True

    def stop(self, timeout: float = 5.0) -> None:
        """Wake the thread, wait for it, and close the pipe; the registry stays open."""
        if self._thread is None:
            return
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("kv file watcher did not stop", timeout=timeout)
            return  # it still polls the pipe: leave it open
        self._thread = None
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self, inotify_fd: int) -> None:
        poller = select.poll()
        poller.register(inotify_fd, _READY)
        poller.register(self._wake_r, _READY)
        try:
            while True:
                ready = dict(poller.poll())
                if self._wake_r in ready:
                    return
                flags = ready.get(inotify_fd, 0)
                if flags & _CLOSED:
                    log.warning("kv file watcher: inotify descriptor closed; the tick drains it")
                    return
                if flags & _READY:
                    self.registry.drain_inotify()
                    self.drains += 1
        except Exception as err:  # the tick's drain remains; say why the thread ended
            log.exception("kv file watcher stopped; new files are registered at each tick", error=str(err))
