"""The read-only view detectors evaluate: per-process and per-tier windows for one tick."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvwatch.daemon.model.cuda import AllocatorCounts, CopyCounts, GpuUse
from kvwatch.daemon.model.engine_scrape import NO_ENGINE, EngineState, ScrapeCounts
from kvwatch.daemon.model.engines import AuditRow, TenantCounts
from kvwatch.daemon.model.findings import Subject
from kvwatch.daemon.model.history import History
from kvwatch.daemon.model.kv_counts import NO_STREAM, KVState, MediumCounts, StreamEvents
from kvwatch.daemon.model.memory import MemoryCounters, TierCounters
from kvwatch.daemon.model.transfers import NONE_IN_FLIGHT, TransferCounts, TransfersInFlight
from kvwatch.daemon.model.uprobes import UprobeState
from kvwatch.probes.records import HookStatus


@dataclass(frozen=True, slots=True)
class ProcessWindow:
    subject: Subject
    age: float  # seconds since kvwatch first saw the process
    alive: bool = True
    psi_some_avg10: float | None = None  # the process's memory cgroup, where known
    environ: Mapping[str, str] = field(default_factory=dict)
    audit: Sequence[AuditRow] = ()  # the KV metric-truth audit's pairs (engine processes)
    tenants: History[TenantCounts] = field(default_factory=lambda: History(TenantCounts))  # GPU pool by tenant
    transfers: History[TransferCounts] = field(default_factory=lambda: History(TransferCounts))  # by library
    in_flight: TransfersInFlight = NONE_IN_FLIGHT  # the transfers not completed yet
    allocator: History[AllocatorCounts] = field(default_factory=lambda: History(AllocatorCounts))  # CUDA
    engine: History[ScrapeCounts] = field(default_factory=lambda: History(ScrapeCounts))  # its /metrics
    engine_state: EngineState = NO_ENGINE  # the engine's gauges, and whether it is tapped
    kv: History[MediumCounts] = field(default_factory=lambda: History(MediumCounts))  # KV events by medium
    kv_events: History[StreamEvents] = field(default_factory=lambda: History(StreamEvents))  # under STREAM
    kv_state: KVState = NO_STREAM  # the KV event stream's gauges
    memory: History[MemoryCounters] = field(default_factory=lambda: History(MemoryCounters))  # under MEMORY
    copies: History[CopyCounts] = field(default_factory=lambda: History(CopyCounts))  # CUDA copies
    gpu: GpuUse = field(default_factory=GpuUse)  # NVML's
    uprobes: Mapping[str, UprobeState] = field(default_factory=dict)  # by uprobe family
    uprobe_cost_ratio: float | None = None  # what the uprobes cost the process


@dataclass(frozen=True, slots=True)
class TierWindow:
    subject: Subject
    age: float
    pages: History[TierCounters]  # its page cache, under PAGES
    owners: Sequence[ProcessWindow] = ()


@dataclass(frozen=True, slots=True)
class TierPageLoss:
    """A KV tier's page cache dropped so far (cumulative bytes): by reclaim, or by the engine's
    own policy (deleting or truncating its files)."""

    tier_id: int
    reclaim_bytes: float
    policy_bytes: float


@dataclass(frozen=True, slots=True)
class OomEvent:
    """An OOM kill that concerns a watched process (itself, or a sibling in its memory cgroup)."""

    subject: Subject
    victim_pid: int
    victim_comm: str
    sibling_of: str  # "" when the victim itself was watched, else the watched process's key
    anon_rss_bytes: int
    file_rss_bytes: int
    at: float


@dataclass(frozen=True, slots=True)
class NodeWindow:
    now: float
    processes: Mapping[str, ProcessWindow]
    tiers: Mapping[str, TierWindow]
    psi_memory_some_avg10: float | None = None
    oom_events: Sequence[OomEvent] = ()
    probes: Sequence[HookStatus] = ()  # the kernel-memory hooks, as they attached
    probe_hits: Mapping[str, int] = field(default_factory=dict)  # times each fired
