"""Who reclaimed a KV tier's page cache: the kernel's per-reclaimer counts turned into rows a
person can read, and kept few.

The kernel keys each reclaimed page by (tier, kind, cgroup v2 id): a task inside a direct
(global) or memcg (a limit) reclaim window, charged to its cgroup, or kswapd / kdamond, kernel
threads answering node-wide pressure. Here a cgroup id becomes its path (the directory under the
cgroup v2 mount whose inode is that id), then its pod and container (``host/cgroups.py``), and
each tier keeps at most ``named`` cgroup rows: the rest are folded into ``other``.

Rules:

* **Every reclaimed page has one row.** A kernel entry's pages go to the row chosen when the
  entry was first seen, the tier's unattributed pages (the kernel's map was full) to
  ``unknown``: a tier's rows add up to its reclaimed pages.
* **Rows only grow.** A row is named at the first sight of its cgroup, while the tier has room
  (the largest first among those seen in one tick), and stays named; a cgroup past the cap goes
  to ``other`` of its scope and stays there, so ``other`` never gives pages back.
* **Gone cgroups make room.** An entry whose cgroup directory no longer has its id, and whose
  count stood still at the last read, is freed in the kernel: a cgroup id is never reused, so
  nothing can count there again. An entry of a cgroup never found is freed once it stood still
  for ``linger_seconds`` (the cgroup may be out of kvwatch's sight rather than gone). A named
  row whose entries are all freed lingers ``linger_seconds`` and is then folded into ``other``
  of its scope, freeing its place.
* **A cgroup never seen keeps its id.** One that came and went between two scans is labelled
  ``cgroup-id:<n>``; a path is resolved once and kept, also after the cgroup is gone.
* **Scans are rare.** The tree is walked only for an id the last walk did not have, at most
  once a tick; an id a walk did not find is not looked for again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvwatch.daemon.host.cgroups import identity_of_path
from kvwatch.probes.records import TASK_RECLAIMERS, ReclaimerKey

NAMED_PER_TIER = 16
LINGER_SECONDS = 600.0
PRUNE_SECONDS = 30.0  # how often idle entries are checked for a cgroup that is gone
KERNEL_THREADS = ("kswapd", "kdamond")
NEVER_FOUND = "cgroup-id:"  # the label of a cgroup no walk found


@dataclass(frozen=True, slots=True, order=True)
class Reclaimer:
    """One row: who reclaimed a tier's pages."""

    reclaimer: str  # cgroup / kswapd / kdamond / other (cgroups past the cap) / unknown (map full)
    scope: str  # global (node-wide pressure) / memcg (a cgroup's limit); "" for unknown
    cgroup: str = ""  # the reclaiming task's cgroup v2 path, or cgroup-id:<n>
    pod_uid: str = ""
    container: str = ""

    @property
    def key(self) -> str:
        """Unique per row of a tier: its key in the tier's reclaimer history."""
        return f"{self.reclaimer}:{self.scope}:{self.cgroup}"


UNKNOWN = Reclaimer("unknown", "")


def other(scope: str) -> Reclaimer:
    return Reclaimer("other", scope)


def reclaimer_of(key: ReclaimerKey, path: str | None) -> Reclaimer:
    """The row a kernel entry belongs to, before the cap: its cgroup's path (None: never seen)."""
    if key.kind in KERNEL_THREADS:
        return Reclaimer(key.kind, "global")
    if key.kind not in TASK_RECLAIMERS:
        return UNKNOWN
    scope = "memcg" if key.kind == "memcg" else "global"
    if path is None:
        return Reclaimer("cgroup", scope, f"{NEVER_FOUND}{key.cgroup_id}")
    ident = identity_of_path(path)
    return Reclaimer("cgroup", scope, path, ident.pod_uid, ident.container_id)


class CgroupPaths:
    """cgroup v2 id → path below the mount, from walks of the tree (``ProcFS.cgroup2_dirs``)."""

    def __init__(self, mount: Path | None, walk: Callable[[Path], Iterable[tuple[int, str]]]) -> None:
        self.mount = mount
        self._walk = walk
        self._paths: dict[int, str] = {}  # the last walk's
        self._absent: set[int] = set()  # ids a walk made after they reclaimed did not find
        self._walked_at = -1.0
        self.walks = 0

    def path(self, cgroup_id: int, now: float) -> str | None:
        """Its path; None when no walk found it. ``now`` is the tick's time (one walk per tick).
        Called after the kernel's counts were read, so a walk made now began after the cgroup
        reclaimed: not finding it means it is gone (or out of kvwatch's sight)."""
        if cgroup_id in self._paths:
            return self._paths[cgroup_id]
        if self.mount is None or cgroup_id in self._absent:
            return None
        if self._walked_at != now:
            self._walked_at = now
            self.walks += 1
            self._paths = dict(self._walk(self.mount))
            if cgroup_id in self._paths:
                return self._paths[cgroup_id]
        self._absent.add(cgroup_id)
        return None

    def forget(self, cgroup_id: int) -> None:
        """Its entries are freed: nothing will ask for it again."""
        self._absent.discard(cgroup_id)


@dataclass(slots=True)
class _Entry:
    """One kernel entry as last read."""

    pages: int
    label: Reclaimer  # who it is
    row: Reclaimer  # where its pages go: its label's row, or other
    changed_at: float  # when its count last moved (or was first read)


