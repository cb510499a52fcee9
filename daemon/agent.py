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
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import structlog

from kvwatch.daemon.alerts import AlertBook
from kvwatch.daemon.bus import SnapshotBus
from kvwatch.daemon.config import Config
from kvwatch.daemon.detectors.registry import Detector
from kvwatch.daemon.engines.audit import AuditInputs, Evidence, MetricAudit
from kvwatch.daemon.engines.ledger import LossLedger
from kvwatch.daemon.engines.losses import account_losses, account_oom
from kvwatch.daemon.engines.taps import EngineTaps
from kvwatch.daemon.families.cost import SelfCost, account_self_cost, calibrate_in_background
from kvwatch.daemon.families.cuda import CudaFamily, CudaProcesses
from kvwatch.daemon.families.gpu import GpuMemory
from kvwatch.daemon.families.memory import MemoryFamily
from kvwatch.daemon.families.transfer import TransferFamily, TransferProcesses
from kvwatch.daemon.host.allocator import Allocator
from kvwatch.daemon.host.procfs import ProcFS
from kvwatch.daemon.host.psi import PressureReader
from kvwatch.daemon.logs import ErrorBook
from kvwatch.daemon.model.findings import Finding, Subject
from kvwatch.daemon.model.snapshot import Snapshot
from kvwatch.daemon.model.windows import NodeWindow, ProcessWindow
from kvwatch.daemon.snapshots import Parts, ProcessParts, build_snapshot, process_views
from kvwatch.daemon.sources import Source
from kvwatch.daemon.tracker import ProcessTracker, Tracked, process_labels
from kvwatch.probes.bpf import release_compiler_memory
from kvwatch.probes.canary import BpfStats, CanaryResult
from kvwatch.probes.records import TransferDone

log = structlog.get_logger("kvwatch.agent")


class Stage(NamedTuple):
    """One stage of the tick: ``run(now)``; what it reads and what it leaves for the stages after
    it (the detectors read what they all left, through the windows)."""

    name: str
    run: Callable[[float], None]
    reads: str
    writes: str


@dataclass(slots=True)
class _Published:
    snapshot: Snapshot


@dataclass(slots=True)
class AgentParts:
    """Everything the loop runs, built by ``wiring.assemble`` (the one place that builds them)."""

    errors: ErrorBook
    procfs: ProcFS
    tracker: ProcessTracker
    memory: MemoryFamily
    gpu: GpuMemory
    cuda: CudaFamily
    transfer: TransferFamily
    engines: EngineTaps | None
    pressure: PressureReader
    detectors: list[Detector]
    losses: LossLedger
    audit: MetricAudit
    self_cost: SelfCost
    alerts: AlertBook
    link_bytes_per_second: float
    canary: Callable[[], CanaryResult] | None = None  # times a probed call at start (probes/canary.py)
    bpf_stats: BpfStats | None = None
    allocator: Allocator | None = None  # hands a burst's freed memory back (host/allocator.py)
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time


