"""KV-tier directories and the inode set the kernel filters page-cache events by.

Tiers come from config and from engine environments (each engine's module says where its
disk tier is: LMCache local disk, SGLang HiCache file backend), resolved through ``/proc/PID/root`` so a
container's directory is found on the host. Files are tracked by inotify plus a
periodic rescan that also repairs missed events. A deleted file's inode leaves
the set only after a grace period: its page-cache pages are removed *after* the
unlink is reported, and those removals are exactly the ``policy`` evictions we
want to count.

A file must be in the kernel's set before it is deleted, or its pages leave
uncounted; a busy disk tier writes, reads and deletes chunk files within
milliseconds. So inotify is drained as events arrive, by the
``kvwatch-kv-files`` thread (``kv_inotify.py``), which stats each created or
moved-in file at once; the tick drains too, as the fallback when the thread is
not running. Every change to the registry and to the kernel's set is made under
``KVTierRegistry.lock``: the thread and the tick never interleave their writes.
Once both the create and the delete of a file are queued before a drain, its
inode can no longer be known (the stat comes after the unlink); a file whose
whole life is shorter than the thread's wake-up (a scheduling delay, or a
rescan holding the lock) is missed. Registering from the kernel side was
rejected: no tracepoint reports a file created in a given directory, and
kprobes and fentry are not available on every node kvwatch runs on.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import structlog

from kvwatch.daemon.config import KVTiersConfig
from kvwatch.daemon.discovery import DiscoveredProcess
from kvwatch.daemon.engines.kinds import KINDS
from kvwatch.daemon.host.procfs import ProcError, ProcessIdentity, ProcFS

log = structlog.get_logger("kvwatch.kvtiers")

DELETE_GRACE_SECONDS = 3.0


class InodeSink(Protocol):
    """What the registry needs from the kernel side (``MemoryProbes`` provides it)."""

    def set_kv_inode(self, dev: int, ino: int, tier_id: int) -> bool: ...

    def remove_kv_inode(self, dev: int, ino: int) -> None: ...

    def learn_device(self, directory: Path) -> int | None: ...


@dataclass(frozen=True, slots=True)
class TierSpec:
    """A KV-tier directory to watch, before it is resolved."""

    path: Path  # as the daemon can open it (through /proc/PID/root for containers)
    name: str
    source: str  # config / lmcache / hicache
    owner: ProcessIdentity | None = None


@dataclass(slots=True)
class Tier:
    tier_id: int
    name: str
    path: Path
    source: str
    owners: set[ProcessIdentity] = field(default_factory=set)
    kernel_dev: int = 0
    files: dict[str, tuple[int, int]] = field(default_factory=dict)  # path → (dev, ino)
    watch_descriptors: dict[int, Path] = field(default_factory=dict)
    missing: bool = False


@dataclass(slots=True)
class TierStats:
    inodes: int = 0
    map_full: int = 0
    scan_errors: int = 0
    inotify_overflows: int = 0


def specs_from_process(p: DiscoveredProcess, procfs: ProcFS) -> list[TierSpec]:
    root = procfs.root_path(p.pid)

    def inside(path: str) -> Path:
        return root / path.lstrip("/")

    def read(path: str) -> str | None:
        try:
            return procfs.read_in_root(p.pid, path)
        except ProcError:
            return None

    specs = []
    for kind in KINDS:  # an engine's disk tier may live in another's process (LMCache in vLLM)
        if kind.kv_tier is not None:
            source, dirs = kind.kv_tier
            specs += [
                TierSpec(inside(d), f"{source}:{d}", source, p.identity) for d in dirs(p.environ, p.cmdline, read)
            ]
    return specs


class KVTierRegistry:
    def __init__(
        self,
        config: KVTiersConfig,
        sink: InodeSink,
        *,
        procfs: ProcFS,
        max_tiers: int = 64,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.sink = sink
        self.procfs = procfs
        self.max_tiers = max_tiers
        self.clock = clock
        self.tiers: dict[str, Tier] = {}  # by _tier_key
        self.stats = TierStats()
        self._next_id = 0
        self._dev_cache: dict[int, int] = {}  # st_dev → kernel s_dev
        self._pending_removal: list[tuple[float, int, int]] = []
        self._next_rescan = 0.0
        self._inotify = _open_inotify()
        # held by every public entry point: the tick and the inotify reader thread
        self.lock = threading.Lock()

    # --- which tiers -----------------------------------------------------------------
    def config_specs(self) -> list[TierSpec]:
        return [TierSpec(d.path, d.name or str(d.path), "config", None) for d in self.config.dirs]

    def sync(self, processes: Iterable[DiscoveredProcess]) -> None:
        """Make the tier set match config + the environments of the watched processes."""
        with self.lock:
            self._sync(processes)

    def _sync(self, processes: Iterable[DiscoveredProcess]) -> None:
        specs = self.config_specs()
        if self.config.from_environment:
            for p in processes:
                specs += specs_from_process(p, self.procfs)
        owners: dict[str, set[ProcessIdentity]] = {}
        for spec in specs:
            key = _tier_key(spec)
            if key is None:
                continue
            if key not in self.tiers:
                if self._next_id >= self.max_tiers:
                    log.warning("kv tier limit reached", limit=self.max_tiers, path=str(spec.path))
                    continue
                tier = Tier(self._next_id, spec.name, spec.path, spec.source)
                self._next_id += 1
                self.tiers[key] = tier
                self._scan_tier(tier)
                log.info("kv tier added", tier=tier.name, path=str(spec.path), source=spec.source)
            if spec.owner is not None:
                owners.setdefault(key, set()).add(spec.owner)
        for key, tier in self.tiers.items():
            tier.owners = owners.get(key, set())

    # --- files → inodes --------------------------------------------------------------------
    def _kernel_dev(self, st_dev: int, directory: Path) -> int:
        if st_dev not in self._dev_cache:
            learned = self.sink.learn_device(directory)
            self._dev_cache[st_dev] = learned if learned else (os.major(st_dev) << 20) | os.minor(st_dev)
        return self._dev_cache[st_dev]

    def _add_file(self, tier: Tier, path: str, st: os.stat_result) -> None:
        dev = self._kernel_dev(st.st_dev, Path(path).parent)
        key = (dev, st.st_ino)
        if tier.files.get(path) == key:
            return
        if self.stats.inodes >= self.config.max_files:
            self.stats.map_full += 1
            return
        if self.sink.set_kv_inode(dev, st.st_ino, tier.tier_id):
            tier.files[path] = key
            self.stats.inodes += 1
        else:
            self.stats.map_full += 1

    def _watch_dir(self, tier: Tier, directory: Path) -> None:
        if self._inotify is None or directory in tier.watch_descriptors.values():
            return
        try:
            wd = self._inotify.add_watch(str(directory), _WATCH_FLAGS)
        except OSError:
            self.stats.scan_errors += 1
            return
        tier.watch_descriptors[wd] = directory

    def _scan_tier(self, tier: Tier) -> None:
        seen: set[str] = set()
        if not tier.path.is_dir():
            if not tier.missing:
                log.info("kv tier directory absent, will retry", tier=tier.name, path=str(tier.path))
            tier.missing = True
            return
        tier.missing = False
        for dirpath, _dirs, files in os.walk(tier.path, onerror=lambda _e: self._count_error()):
            self._watch_dir(tier, Path(dirpath))
            for name in files:
                if name.startswith(".kvwatch-canary"):
                    continue
                path = os.path.join(dirpath, name)  # noqa: PTH118 - hot loop over many files
                try:
                    st = os.stat(path, follow_symlinks=False)  # noqa: PTH116 - hot loop, str paths
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    seen.add(path)
                    self._add_file(tier, path, st)
        gone = [p for p in tier.files if p not in seen]
        now = self.clock()
        for p in gone:
            dev, ino = tier.files.pop(p)
            self._pending_removal.append((now + DELETE_GRACE_SECONDS, dev, ino))

    def _count_error(self) -> None:
        self.stats.scan_errors += 1

    def refresh(self) -> None:
        """Apply inotify events, expire deleted inodes, rescan when due. Called every tick."""
        with self.lock:
            self._refresh()

    def _refresh(self) -> None:
        now = self.clock()
        if self._inotify is not None:
            self._drain_inotify(now)
        if now >= self._next_rescan:
            self._next_rescan = now + self.config.rescan_seconds
            for tier in self.tiers.values():
                self._scan_tier(tier)
        keep = []
        for due, dev, ino in self._pending_removal:
            if due <= now:
                if not self._still_listed(dev, ino):
                    self.sink.remove_kv_inode(dev, ino)
                    self.stats.inodes -= 1
            else:
                keep.append((due, dev, ino))
        self._pending_removal = keep

    def _still_listed(self, dev: int, ino: int) -> bool:
        return any((dev, ino) in t.files.values() for t in self.tiers.values())

    def inotify_fd(self) -> int | None:
        """The inotify descriptor, to wait on; None when inotify is unavailable or closed."""
        return None if self._inotify is None else self._inotify.fileno()

    def drain_inotify(self) -> None:
        """Apply the inotify events queued now (the reader thread calls it when they arrive)."""
        with self.lock:
            self._drain_inotify(self.clock())

    def _drain_inotify(self, now: float) -> None:
        if self._inotify is None:
            return
        try:
            events = self._inotify.read(timeout=0)
        except OSError:
            self.stats.scan_errors += 1
            return
        self._apply_events(events, now)

    def _apply_events(self, events: Iterable[_Event], now: float) -> None:
        by_wd = {wd: (tier, d) for tier in self.tiers.values() for wd, d in tier.watch_descriptors.items()}
        for ev in events:
            if ev.mask & _IN_Q_OVERFLOW:
                self.stats.inotify_overflows += 1
                self._next_rescan = now
                continue
            hit = by_wd.get(ev.wd)
            if hit is None or not ev.name:
                continue
            tier, directory = hit
            path = str(directory / ev.name)
            if ev.mask & (_IN_DELETE | _IN_MOVED_FROM):
                key = tier.files.pop(path, None)
                if key is not None:
                    self._pending_removal.append((now + DELETE_GRACE_SECONDS, *key))
                continue
            try:
                st = os.stat(path, follow_symlinks=False)  # noqa: PTH116 - str path from inotify
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                self._watch_dir(tier, Path(path))
                self._next_rescan = now  # pick up files created before the watch
            elif stat.S_ISREG(st.st_mode) and not ev.name.startswith(".kvwatch-canary"):
                self._add_file(tier, path, st)

    def tier_by_id(self) -> dict[int, Tier]:
        return {t.tier_id: t for t in self.tiers.values()}

    def close(self) -> None:
        """Close inotify; the reader thread must have been stopped first."""
        with self.lock:
            if self._inotify is not None:
                with contextlib.suppress(OSError):
                    self._inotify.close()
                self._inotify = None


def _tier_key(spec: TierSpec) -> str | None:
    """Tiers are the same when their directories are: config paths by resolved name (so a
    directory created later is found), engine directories by (dev, inode) seen through
    /proc/PID/root (resolving that magic link would land on the host's file system);
    an engine directory that does not exist yet is skipped until it does."""
    if spec.owner is None:
        try:
            return str(spec.path.resolve(strict=False))
        except OSError:
            return str(spec.path)
    try:
        st = spec.path.stat()
    except OSError:
        return None
    return f"dev{st.st_dev}:ino{st.st_ino}"


# inotify constants (inotify_simple.flags mirrors these; kept here so the mask is explicit)
_IN_CREATE = 0x100
_IN_DELETE = 0x200
_IN_MOVED_FROM = 0x40
_IN_MOVED_TO = 0x80
_IN_CLOSE_WRITE = 0x8
_IN_Q_OVERFLOW = 0x4000
_IN_ONLYDIR = 0x1000000
_WATCH_FLAGS = _IN_CREATE | _IN_DELETE | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CLOSE_WRITE | _IN_ONLYDIR


def _open_inotify() -> _INotifyLike | None:
    try:
        from inotify_simple import INotify  # noqa: PLC0415 - optional at run time

        return INotify(nonblocking=True)  # type: ignore[no-any-return]
    except (ImportError, OSError) as err:
        log.warning("inotify unavailable, relying on rescans", error=str(err))
        return None


class _Event(Protocol):
    wd: int
    mask: int
    name: str


class _INotifyLike(Protocol):
    def add_watch(self, path: str, mask: int) -> int: ...

    def read(self, timeout: int | None = ...) -> list[_Event]: ...

    def fileno(self) -> int: ...

    def close(self) -> None: ...