class ReclaimerBook:
    """Per tier, the pages each row took (see the module's rules)."""

    def __init__(self, named_per_tier: int = NAMED_PER_TIER, linger_seconds: float = LINGER_SECONDS) -> None:
        self.named_per_tier = named_per_tier
        self.linger_seconds = linger_seconds
        self._entries: dict[ReclaimerKey, _Entry] = {}
        self._rows: dict[int, dict[Reclaimer, int]] = {}
        self._departed: dict[tuple[int, Reclaimer], float] = {}  # named rows with no entry left, since

    def rows(self, tier_id: int) -> dict[Reclaimer, int]:
        """Pages per row of a tier."""
        return dict(self._rows.get(tier_id, {}))

    def update(
        self,
        counts: Mapping[ReclaimerKey, int],
        unattributed: Mapping[int, int],
        label: Callable[[ReclaimerKey], Reclaimer],
        now: float,
    ) -> None:
        """Take one read of the kernel's counts (cumulative pages per entry, and per tier the
        pages no entry holds); ``label`` names an entry seen for the first time."""
        for key, pages in counts.items():
            e = self._entries.get(key)
            if e is not None and pages != e.pages:
                # below the last read: the entry was freed and made again from zero
                self._add(key.tier_id, e.row, pages - e.pages if pages > e.pages else pages)
                e.pages, e.changed_at = pages, now
        new = sorted((k for k in counts if k not in self._entries), key=lambda k: (k.tier_id, -counts[k], k))
        for key in new:
            who = label(key)
            row = self._place(key.tier_id, who)
            self._entries[key] = _Entry(counts[key], who, row, now)
            self._add(key.tier_id, row, counts[key])
        for tier_id, pages in unattributed.items():
            if pages:
                self._rows.setdefault(tier_id, {})[UNKNOWN] = pages

    def _place(self, tier_id: int, row: Reclaimer) -> Reclaimer:
        rows = self._rows.setdefault(tier_id, {})
        if row.reclaimer != "cgroup" or row in rows:
            self._departed.pop((tier_id, row), None)
            rows.setdefault(row, 0)
            return row
        if sum(1 for r in rows if r.reclaimer == "cgroup") < self.named_per_tier:
            rows[row] = 0
            return row
        return other(row.scope)

    def _add(self, tier_id: int, row: Reclaimer, pages: int) -> None:
        rows = self._rows.setdefault(tier_id, {})
        rows[row] = rows.get(row, 0) + pages

    def gone(self, now: float, exists: Callable[[str, int], bool]) -> list[ReclaimerKey]:
        """Entries to free: their cgroup is gone (``exists(path, id)`` says no) and their count
        stood still at the last read, or it was never found and stood still ``linger_seconds``."""
        out = []
        for key, e in self._entries.items():
            if key.kind not in TASK_RECLAIMERS or e.changed_at >= now:
                continue
            if e.label.cgroup.startswith(NEVER_FOUND):
                if now - e.changed_at >= self.linger_seconds:
                    out.append(key)
            elif not exists(e.label.cgroup, key.cgroup_id):
                out.append(key)
        return out

    def forget(self, keys: Iterable[ReclaimerKey], now: float) -> None:
        """Entries freed in the kernel; their pages stay in their rows."""
        for key in keys:
            e = self._entries.pop(key, None)
            if e is None or e.row.reclaimer != "cgroup":
                continue
            if not any(k.tier_id == key.tier_id and x.row == e.row for k, x in self._entries.items()):
                self._departed[(key.tier_id, e.row)] = now

    def expire(self, now: float) -> list[tuple[int, Reclaimer]]:
        """Fold the named rows gone for ``linger_seconds`` into ``other``; returns them."""
        done = [k for k, since in self._departed.items() if now - since >= self.linger_seconds]
        for tier_id, row in done:
            del self._departed[(tier_id, row)]
            self._add(tier_id, other(row.scope), self._rows[tier_id].pop(row, 0))
        return done


class KernelReclaimers(Protocol):
    """What the book's keeper needs from the kernel side (``MemoryProbes`` provides it)."""

    def forget_reclaimer(self, key: ReclaimerKey) -> None: ...


class TierReclaimers:
    """The book, the cgroup paths, and the kernel entries freed: what the memory family runs."""

    def __init__(
        self,
        kernel: KernelReclaimers,
        paths: CgroupPaths,
        exists: Callable[[str, int], bool],
        book: ReclaimerBook | None = None,
    ) -> None:
        self.kernel = kernel
        self.paths = paths
        self.exists = exists
        self.book = book or ReclaimerBook()
        self._next_prune = 0.0

    def ingest(
        self, counts: Mapping[ReclaimerKey, int], unattributed: Mapping[int, int], now: float
    ) -> list[tuple[int, Reclaimer]]:
        """Take a read of the kernel's counts; returns the rows folded into ``other`` this time."""
        self.book.update(counts, unattributed, lambda k: reclaimer_of(k, self.paths.path(k.cgroup_id, now)), now)
        if now < self._next_prune:
            return []
        self._next_prune = now + PRUNE_SECONDS
        gone = self.book.gone(now, self.exists)
        for key in gone:
            self.kernel.forget_reclaimer(key)
            self.paths.forget(key.cgroup_id)
        self.book.forget(gone, now)
        return self.book.expire(now)
