"""The kernel-memory family in the loop: its program's lifecycle, the events it sends
(process lifecycle, OOM kills), the per-process and per-tier histories its counters feed,
the KV tiers whose files it watches, and who reclaimed them (``reclaimers.py``).

Unlike the uprobe families it has no attacher thread: its probes are tracepoints,
attached once for the whole node, and the loop's poll waits on its ring buffer. Its one
thread, ``kvwatch-kv-files`` (``kv_inotify.py``), registers new KV files as they are created.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence

import structlog

from kvwatch.daemon.config import Config
from kvwatch.daemon.discovery import DiscoveredProcess
from kvwatch.daemon.families.kv_files import KVTierRegistry, Tier
from kvwatch.daemon.families.kv_inotify import KVFileWatcher
from kvwatch.daemon.families.oom import oom_event
from kvwatch.daemon.families.reclaimers import CgroupPaths, Reclaimer, TierReclaimers
from kvwatch.daemon.host.procfs import ProcFS
from kvwatch.daemon.logs import ErrorBook
from kvwatch.daemon.model.findings import Subject
from kvwatch.daemon.model.history import History
from kvwatch.daemon.model.memory import MEMORY, PAGES, MemoryCounters, Reclaimed, TierCounters
from kvwatch.daemon.model.snapshot import ProbeView, TierRates, TierReclaimer, TierView
from kvwatch.daemon.model.windows import OomEvent, ProcessWindow, TierPageLoss, TierWindow
from kvwatch.daemon.tracker import ProcessTracker, Tracked
from kvwatch.probes.errors import ProbeError
from kvwatch.probes.memory import HOOKS, MemoryProbes
from kvwatch.probes.records import (
    HookState,
    HookStatus,
    MemorySample,
    OomKill,
    ProcessExec,
    ProcessExited,
    ProcessForked,
    ProcessRenamed,
)

log = structlog.get_logger("kvwatch.memory")

PAGE_SIZE = 4096
TIER_HISTORY_SECONDS = 120.0
RATE_WINDOW = 5.0  # the snapshot's rates

OomKey = tuple[str, str, str, str]  # engine, role, container, pod


class MemoryFamily:
    def __init__(
        self,
        config: Config,
        probes: MemoryProbes | None,
        tracker: ProcessTracker,
        procfs: ProcFS,
        errors: ErrorBook,
        *,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.probes = probes
        self.tracker = tracker
        self.procfs = procfs
        self.errors = errors
        self.clock = clock
        self.statuses: list[HookStatus] = []
        self.tiers: KVTierRegistry | None = None
        self.tier_watcher: KVFileWatcher | None = None
        self.reclaimers: TierReclaimers | None = None
        self.tier_pages: dict[int, History[TierCounters]] = {}  # under PAGES
        self.tier_reclaimed: dict[int, History[Reclaimed]] = {}  # by reclaimer row
        self.tier_first_seen: dict[int, float] = {}
        self.oom_kills: dict[OomKey, int] = {}
        self.last_sample: MemorySample | None = None  # the last one: hits and losses of the hooks
        self.malformed = 0  # ring-buffer records that did not decode
        self._pending_oom: list[OomEvent] = []

    # --- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Load and attach; a program that does not load is recorded and every hook marked failed."""
        if self.probes is None:
            return
        try:
            self.statuses = self.probes.start()
        except ProbeError as err:
            self.errors.record("probe_load", "kernel-memory probes did not load", err)
            self.statuses = [
                HookStatus(h.name, "memory", h.tracepoint, HookState.FAILED, str(err), h.required) for h in HOOKS
            ]
            self.probes = None
            self.tracker.kernel = None
        else:
            self.tiers = KVTierRegistry(
                self.config.kv_tiers,
                self.probes,
                procfs=self.procfs,
                max_tiers=self.probes.options.max_tiers,
                clock=self.clock,
            )
            self.tier_watcher = KVFileWatcher(self.tiers)
            self.tier_watcher.start()
            self.reclaimers = self._reclaimers(self.probes)
        for st in self.statuses:
            if st.state is not HookState.ATTACHED:
                log.warning("probe not attached", probe=st.name, state=st.state.value, reason=st.reason)

    def _reclaimers(self, probes: MemoryProbes) -> TierReclaimers:
        mount = self.procfs.host_cgroup2_mount()
        if mount is None:
            log.warning("no cgroup v2 hierarchy: reclaiming cgroups are named by id only")

        def exists(path: str, cgroup_id: int) -> bool:
            return mount is not None and self.procfs.cgroup2_id(mount, path) == cgroup_id

        return TierReclaimers(probes, CgroupPaths(mount, self.procfs.cgroup2_dirs), exists)

    def poll(self, wait_seconds: float, stop: threading.Event) -> None:
        """Wait for the ring buffer (or ``stop``) at most ``wait_seconds``, draining it."""
        if self.probes is None:
            stop.wait(wait_seconds)
            return
        try:
            self.probes.poll(int(wait_seconds * 1000))
        except Exception as err:
            self.errors.record("ring_poll", "ring buffer poll failed", err)
            stop.wait(wait_seconds)

    def has_urgent_events(self) -> bool:
        """OOM kills are acted on at once, not at the next tick."""
        return self.probes is not None and any(isinstance(e, OomKill) for e in self.probes.pending())

    name = "memory"

    def not_ready(self) -> tuple[str, ...]:
        if self.probes is None and any(f for f in self.config.probes.memory):
            return ("kernel-memory probes not loaded",)
        return tuple(
            f"{s.family}/{s.name}: {s.state.value} ({s.reason})"
            for s in self.statuses
            if s.required and s.state not in (HookState.ATTACHED, HookState.DISABLED)
        )

    def close(self) -> None:
        if self.tier_watcher is not None:
            self.tier_watcher.stop()
        if self.tiers is not None:
            self.tiers.close()
        if self.probes is not None:
            self.probes.close()

    # --- events ---------------------------------------------------------------------------
    def drain(self) -> None:
        """Apply the events the ring buffer delivered: the process tree changes, OOM kills."""
        if self.probes is None:
            return
        batch = self.probes.take_events()
        self.malformed += batch.malformed
        for ev in batch.events:
            if isinstance(ev, ProcessForked):
                self.tracker.on_fork(ev.parent_tgid, ev.child_pid)
            elif isinstance(ev, ProcessExited):
                self.tracker.on_exit(ev.tgid)
            elif isinstance(ev, ProcessExec):
                self.tracker.hint(ev.pid)
            elif isinstance(ev, ProcessRenamed):
                self.tracker.hint(ev.tgid)
            elif isinstance(ev, OomKill):
                self._on_oom(ev)

    def _on_oom(self, ev: OomKill) -> None:
        event = oom_event(
            ev,
            self.tracker,
            self.procfs,
            include_siblings=self.config.detectors.oom.include_cgroup_siblings,
            now=self.clock(),
        )
        if event is None:
            if ev.watched:
                self.errors.record("oom_untracked", "OOM victim was watched in the kernel but not tracked")
            return
        self._pending_oom.append(event)
        lab = event.subject.labels
        k = (lab["engine"], lab["role"], lab["container"], lab["pod"])
        self.oom_kills[k] = self.oom_kills.get(k, 0) + 1
        if not event.sibling_of:
            self.tracker.on_exit(ev.victim_pid)

    def pending_oom_events(self) -> tuple[OomEvent, ...]:
        """The kills since the detectors last took them, left in place."""
        return tuple(self._pending_oom)

    def take_oom_events(self) -> list[OomEvent]:
        out, self._pending_oom = self._pending_oom, []
        return out

    # --- KV tiers -------------------------------------------------------------------------
    def sync_tiers(self, processes: Iterable[DiscoveredProcess]) -> None:
        """The tiers the watched processes name (environment, command line) and the config's."""
        if self.tiers is not None:
            self.tiers.sync(processes)

    def refresh_tiers(self) -> None:
        if self.tiers is not None:
            self.tiers.refresh()

    def tier_owners(self, tier: Tier) -> list[Tracked]:
        """Processes a tier belongs to: named by their environment or config, or seen
        (by the kernel) bringing the tier's pages into the page cache."""
        readers = self.last_sample.tier_readers if self.last_sample else {}
        config_pids = {d.owner_pid for d in self.config.kv_tiers.dirs if d.owner_pid and str(d.path) == str(tier.path)}
        return [
            t
            for t in self.tracker.tracked()
            if t.proc.identity in tier.owners or (t.pid, tier.tier_id) in readers or t.pid in config_pids
        ]

    # --- observations ---------------------------------------------------------------------
    def sample(self, tracked: Sequence[Tracked], now: float) -> None:
        """The kernel's counters, read once: each watched process's totals, each KV tier's pages."""
        if self.probes is None:
            return
        sample = self.probes.sample()
        self.last_sample = sample
        for t in tracked:
            c = sample.processes.get(t.pid)
            totals = MemoryCounters()
            if c is not None:
                totals = MemoryCounters(
                    page_free_pages=float(c.page_free_pages),
                    direct_reclaim_seconds=c.direct_reclaim_ns / 1e9,
                    direct_reclaim_count=float(c.direct_reclaim_count),
                    memcg_reclaim_seconds=c.memcg_reclaim_ns / 1e9,
                    memcg_reclaim_count=float(c.memcg_reclaim_count),
                )
            t.memory.add(now, {MEMORY: totals})
        if self.tiers is None:
            return
        folded: list[tuple[int, Reclaimer]] = []
        if self.reclaimers is not None:
            unattributed = {i: c.unattributed_pages for i, c in sample.tiers.items()}
            folded = self.reclaimers.ingest(sample.reclaimers, unattributed, now)
        for tier_id in self.tiers.tier_by_id():
            c2 = sample.tiers.get(tier_id)
            counts = TierCounters()
            if c2 is not None:
                counts = TierCounters(
                    reclaim_bytes=float(c2.reclaim_pages) * PAGE_SIZE,
                    policy_bytes=float(c2.policy_pages) * PAGE_SIZE,
                    reclaim_pages=float(c2.reclaim_pages),
                    policy_pages=float(c2.policy_pages),
                    refault_pages=float(c2.refault_pages),
                    added_pages=float(c2.added_pages),
                )
            self._tier_pages(tier_id).add(now, {PAGES: counts})
            reclaimed = self.tier_reclaimed.get(tier_id)
            if reclaimed is None:
                reclaimed = self.tier_reclaimed[tier_id] = History(Reclaimed, TIER_HISTORY_SECONDS)
            reclaimed.drop(row.key for t, row in folded if t == tier_id)
            if self.reclaimers is not None:
                rows = self.reclaimers.book.rows(tier_id).items()
                reclaimed.add(now, {row.key: Reclaimed(float(n) * PAGE_SIZE) for row, n in rows})
            self.tier_first_seen.setdefault(tier_id, now)

    def owners(self) -> dict[int, list[Tracked]]:
        """Every tier's owner processes, worked out once a tick for all that need them."""
        if self.tiers is None:
            return {}
        return {tier.tier_id: self.tier_owners(tier) for tier in self.tiers.tiers.values()}

    def tier_page_losses(self) -> list[TierPageLoss]:
        """Each tier's page cache dropped so far, for the KV loss ledger."""
        if self.tiers is None:
            return []
        out = []
        for tier in self.tiers.tiers.values():
            pages = self.tier_pages.get(tier.tier_id)
            if pages is not None:
                c = pages.last(PAGES)
                out.append(TierPageLoss(tier.tier_id, c.reclaim_bytes, c.policy_bytes))
        return out

    def tier_windows(
        self, now: float, processes: dict[str, ProcessWindow], owners: Mapping[int, list[Tracked]]
    ) -> dict[str, TierWindow]:
        """What the tier detectors see: each tier's page-cache history, labelled by its first owner."""
        if self.tiers is None:
            return {}
        windows: dict[str, TierWindow] = {}
        for tier in self.tiers.tiers.values():
            pages = self.tier_pages.get(tier.tier_id)
            if pages is None:
                continue
            tier_owners = tuple(processes[t.key] for t in owners.get(tier.tier_id, ()))
            labels = {"tier": tier.name}
            if tier_owners:
                labels.update(tier_owners[0].subject.labels)
            key = f"tier:{tier.tier_id}"
            windows[key] = TierWindow(
                subject=Subject(key, labels),
                age=now - self.tier_first_seen.get(tier.tier_id, now),
                pages=pages,
                owners=tier_owners,
            )
        return windows

    # --- what the snapshot shows (frozen data) ----------------------------------------------
    def probe_views(self) -> list[ProbeView]:
        hits = self.last_sample.hits if self.last_sample else {}
        return [
            ProbeView(s.name, s.family, s.target, s.state.value, s.required, hits.get(s.name, 0), s.reason)
            for s in self.statuses
        ]

    def lost(self) -> dict[str, int]:
        """Events the kernel side and the decoder dropped, by where."""
        lost = dict(self.last_sample.lost) if self.last_sample else {}
        lost["malformed_events"] = self.malformed
        if self.tiers is not None and self.tiers.stats.map_full:
            lost["kv_inodes_full"] = self.tiers.stats.map_full
        return lost

    def tier_views(self, owners: Mapping[int, list[Tracked]]) -> tuple[TierView, ...]:
        if self.tiers is None:
            return ()
        views = []
        for tier in self.tiers.tiers.values():
            pages = self.tier_pages.get(tier.tier_id) or History(TierCounters)
            r = pages.rate(PAGES, RATE_WINDOW)
            views.append(
                TierView(
                    key=f"tier:{tier.tier_id}",
                    tier_id=tier.tier_id,
                    name=tier.name,
                    path=str(tier.path),
                    source=tier.source,
                    owners=tuple(sorted(t.pid for t in owners.get(tier.tier_id, ()))),
                    files=len(tier.files),
                    totals=pages.last(PAGES),
                    rates=TierRates(r.reclaim_bytes, r.policy_bytes, r.refault_pages),
                    reclaimers=self._reclaimer_views(tier.tier_id),
                )
            )
        return tuple(views)

    def _reclaimer_views(self, tier_id: int) -> tuple[TierReclaimer, ...]:
        """Who reclaimed the tier: its rows, the largest first."""
        if self.reclaimers is None:
            return ()
        reclaimed = self.tier_reclaimed.get(tier_id) or History(Reclaimed)

        rows = [
            TierReclaimer(
                reclaimer=row.reclaimer,
                scope=row.scope,
                cgroup=row.cgroup,
                pod_uid=row.pod_uid,
                container=row.container,
                bytes=reclaimed.last(row.key).bytes,
                bytes_per_second=reclaimed.rate(row.key, RATE_WINDOW).bytes,
            )
            for row in self.reclaimers.book.rows(tier_id)
        ]
        return tuple(sorted(rows, key=lambda r: (-r.bytes, r.reclaimer, r.scope, r.cgroup)))

    def _tier_pages(self, tier_id: int) -> History[TierCounters]:
        pages = self.tier_pages.get(tier_id)
        if pages is None:
            pages = self.tier_pages[tier_id] = History(TierCounters, TIER_HISTORY_SECONDS)
        return pages
