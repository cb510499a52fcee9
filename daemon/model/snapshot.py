"""The immutable snapshot the loop publishes once per tick, and the records it is made of.

Exporters (Prometheus, top, record) read only this: they never touch BPF maps,
so any number of concurrent readers see consistent numbers and nobody can
split a count by reading-and-clearing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvwatch.daemon.model.engines import AuditRow, EngineView, LossTotal, TenantsView
from kvwatch.daemon.model.memory import MemoryCounters, TierCounters
from kvwatch.probes.records import ApiCounters, XferCounters


@dataclass(frozen=True, slots=True)
class Alert:
    alert: str
    subject_key: str
    labels: Mapping[str, str]
    cause: str
    severity: str
    started_at: float  # wall-clock seconds
    values: Mapping[str, float]
    summary: str
    ended_at: float | None = None


@dataclass(frozen=True, slots=True)
class AlertsView:
    """The alert book as of a tick."""

    active: tuple[Alert, ...]
    fired: Mapping[str, int]  # onsets per alert: every alert the detectors raise, from zero
    recent: tuple[Alert, ...]  # onsets and clears, newest last
    sink_errors: int
    alertmanager: Mapping[str, int] | None  # sent / failed / dropped, when the direct sink is on
    labels: tuple[str, ...] = ()  # what the alerts' specs declare beyond a process's labels


@dataclass(frozen=True, slots=True)
class FamilyCost:
    """What one uprobe family's probes cost one watched process (``daemon/families/cost.py``)."""

    family: str  # cuda / transfer
    cost_seconds: float  # estimated, cumulative: probed calls x the per-call cost
    ratio: float | None  # of the process's CPU time, over the last judged window
    shed: bool  # its probes detached by the budget's circuit breaker
    sheds: int  # times they were


@dataclass(frozen=True, slots=True)
class ProgramRuns:
    family: str  # memory / cuda / transfer
    program: str  # the BPF function
    run_seconds: float  # kernel-side, while BPF statistics were on
    runs: int


@dataclass(frozen=True, slots=True)
class SelfCostView:
    """The node's side of the self-cost meter."""

    bpf_stats: bool  # the kernel's BPF run-time statistics are on
    canary_call_ns: float | None  # a probed call's cost to its caller, timed at start
    call_ns: Mapping[str, tuple[float, str]]  # per family: the per-call cost the meter uses, and its
    # source: canary / canary+bpf_stats / config
    programs: tuple[ProgramRuns, ...] = ()
    sheds: Mapping[str, int] | None = None  # per family, since start


@dataclass(frozen=True, slots=True)
class CudaView:
    """CUDA allocation counters of one process, since kvwatch attached to it."""

    apis: Mapping[str, ApiCounters]  # by api label: ok / err calls, bytes, frees of unknown size
    api_classes: Mapping[str, str]  # every allocation API probed, label -> alloc / free / map (copies apart)
    outstanding: Mapping[str, int]  # device / host / vmm: allocated minus freed (known sizes)
    failures: Mapping[tuple[str, int], int]  # (api, error code) -> failed calls
    symbols_attached: int
    libraries: tuple[str, ...]
    ucx_hooks: bool


@dataclass(frozen=True, slots=True)
class TransferView:
    """KV transfer counters of one process, since kvwatch attached to it."""

    xfers: Mapping[tuple[str, str], XferCounters]  # (lib, op) -> calls, errors, bytes, completed, durations
    registered_bytes: int  # RDMA: registered minus deregistered
    registrations: int
    deregistrations: int
    registration_errors: int
    released_incomplete: int
    symbols_attached: int
    libraries: tuple[str, ...]
    effective_bytes_per_second: float  # NIXL: bytes over summed transfer times, last 5 s


@dataclass(frozen=True, slots=True)
class ProcessRates:
    """Per second, over the snapshot's rate window."""

    page_free_pages: float = 0.0
    direct_reclaim_seconds: float = 0.0
    memcg_reclaim_seconds: float = 0.0
    cuda_alloc_calls: float = 0.0
    cuda_free_calls: float = 0.0
    cuda_alloc_bytes: float = 0.0
    cuda_freed_bytes: float = 0.0
    xfer_bytes: float = 0.0
    kv_removed_blocks: Mapping[str, float] = field(default_factory=dict)  # by medium
    kv_regretted_blocks: Mapping[str, float] = field(default_factory=dict)  # by medium
    kv_lost_bytes: Mapping[tuple[str, str], float] = field(default_factory=dict)  # by (tier, cause)


