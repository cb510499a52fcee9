"""The set of watched processes, kept in step with the kernel's watched-TGID map.

Sources: discovery scans (rules, hand-added PIDs, NVML), fork events (children
of watched processes, already added by the kernel), exec/rename hints. A
process stays watched until it exits; its identity is PID + start time, so a
recycled PID is a new process with fresh counters. Exited processes linger for
a short grace period: the kernel frees their memory after the exit event.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from kvwatch.daemon.discovery import DiscoveredProcess, Discovery
from kvwatch.daemon.host.procfs import ProcError, ProcessGone, ProcFS
from kvwatch.daemon.model.cuda import AllocatorCounts, CopyCounts, GpuUse
from kvwatch.daemon.model.engine_scrape import NO_ENGINE, EngineState, ScrapeCounts, TierCounts
from kvwatch.daemon.model.engines import LostBytes, TenantCounts
from kvwatch.daemon.model.history import History
from kvwatch.daemon.model.kv_counts import NO_STREAM, KVState, MediumCounts, StreamEvents
from kvwatch.daemon.model.memory import MemoryCounters
from kvwatch.daemon.model.transfers import NONE_IN_FLIGHT, TransferCounts, TransfersInFlight
from kvwatch.daemon.model.uprobes import UprobeState

log = structlog.get_logger("kvwatch.tracker")

EXIT_GRACE_SECONDS = 2.0
RECENT_SECONDS = 30.0


class WatchSink(Protocol):
    def watch(self, tgid: int, root_tgid: int | None = None) -> bool: ...

    def unwatch(self, tgid: int) -> None: ...

    def watched(self) -> dict[int, int]: ...


@dataclass(slots=True)
class Tracked:
    """A watched process, and what each source observed of it: typed cumulative counts in
    histories (read as increases over windows), and the latest of what is not a count."""

    proc: DiscoveredProcess
    first_seen: float
    horizon: float = 600.0  # seconds of history kept
    exited_at: float | None = None
    in_kernel: bool = False
    memory: History[MemoryCounters] = field(init=False)  # its kernel-memory counters (the memory family's)
    allocator: History[AllocatorCounts] = field(init=False)  # its CUDA allocator (the CUDA family's)
    copies: History[CopyCounts] = field(init=False)  # its copies (CUDA); its engine's summed (TREE, the taps')
    gpu: GpuUse = field(default_factory=GpuUse)  # NVML's, taken with the CUDA family's
    uprobes: dict[str, UprobeState] = field(default_factory=dict)  # by uprobe family (the runner's)
    uprobe_cost_ratio: float | None = None  # what the uprobes cost it (the self-cost meter's)
    transfers: History[TransferCounts] = field(init=False)  # by library (the transfer family's)
    in_flight: TransfersInFlight = NONE_IN_FLIGHT  # its transfers not completed yet
    engine: History[ScrapeCounts] = field(init=False)  # its engine's /metrics counters (the taps', tapped only)
    engine_tiers: History[TierCounts] = field(init=False)  # its engine's tier counters, by tier_key
    engine_state: EngineState = NO_ENGINE  # its engine's gauges this tick (the taps')
    kv: History[MediumCounts] = field(init=False)  # its KV event streams' counts by medium (the taps')
    kv_events: History[StreamEvents] = field(init=False)  # ... stream-wide, under STREAM
    kv_state: KVState = NO_STREAM  # ... and gauges
    tenants: History[TenantCounts] = field(init=False)  # its GPU pool by tenant label (the taps')
    losses: History[LostBytes] = field(init=False)  # its KV loss ledger's rows, by loss_key (the ledger's)

    def __post_init__(self) -> None:
        h = self.horizon
        self.memory = History(MemoryCounters, h)
        self.allocator = History(AllocatorCounts, h)
        self.copies = History(CopyCounts, h)
        self.transfers = History(TransferCounts, h)
        self.engine = History(ScrapeCounts, h)
        self.engine_tiers = History(TierCounts, h)
        self.kv = History(MediumCounts, h)
        self.kv_events = History(StreamEvents, h)
        self.tenants = History(TenantCounts, h)
        self.losses = History(LostBytes, h)

    @property
    def key(self) -> str:
        return str(self.proc.identity)

    @property
    def pid(self) -> int:
        return self.proc.pid


def process_labels(t: Tracked) -> dict[str, str]:
    """The labels a watched process carries on every metric and alert."""
    lab = t.proc.labels
    return {
        "pid": str(t.pid),
        "engine": lab.engine,
        "role": lab.role,
        "component": lab.component,
        "container": lab.container,
        "pod": lab.pod,
    }


@dataclass(slots=True)
class TrackerStats:
    label_overflow: int = 0
    kernel_map_full: int = 0
    hints_dropped: int = 0
    orphans_adopted: int = 0


class ProcessTracker:
    def __init__(
        self,
        discovery: Discovery,
        procfs: ProcFS,
        kernel: WatchSink | None,
        *,
        clock: Callable[[], float],
        max_processes: int,
        follow_children: bool = True,
        hints_per_tick: int = 200,
        history_seconds: float = 120.0,
    ) -> None:
        self.discovery = discovery
        self.procfs = procfs
        self.kernel = kernel
        self.clock = clock
        self.max_processes = max_processes
        self.follow_children = follow_children
        self.hints_per_tick = hints_per_tick
        self.history_seconds = history_seconds
        self.by_pid: dict[int, Tracked] = {}
        self.stats = TrackerStats()
        self._hints: dict[int, None] = {}  # ordered set of PIDs to examine
        self.removed: list[Tracked] = []  # removed since the last take_removed()
        # recently removed processes, for records that arrive after the exit was handled
        self._gone: dict[int, tuple[Tracked, float]] = {}

    # --- membership --------------------------------------------------------------------
    def tracked(self) -> list[Tracked]:
        return list(self.by_pid.values())

    def get(self, pid: int) -> Tracked | None:
        return self.by_pid.get(pid)

    def get_recent(self, pid: int) -> Tracked | None:
        """A watched process, or one removed within the last ``RECENT_SECONDS`` (an OOM
        record can reach us after procfs already showed the victim gone)."""
        t = self.by_pid.get(pid)
        if t is not None:
            return t
        gone = self._gone.get(pid)
        if gone is not None and self.clock() - gone[1] <= RECENT_SECONDS:
            return gone[0]
        return None

    def add(self, proc: DiscoveredProcess, root_tgid: int | None = None) -> Tracked | None:
        pid = proc.pid
        current = self.by_pid.get(pid)
        if current is not None:
            if current.proc.identity == proc.identity:
                return current
            # PID recycled: the old process is gone, whatever the exit path said
            self._remove(current, reason="pid reused")
        live = sum(1 for t in self.by_pid.values() if t.exited_at is None)
        if live >= self.max_processes:
            self.stats.label_overflow += 1
            if self.kernel is not None and root_tgid is not None:
                self.kernel.unwatch(pid)  # a child the kernel added on its own
            return None
        t = Tracked(proc, self.clock(), self.history_seconds)
        if self.kernel is not None:
            if root_tgid is None:
                self.kernel.unwatch(pid)  # clear any counters a previous owner of the PID left
            t.in_kernel = self.kernel.watch(pid, root_tgid if root_tgid is not None else pid)
            if not t.in_kernel:
                self.stats.kernel_map_full += 1
        self.by_pid[pid] = t
        log.info(
            "watching process",
            pid=pid,
            engine=proc.labels.engine,
            component=proc.labels.component,
            source=proc.source,
            comm=proc.comm,
        )
        return t

    def _remove(self, t: Tracked, reason: str) -> None:
        if self.by_pid.get(t.pid) is t:
            del self.by_pid[t.pid]
            if self.kernel is not None and t.in_kernel:
                self.kernel.unwatch(t.pid)
        self.removed.append(t)
        now = self.clock()
        self._gone[t.pid] = (t, now)
        for pid, (_, at) in list(self._gone.items()):
            if now - at > RECENT_SECONDS:
                del self._gone[pid]
        log.info("process no longer watched", pid=t.pid, reason=reason, engine=t.proc.labels.engine)

    def take_removed(self) -> list[Tracked]:
        out, self.removed = self.removed, []
        return out

    # --- discovery --------------------------------------------------------------------------
    def rescan(self) -> None:
        for proc in self.discovery.scan():
            self.add(proc)
        self._check_alive()
        self._adopt_orphans()

    def _check_alive(self) -> None:
        now = self.clock()
        for t in list(self.by_pid.values()):
            if t.exited_at is not None:
                continue
            try:
                alive = self.procfs.stat(t.pid).start_ticks == t.proc.identity.start_ticks
            except ProcError:
                alive = False
            if not alive:
                t.exited_at = now

    def _adopt_orphans(self) -> None:
        """Children the kernel added whose fork event we missed (ring buffer full)."""
        if self.kernel is None or not self.follow_children:
            return
        for tgid, root in self.kernel.watched().items():
            if tgid in self.by_pid:
                continue
            parent = self.by_pid.get(root)
            if parent is None or not self._add_child(tgid, parent):
                self.kernel.unwatch(tgid)
            else:
                self.stats.orphans_adopted += 1

    def _add_child(self, pid: int, parent: Tracked) -> bool:
        try:
            info = self.procfs.info(pid)
        except ProcError:
            return False
        proc = self.discovery.describe(
            info, parent.proc.labels.engine, "child", role=parent.proc.labels.role, parent=parent.proc
        )
        return self.add(proc, root_tgid=parent.pid) is not None

    # --- kernel events ------------------------------------------------------------------------
    def on_fork(self, parent_tgid: int, child_pid: int) -> None:
        parent = self.by_pid.get(parent_tgid)
        if parent is None or not self.follow_children:
            if self.kernel is not None:
                self.kernel.unwatch(child_pid)
            return
        if not self._add_child(child_pid, parent) and self.kernel is not None:
            self.kernel.unwatch(child_pid)  # gone already, or over the cap

    def on_exit(self, tgid: int) -> None:
        t = self.by_pid.get(tgid)
        if t is not None and t.exited_at is None:
            t.exited_at = self.clock()

    def hint(self, pid: int) -> None:
        """An exec or rename worth a look; examined (bounded) at the next tick."""
        if len(self._hints) >= 4 * max(self.hints_per_tick, 1):
            self.stats.hints_dropped += 1
            return
        self._hints[pid] = None

    def process_hints(self) -> None:
        budget = self.hints_per_tick
        for pid in list(self._hints):
            del self._hints[pid]
            if budget <= 0:
                self.stats.hints_dropped += 1
                continue
            budget -= 1
            t = self.by_pid.get(pid)
            if t is not None and t.exited_at is None:
                self._refresh_labels(t)
                continue
            d = self.discovery.examine(pid)
            if d is not None:
                self.add(d)

    def _refresh_labels(self, t: Tracked) -> None:
        """A watched process renamed itself (vLLM sets titles after start): update component."""
        try:
            info = self.procfs.info(t.pid)
        except ProcessGone:
            return
        except ProcError:
            return
        if info.identity != t.proc.identity:
            return
        parent = self.by_pid.get(info.ppid) if t.proc.source == "child" else None
        fresh = self.discovery.describe(
            info,
            t.proc.labels.engine,
            t.proc.source,
            role=t.proc.labels.role or None,
            parent=parent.proc if parent else None,
        )
        if fresh.labels != t.proc.labels:
            t.proc = fresh

    # --- counters ------------------------------------------------------------------------------
    def expire(self) -> None:
        now = self.clock()
        for t in list(self.by_pid.values()):
            if t.exited_at is not None and now - t.exited_at >= EXIT_GRACE_SECONDS:
                self._remove(t, reason="exited")

    def close(self) -> None:
        for t in list(self.by_pid.values()):
            self._remove(t, reason="shutdown")
