"""The daemon's loop: probes → typed records → per-process windows → detectors → one snapshot per tick.

The loop owns the detectors, windows and alerts; the HTTP server and other readers
only see the immutable ``Snapshot`` it publishes. Work that blocks in the kernel or on
the network runs beside it: each uprobe family's attacher (daemon/families/runner.py), the KV
event hub, the engine scraper and the Alertmanager sender; the loop reads what they
publish.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
from kvwatch.daemon.alerts import AlertBook, AlertSink, LogSink
from kvwatch.daemon.config import Config
from kvwatch.daemon.detectors.base import Finding, Subject
from kvwatch.daemon.detectors.registry import build_detectors
from kvwatch.daemon.detectors.view import NodeView, OomEvent, ProcessWindow, TierWindow
from kvwatch.daemon.discovery import Discovery
from kvwatch.daemon.engines.taps import EngineTaps
from kvwatch.daemon.families.cuda import CudaTracker
from kvwatch.daemon.families.runner import UprobeFamily
from kvwatch.daemon.families.transfer import TransferTracker, link_bytes_per_second
from kvwatch.daemon.kvtiers import KVTierRegistry, Tier
from kvwatch.daemon.logs import ErrorBook
from kvwatch.daemon.nvml import Nvml
from kvwatch.daemon.oom_events import oom_event
from kvwatch.daemon.procfs import ProcFS
from kvwatch.daemon.psi import PressureReader
from kvwatch.daemon.publish import build_snapshot, process_labels
from kvwatch.daemon.series import SeriesSet
from kvwatch.daemon.snapshot import Snapshot
from kvwatch.daemon.tracker import ProcessTracker, Tracked
from kvwatch.probes.bpf import release_compiler_memory
from kvwatch.probes.cuda import CudaProbes
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
    TransferDone,
)
from kvwatch.probes.transfer import TransferProbes

log = structlog.get_logger("kvwatch.agent")

PAGE_SIZE = 4096
PROCESS_TOTALS = (
    "page_free_pages",
    "direct_reclaim_seconds",
    "direct_reclaim_count",
    "memcg_reclaim_seconds",
    "memcg_reclaim_count",
)


@dataclass(slots=True)
class _Published:
    snapshot: Snapshot


@dataclass(slots=True)
class _Subscriber:
    on_tick: Callable[[Snapshot], None]
    on_transfers: Callable[[list[TransferDone]], None] | None


class Agent:
    def __init__(
        self,
        config: Config,
        *,
        memory: MemoryProbes | None,
        cuda: CudaProbes | None = None,
        transfer: TransferProbes | None = None,
        engines: EngineTaps | None = None,
        procfs: ProcFS | None = None,
        nvml: Nvml | None = None,
        sinks: Sequence[AlertSink] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.memory = memory
        self.clock = clock
        self.errors = ErrorBook()
        self.cuda_family: UprobeFamily[CudaProbes, CudaTracker] = UprobeFamily(
            "cuda",
            cuda,
            lambda p: CudaTracker(p, self.errors, clock=clock, rescan_seconds=config.probes.cuda_rescan_seconds),
            enabled=config.probes.cuda,
        )
        self.transfer_family: UprobeFamily[TransferProbes, TransferTracker] = UprobeFamily(
            "transfer",
            transfer,
            lambda p: TransferTracker(
                p,
                self.errors,
                clock=clock,
                rescan_seconds=config.probes.transfer_rescan_seconds,
                peer_grace_seconds=config.detectors.transfer_collapse.peer_grace_seconds,
            ),
            enabled=config.probes.transfer,
        )
        self.link_bytes_per_second = link_bytes_per_second(
            config.transfers.link_bits_per_second, config.transfers.link_interface
        )
        self.procfs = procfs or ProcFS(config.discovery.proc_root)
        self.nvml = nvml
        self.wall = wall
        nvml_pids = nvml.pids if nvml is not None else None
        self.discovery = Discovery(config.discovery, self.procfs, nvml_pids, config.engines.endpoints)
        self.tracker = ProcessTracker(
            self.discovery,
            self.procfs,
            memory if memory is not None else None,
            clock=clock,
            max_processes=config.discovery.max_processes,
            follow_children=config.discovery.follow_children,
            hints_per_tick=config.discovery.exec_hints_per_tick,
        )
        self.tiers: KVTierRegistry | None = None
        self.pressure = PressureReader(config.discovery.proc_root)
        self.detectors = build_detectors(config.detectors, self.link_bytes_per_second)
        self.engines = engines
        if engines is not None:
            engines.errors = self.errors  # one error book for the whole loop
        default_sinks: list[AlertSink] = [LogSink()] if config.alerts.log else []
        self.alerts = AlertBook(default_sinks + list(sinks or []))
        self.statuses: list[HookStatus] = []
        self.tier_series: dict[int, SeriesSet] = {}
        self.tier_first_seen: dict[int, float] = {}
        self.oom_kills: dict[tuple[str, str, str, str], int] = {}
        self._pending_oom: list[OomEvent] = []
        self._subscribers: list[_Subscriber] = []
        self._sample: MemorySample | None = None
        self._next_scan = 0.0
        self._tick = 0
        self._published = _Published(Snapshot.empty())
        self._lost_userspace = {"malformed_events": 0}
        self._device_totals = nvml.device_memory_total() if nvml is not None else []
        self.gpu_used: dict[int, int] = {}

    @property
    def families(
        self,
    ) -> tuple[UprobeFamily[CudaProbes, CudaTracker] | UprobeFamily[TransferProbes, TransferTracker], ...]:
        return (self.cuda_family, self.transfer_family)

    @property
    def cuda_tracker(self) -> CudaTracker | None:
        return self.cuda_family.tracker

    @property
    def transfer_tracker(self) -> TransferTracker | None:
        return self.transfer_family.tracker

    # --- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        if self.memory is not None:
            try:
                self.statuses = self.memory.start()
            except ProbeError as err:
                self.errors.record("probe_load", "kernel-memory probes did not load", err)
                self.statuses = [
                    HookStatus(h.name, "memory", h.tracepoint, HookState.FAILED, str(err), h.required) for h in HOOKS
                ]
                self.memory = None
                self.tracker.kernel = None
            else:
                self.tiers = KVTierRegistry(
                    self.config.kv_tiers,
                    self.memory,
                    proc_root=self.config.discovery.proc_root,
                    max_tiers=self.memory.options.max_tiers,
                    clock=self.clock,
                )
            for st in self.statuses:
                if st.state is not HookState.ATTACHED:
                    log.warning("probe not attached", probe=st.name, state=st.state.value, reason=st.reason)
        for family in self.families:
            family.start(self.errors)
        if self.memory is not None or any(f.probes is not None for f in self.families):
            release_compiler_memory()
        if self.engines is not None:
            self.engines.start()
        self.tick()

    @property
    def snapshot(self) -> Snapshot:
        return self._published.snapshot

    # --- what the snapshot is built from (publish.py) ---------------------------------------------
    @property
    def tick_count(self) -> int:
        return self._tick

    @property
    def memory_sample(self) -> MemorySample | None:
        """The kernel-memory family's last sample (hits and losses of its hooks)."""
        return self._sample

    @property
    def userspace_lost(self) -> dict[str, int]:
        """Events dropped on this side of the ring buffer (malformed)."""
        return dict(self._lost_userspace)

    # --- subscribers: called in the loop's thread after each published snapshot ----------------------
    def subscribe(
        self, on_tick: Callable[[Snapshot], None], on_transfers: Callable[[list[TransferDone]], None] | None = None
    ) -> Callable[[], None]:
        """``on_tick`` after every snapshot; ``on_transfers`` with the KV transfers completed since
        the last tick, one record each (this turns on per-transfer events in the kernel while
        subscribed). Returns the unsubscribe."""
        sub = _Subscriber(on_tick, on_transfers)
        self._subscribers.append(sub)
        tt = self.transfer_tracker
        if on_transfers is not None and tt is not None:
            tt.probes.set_emit_events(True)
            tt.events.clear()

        def unsubscribe() -> None:
            if sub in self._subscribers:
                self._subscribers.remove(sub)
            if tt is not None and not any(s.on_transfers for s in self._subscribers):
                tt.probes.set_emit_events(False)

        return unsubscribe

    def _notify(self, snap: Snapshot) -> None:
        tt = self.transfer_tracker
        done: list[TransferDone] = []
        if tt is not None and any(s.on_transfers for s in self._subscribers):
            done, tt.events = tt.events, []
        for sub in list(self._subscribers):
            try:
                sub.on_tick(snap)
                if sub.on_transfers is not None:
                    sub.on_transfers(done)
            except Exception as err:
                self.errors.record("subscriber", "a snapshot subscriber failed", err)

    def run(self, stop: threading.Event) -> None:
        """Tick until ``stop`` is set; between ticks, drain ring buffers as events arrive.

        The memory ring wakes the poll itself. The uprobe families' rings are not in that
        poll, so while any process has uprobes attached the loop also wakes every 100 ms
        to drain them; with none attached it sleeps until the tick (each wakeup costs
        ~0.6 ms of CPU on the development VM: 10 a second were a third of the idle cost)."""
        period = self.config.daemon.tick_seconds
        next_tick = self.clock() + period
        while not stop.is_set():
            remaining = next_tick - self.clock()
            if remaining > 0:
                wait = min(remaining, 0.1) if any(f.active() for f in self.families) else remaining
                if self.memory is not None:
                    try:
                        self.memory.poll(int(wait * 1000))
                    except Exception as err:
                        self.errors.record("ring_poll", "ring buffer poll failed", err)
                        stop.wait(wait)
                else:
                    stop.wait(wait)
                for family in self.families:
                    family.consume(self.errors)
                if self._has_urgent_events():
                    self.tick()
                continue
            next_tick += period
            if next_tick < self.clock():
                next_tick = self.clock() + period  # we fell behind: do not try to catch up
            self.tick()

    def _has_urgent_events(self) -> bool:
        """OOM kills are acted on at once, not at the next tick."""
        if self.memory is None:
            return False
        return any(isinstance(e, OomKill) for e in self.memory.pending())

    def close(self) -> None:
        self.alerts.close()
        if self.engines is not None:
            self.engines.close()
        for family in self.families:
            family.close()
        if self.tiers is not None:
            self.tiers.close()
        self.tracker.close()
        if self.memory is not None:
            self.memory.close()
        if self.nvml is not None:
            self.nvml.close()

    # --- one tick ------------------------------------------------------------------------
    def tick(self) -> Snapshot:
        t0 = time.perf_counter()
        now = self.clock()
        self._tick += 1
        for name, step in (
            ("events", self._drain_events),
            ("hints", self.tracker.process_hints),
            ("discovery", lambda: self._discover(now)),
            ("kv_tiers", self._refresh_tiers),
            ("cuda", lambda: self.cuda_family.tick(self.tracker.tracked())),
            ("transfer", lambda: self.transfer_family.tick(self.tracker.tracked())),
            ("engines", self._sync_engines),
            ("sample", lambda: self._ingest(now)),
        ):
            try:
                step()
            except Exception as err:  # one failing step must not stop the loop
                self.errors.record(f"tick_{name}", f"tick step {name} failed", err)
        findings: list[Finding] = []
        try:
            findings = self._detect(now)
        except Exception as err:
            self.errors.record("detectors", "detector evaluation failed", err)
        self.alerts.apply(findings, self.wall())
        self.tracker.expire()
        for gone in self.tracker.take_removed():
            for d in self.detectors:
                d.forget(gone.key)
            self.alerts.drop_subject(gone.key, self.wall())
        snap = self._build_snapshot(now, time.perf_counter() - t0)
        self._published = _Published(snap)
        self._notify(snap)
        return snap

    def _drain_events(self) -> None:
        if self.memory is None:
            return
        batch = self.memory.take_events()
        self._lost_userspace["malformed_events"] += batch.malformed
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

    def _discover(self, now: float) -> None:
        if now < self._next_scan:
            return
        self._next_scan = now + self.config.discovery.interval_seconds
        self.tracker.rescan()
        self.errors.add("discovery_vanished", self.discovery.stats.vanished)
        self.errors.add("discovery_denied", self.discovery.stats.denied)
        self.errors.add("discovery_errors", self.discovery.stats.errors)
        if self.tiers is not None:
            self.tiers.sync(t.proc for t in self.tracker.tracked() if t.exited_at is None)

    def _sync_engines(self) -> None:
        if self.engines is not None:
            self.engines.sync(self.tracker.tracked())

    def _refresh_tiers(self) -> None:
        if self.tiers is not None:
            self.tiers.refresh()

    def _ingest(self, now: float) -> None:
        if self.nvml is not None:
            try:
                self.gpu_used = self.nvml.used_by_pid()
            except Exception as err:
                self.errors.record("nvml", "NVML query failed", err)
        device_total = float(max(self._device_totals, default=0))
        tracked = self.tracker.tracked()
        self.cuda_family.add_series(
            tracked,
            now,
            lambda pid: {"gpu_device_total_bytes": device_total, "gpu_used_bytes": float(self.gpu_used.get(pid, 0))},
        )
        self.transfer_family.add_series(tracked, now)
        if self.engines is not None:
            self.engines.add_series(tracked, now)
        if self.memory is None:
            return
        sample = self.memory.sample()
        self._sample = sample
        for t in self.tracker.tracked():
            c = sample.processes.get(t.pid)
            if c is None:
                totals = dict.fromkeys(PROCESS_TOTALS, 0.0)
            else:
                totals = {
                    "page_free_pages": float(c.page_free_pages),
                    "direct_reclaim_seconds": c.direct_reclaim_ns / 1e9,
                    "direct_reclaim_count": float(c.direct_reclaim_count),
                    "memcg_reclaim_seconds": c.memcg_reclaim_ns / 1e9,
                    "memcg_reclaim_count": float(c.memcg_reclaim_count),
                }
            t.totals = totals
            t.series.add(now, totals)
        if self.tiers is None:
            return
        for tier_id in self.tiers.tier_by_id():
            c2 = sample.tiers.get(tier_id)
            pages = {
                "reclaim_pages": float(c2.reclaim_pages) if c2 else 0.0,
                "policy_pages": float(c2.policy_pages) if c2 else 0.0,
                "refault_pages": float(c2.refault_pages) if c2 else 0.0,
                "added_pages": float(c2.added_pages) if c2 else 0.0,
            }
            pages["reclaim_bytes"] = pages["reclaim_pages"] * PAGE_SIZE
            pages["policy_bytes"] = pages["policy_pages"] * PAGE_SIZE
            series = self.tier_series.setdefault(tier_id, SeriesSet(120.0))
            self.tier_first_seen.setdefault(tier_id, now)
            series.add(now, pages)

    def tier_owners(self, tier: Tier) -> list[Tracked]:
        """Processes a tier belongs to: named by their environment or config, or seen
        (by the kernel) bringing the tier's pages into the page cache."""
        readers = self._sample.tier_readers if self._sample else {}
        config_pids = {d.owner_pid for d in self.config.kv_tiers.dirs if d.owner_pid and str(d.path) == str(tier.path)}
        out = []
        for t in self.tracker.tracked():
            if t.proc.identity in tier.owners or (t.pid, tier.tier_id) in readers or t.pid in config_pids:
                out.append(t)
        return out

    # --- detection ------------------------------------------------------------------------------
    def _process_window(self, t: Tracked, now: float) -> ProcessWindow:
        return ProcessWindow(
            subject=Subject(t.key, process_labels(t)),
            age=now - t.first_seen,
            series=t.series,
            alive=t.exited_at is None,
            memory_cgroup=t.proc.cgroup.memory_path,
            psi_some_avg10=self.pressure.cgroup(t.proc.cgroup.unified_path),
            environ=t.proc.environ,
        )

    def _detect(self, now: float) -> list[Finding]:
        procs = {t.key: self._process_window(t, now) for t in self.tracker.tracked()}
        tiers: dict[str, TierWindow] = {}
        if self.tiers is not None:
            for tier in self.tiers.tiers.values():
                series = self.tier_series.get(tier.tier_id)
                if series is None:
                    continue
                owners = tuple(procs[t.key] for t in self.tier_owners(tier))
                labels = {"tier": tier.name}
                if owners:
                    labels.update(owners[0].subject.labels)
                tiers[f"tier:{tier.tier_id}"] = TierWindow(
                    subject=Subject(f"tier:{tier.tier_id}", labels),
                    age=now - self.tier_first_seen.get(tier.tier_id, now),
                    series=series,
                    owners=owners,
                )
        view = NodeView(
            now=now,
            processes=procs,
            tiers=tiers,
            psi_memory_some_avg10=self.pressure.node(),
            oom_events=self._pending_oom,
            probes=self.statuses,
            probe_hits=self._sample.hits if self._sample else {},
        )
        self._pending_oom = []
        return [f for d in self.detectors for f in d.evaluate(view)]

    # --- publishing -----------------------------------------------------------------------------
    def not_ready_reasons(self) -> tuple[str, ...]:
        reasons: tuple[str, ...] = ()
        reasons += tuple(r for r in (f.not_ready() for f in self.families) if r)
        if self.memory is None and any(f for f in self.config.probes.memory):
            return ("kernel-memory probes not loaded", *reasons)
        return reasons + tuple(
            f"{s.family}/{s.name}: {s.state.value} ({s.reason})"
            for s in self.statuses
            if s.required and s.state not in (HookState.ATTACHED, HookState.DISABLED)
        )

    def _build_snapshot(self, now: float, loop_seconds: float) -> Snapshot:
        return build_snapshot(self, now, loop_seconds)