class Agent:
    def __init__(self, config: Config, parts: AgentParts) -> None:
        self.config = config
        self.clock, self.wall, self.errors, self.procfs = parts.clock, parts.wall, parts.errors, parts.procfs
        self.tracker = parts.tracker
        self.discovery = parts.tracker.discovery
        self.memory_family, self.gpu = parts.memory, parts.gpu
        self.cuda_family, self.transfer_family, self.engines = parts.cuda, parts.transfer, parts.engines
        self.pressure, self.detectors, self.alerts = parts.pressure, parts.detectors, parts.alerts
        self.losses, self.audit, self.self_cost = parts.losses, parts.audit, parts.self_cost
        self.link_bytes_per_second = parts.link_bytes_per_second
        self.canary, self.bpf_stats, self.allocator = parts.canary, parts.bpf_stats, parts.allocator
        # every source alike: started, sampled, asked what it lost and why it is not ready, closed
        self.sources: tuple[Source, ...] = (self.memory_family, self.gpu, *self.families)
        if self.engines is not None:
            self.sources += (self.engines,)
        self.bus = SnapshotBus(lambda: self.transfer_tracker, self.errors)
        self._next_scan = 0.0
        self._tick = 0
        self._published = _Published(Snapshot.empty())
        self._node_psi: float | None = None  # memory PSI of the node, read once a tick
        self._owners: dict[int, list[Tracked]] = {}  # KV tier -> its owner processes, once a tick
        self.stages = self._declare_stages()

    def _declare_stages(self) -> tuple[Stage, ...]:
        """The tick before detection, in order: each stage reads what the ones before it left."""
        return (
            Stage("events", self._drain, "memory ring", "process tree changes, OOM events"),
            Stage("oom_losses", self._account_oom, "OOM events, engine streams", "loss ledger"),
            Stage("hints", self._hints, "exec hints", "watched set"),
            Stage("discovery", self._discover, "processes (procfs)", "watched set, KV tiers' owners"),
            Stage("kv_tiers", self._refresh_tiers, "KV tier directories", "KV inodes"),
            *(
                Stage(f.name, partial(self._attach, f), "watched set", "its attacher's wanted set")
                for f in self.families
            ),
            Stage("engines", self._sync_engines, "watched set", "engine taps' plans"),
            Stage("sample", self._ingest, "every source", "processes' and tiers' histories"),
            Stage("tier_owners", self._tier_owners, "KV tiers, watched set", "tier owners"),
            Stage("losses", self._account_losses, "streams, tiers' page losses", "loss ledger, loss histories"),
            Stage("audit", self._audit, "engine histories, ledger", "audit rows"),
            Stage("self_cost", self._self_cost, "uprobe counters, BPF run time", "self-cost meter"),
            Stage("trim", self._trim, "the allocator's clock", "freed heap returned"),
        )

    def _drain(self, _now: float) -> None:
        self.memory_family.drain()

    def _hints(self, _now: float) -> None:
        self.tracker.process_hints()

    def _refresh_tiers(self, _now: float) -> None:
        self.memory_family.refresh_tiers()

    def _attach(self, family: CudaFamily | TransferFamily, _now: float) -> None:
        family.tick(self.tracker.tracked())

    @property
    def families(self) -> tuple[CudaFamily | TransferFamily, ...]:
        return (self.cuda_family, self.transfer_family)

    @property
    def cuda_tracker(self) -> CudaProcesses | None:
        return self.cuda_family.processes

    @property
    def transfer_tracker(self) -> TransferProcesses | None:
        return self.transfer_family.processes

    # --- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        for source in self.sources:
            if source is not self.engines:  # the engine taps start once the compilers' memory is back
                source.start()
        uprobes = any(f.probes is not None for f in self.families)
        if self.bpf_stats is not None and self.config.self_cost.bpf_stats and not self.bpf_stats.enable():
            self.errors.record("bpf_stats", "BPF statistics could not be turned on", None, reason=self.bpf_stats.error)
        if uprobes and self.canary is not None and self.config.self_cost.calibrate:
            calibrate_in_background(self.self_cost, self.canary, then=release_compiler_memory)
        elif uprobes and self.config.self_cost.call_cost_ns <= 0:
            log.warning(
                "uprobe cost not measured (self_cost.calibrate off, no call_cost_ns): the budget is not enforced"
            )
        if self.memory_family.probes is not None or uprobes:
            release_compiler_memory()
        if self.engines is not None:
            self.engines.start()
        self.tick()

    @property
    def snapshot(self) -> Snapshot:
        return self._published.snapshot

    @property
    def tick_count(self) -> int:
        return self._tick

    def subscribe(
        self, on_tick: Callable[[Snapshot], None], on_transfers: Callable[[list[TransferDone]], None] | None = None
    ) -> Callable[[], None]:
        """Hear of every published snapshot in the loop's thread (``daemon/bus.py``)."""
        return self.bus.subscribe(on_tick, on_transfers)

    def run(self, stop: threading.Event) -> None:
        """Tick until ``stop`` is set; between ticks, drain ring buffers as events arrive.

        The memory ring wakes the poll itself. The uprobe families' rings are not in that
        poll, so while any process has uprobes attached the loop also wakes every 100 ms
        to drain them; with none attached it sleeps until the tick, because every wakeup
        costs CPU that an idle node should not pay (docs/performance.md)."""
        period = self.config.daemon.tick_seconds
        next_tick = self.clock() + period
        while not stop.is_set():
            remaining = next_tick - self.clock()
            if remaining > 0:
                wait = min(remaining, 0.1) if any(f.active() for f in self.families) else remaining
                self.memory_family.poll(wait, stop)
                for family in self.families:
                    family.consume()
                if self.memory_family.has_urgent_events():
                    self.tick()
                continue
            next_tick += period
            if next_tick < self.clock():
                next_tick = self.clock() + period  # we fell behind: do not try to catch up
            self.tick()

    def close(self) -> None:
        self.alerts.close()
        if self.bpf_stats is not None:
            self.bpf_stats.close()
        for source in reversed(self.sources):  # the engine taps first, the kernel-memory probes last
            if source is self.memory_family:
                self.tracker.close()  # the watched processes leave the kernel's maps before its probes close
            source.close()

    # --- one tick ------------------------------------------------------------------------
    def tick(self) -> Snapshot:
        t0 = time.perf_counter()
        now = self.clock()
        self._tick += 1
        self._node_psi = self.pressure.node()  # read once: detectors and the snapshot see the same
        for stage in self.stages:
            try:
                stage.run(now)
            except Exception as err:  # one failing stage must not stop the loop
                self.errors.record(f"tick_{stage.name}", f"tick step {stage.name} failed", err)
        findings: list[Finding] = []
        try:
            findings = self._detect(now)
        except Exception as err:
            self.errors.record("detectors", "detector evaluation failed", err)
        self.alerts.apply(findings, self.wall())
        self.tracker.expire()
        self.losses.expire(now)
        for gone in self.tracker.take_removed():
            self.losses.depart(gone.key, process_labels(gone), now)
            for d in self.detectors:
                d.forget(gone.key)
            self.alerts.drop_subject(gone.key, self.wall())
        snap = self._build_snapshot(now, time.perf_counter() - t0)
        self._published = _Published(snap)
        self.bus.deliver(snap)
        return snap

    def _trim(self, now: float) -> None:
        if self.allocator is not None:
            self.allocator.trim(now)

    def _tier_owners(self, _now: float) -> None:
        """Which processes each KV tier belongs to, once a tick for the ledger, the detectors and
        the snapshot."""
        self._owners = self.memory_family.owners()

    def _discover(self, now: float) -> None:
        if now < self._next_scan:
            return
        self._next_scan = now + self.config.discovery.interval_seconds
        self.tracker.rescan()
        self.errors.add("discovery_vanished", self.discovery.stats.vanished)
        self.errors.add("discovery_denied", self.discovery.stats.denied)
        self.errors.add("discovery_errors", self.discovery.stats.errors)
        self.memory_family.sync_tiers(t.proc for t in self.tracker.tracked() if t.exited_at is None)

    def _sync_engines(self, _now: float) -> None:
        if self.engines is not None:
            self.engines.sync(self.tracker.tracked())

    def _ingest(self, now: float) -> None:
        tracked = self.tracker.tracked()
        for source in self.sources:  # NVML before the CUDA family, whose observations take its numbers
            source.sample(tracked, now)

    def _account_losses(self, now: float) -> None:
        account_losses(
            self.losses,
            self.engines,
            self.memory_family.tier_page_losses(),
            self.tracker.tracked(),
            now,
            owners=self._owners,
        )

    def _audit(self, now: float) -> None:
        engines = self.engines
        if engines is None:
            return
        self.audit.update(
            (
                (
                    t.key,
                    AuditInputs(t.copies, t.kv, t.kv_events, t.kv_state, t.engine_state),
                    Evidence(float(engines.copy_probes.get(t.key, False)), self.losses.exact_block_bytes(t.key)),
                )
                for t in self.tracker.tracked()
                if engines.tapped(t)
            ),
            now,
        )

    def _self_cost(self, now: float) -> None:
        stats_on = self.bpf_stats is not None and self.bpf_stats.active
        memory = self.memory_family.probes.program if self.memory_family.probes is not None else None
        account_self_cost(self.self_cost, self.families, memory, self.tracker.tracked(), self.procfs, stats_on, now)

    def _account_oom(self, _now: float) -> None:
        oom = self.memory_family.pending_oom_events()  # those since the detectors last took them
        if oom and self.engines is not None:
            account_oom(self.losses, self.engines, self.tracker.tracked(), oom)

    # --- detection ------------------------------------------------------------------------------
    def _process_window(self, t: Tracked, now: float) -> ProcessWindow:
        return ProcessWindow(
            subject=Subject(t.key, process_labels(t)),
            age=now - t.first_seen,
            alive=t.exited_at is None,
            psi_some_avg10=self.pressure.cgroup(t.proc.cgroup.unified_path),
            environ=t.proc.environ,
            audit=self.audit.rows.get(t.key, ()),
            tenants=t.tenants,
            transfers=t.transfers,
            in_flight=t.in_flight,
            allocator=t.allocator,
            engine=t.engine,
            engine_state=t.engine_state,
            kv=t.kv,
            kv_events=t.kv_events,
            kv_state=t.kv_state,
            memory=t.memory,
            copies=t.copies,
            gpu=t.gpu,
            uprobes=dict(t.uprobes),
            uprobe_cost_ratio=t.uprobe_cost_ratio,
        )

    def _detect(self, now: float) -> list[Finding]:
        procs = {t.key: self._process_window(t, now) for t in self.tracker.tracked()}
        sample = self.memory_family.last_sample
        view = NodeWindow(
            now=now,
            processes=procs,
            tiers=self.memory_family.tier_windows(now, procs, self._owners),
            psi_memory_some_avg10=self._node_psi,
            oom_events=self.memory_family.take_oom_events(),
            probes=self.memory_family.statuses,
            probe_hits=sample.hits if sample else {},
        )
        return [f for d in self.detectors for f in d.evaluate(view)]

    # --- publishing -----------------------------------------------------------------------------
    def not_ready_reasons(self) -> tuple[str, ...]:
        memory = self.memory_family.not_ready()
        rest = tuple(r for s in self.sources if s is not self.memory_family for r in s.not_ready())
        # probes that did not load at all come first
        return memory + rest if self.memory_family.probes is None else rest + memory

    def _build_snapshot(self, now: float, loop_seconds: float) -> Snapshot:
        tracked = self.tracker.tracked()
        engines = self.engines
        families = [f for f in self.families if f.processes is not None]
        cuda = self.cuda_family.processes
        transfers = self.transfer_family.processes

        def shed(pid: int) -> dict[str, bool]:
            return {f.name: bool(f.is_shed(pid)) for f in families}

        processes = process_views(
            tracked,
            ProcessParts(
                cuda=cuda.view if cuda is not None else lambda _pid: None,
                transfers=transfers.state if transfers is not None else lambda _pid: None,
                engines=engines.view if engines is not None else lambda _t: None,
                engine_window=self.config.detectors.eviction_burst.window_seconds,
                block_bytes=self.losses.block_bytes,
                losses={t.key: self.losses.rows(t.key) for t in tracked},
                audit=self.audit.rows,
                # folded by the taps' fold of the process, the one KVTenantThrash's tenant history uses
                tenants=lambda k, ev: engines.tenants.view(k, ev, self.losses.tenant_rows(k)) if engines else None,
                costs=lambda key, pid: self.self_cost.costs(key, shed(pid)),
                gpu_used=self.gpu.used,
            ),
        )
        lost = {"exec_hints_dropped": self.tracker.stats.hints_dropped}
        for source in self.sources:
            lost.update(source.lost())
        return build_snapshot(
            Parts(
                wall=self.wall(),
                now=now,
                tick=self._tick,
                loop_seconds=loop_seconds,
                not_ready=self.not_ready_reasons(),
                processes=processes,
                tiers=self.memory_family.tier_views(self._owners),
                alerts=self.alerts.view(),
                oom_kills=dict(self.memory_family.oom_kills),
                probes=tuple(v for s in self.sources for v in s.probe_views()),
                lost=lost,
                errors=dict(self.errors.counts),
                label_overflow=self.tracker.stats.label_overflow,
                psi_memory_some_avg10=self._node_psi,
                link_bytes_per_second=self.link_bytes_per_second,
                transfers_pending=transfers.pending if transfers is not None else 0,
                uprobe_releases_pending=sum(f.pending_releases() for f in self.families),
                departed_losses=self.losses.departed_rows(),
                self_cost=self.self_cost.view(f.name for f in families),
            )
        )