@dataclass(frozen=True, slots=True)
class TierReclaimer:
    """Who reclaimed a KV tier's page cache, and how much: one row of the tier's reclaim bytes,
    whose rows add up to them."""

    reclaimer: str  # cgroup (a task's, in reclaim) / kswapd / kdamond / other (cgroups past the cap) / unknown
    scope: str  # global (node-wide pressure) / memcg (a cgroup's limit); "" for unknown
    cgroup: str  # the reclaiming task's cgroup v2 path, or cgroup-id:<n>; "" but for reclaimer cgroup
    pod_uid: str
    container: str
    bytes: float
    bytes_per_second: float


@dataclass(frozen=True, slots=True)
class TierRates:
    reclaim_bytes: float = 0.0
    policy_bytes: float = 0.0
    refault_pages: float = 0.0


@dataclass(frozen=True, slots=True)
class ProcessView:
    key: str  # "pid@start_ticks"
    pid: int
    labels: Mapping[str, str]  # engine, role, component, container, pod
    source: str
    alive: bool
    memory: MemoryCounters
    rates: ProcessRates
    gpu_used_bytes: int | None = None
    cuda: CudaView | None = None
    transfers: TransferView | None = None
    engine: EngineView | None = None  # KV event streams and /metrics of this engine process
    kv_losses: Mapping[tuple[str, str], LossTotal] = field(default_factory=dict)  # (tier, cause): the ledger
    kv_audit: tuple[AuditRow, ...] = ()  # the KV metric-truth audit: engine counter vs kvwatch's evidence
    kv_tenants: TenantsView | None = None  # per tenant of the engine's KV pool, where the stream names tenants
    uprobe_costs: tuple[FamilyCost, ...] = ()  # what kvwatch's uprobes cost this process, per family


@dataclass(frozen=True, slots=True)
class TierView:
    key: str
    tier_id: int
    name: str
    path: str
    source: str
    owners: tuple[int, ...]
    files: int
    totals: TierCounters
    rates: TierRates
    reclaimers: tuple[TierReclaimer, ...] = ()  # the largest first


@dataclass(frozen=True, slots=True)
class ProbeView:
    name: str
    family: str
    target: str
    state: str
    required: bool
    hits: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Snapshot:
    wall_time: float
    monotonic: float
    tick: int
    ready: bool
    not_ready_reasons: tuple[str, ...]
    processes: tuple[ProcessView, ...] = ()
    tiers: tuple[TierView, ...] = ()
    alerts: tuple[Alert, ...] = ()
    alerts_fired: Mapping[str, int] = field(default_factory=dict)
    alert_labels: tuple[str, ...] = ()  # the labels the alerts' specs declare beyond a process's
    oom_kills: Mapping[tuple[str, str, str, str], int] = field(default_factory=dict)
    probes: tuple[ProbeView, ...] = ()
    lost: Mapping[str, int] = field(default_factory=dict)
    errors: Mapping[str, int] = field(default_factory=dict)
    watched_by_engine: Mapping[str, int] = field(default_factory=dict)
    label_overflow: int = 0
    loop_seconds: float = 0.0
    psi_memory_some_avg10: float | None = None
    recent_alerts: tuple[Alert, ...] = ()
    link_bytes_per_second: float = 0.0
    transfers_pending: int = 0
    uprobe_releases_pending: int = 0  # uprobes detached, their kernel release not finished yet
    alertmanager: Mapping[str, int] | None = None  # sent / failed / dropped, when the direct sink is on
    # the loss ledgers of processes gone within engines.loss_linger_seconds: (labels, rows)
    departed_losses: tuple[tuple[Mapping[str, str], Mapping[tuple[str, str], LossTotal]], ...] = ()
    self_cost: SelfCostView | None = None

    @staticmethod
    def empty(reason: str = "starting") -> Snapshot:
        return Snapshot(wall_time=0.0, monotonic=0.0, tick=0, ready=False, not_ready_reasons=(reason,))
