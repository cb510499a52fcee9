"""Assembling the immutable per-tick snapshot from what each component hands over for the tick.

Every component exposes its own view (frozen data): the uprobe families their processes' CUDA
and transfer state and their probes, the memory family its probes and KV tiers, the engine taps
their views, the ledger its rows, the self-cost meter its costs, the alert book its alerts. The
agent gathers them once a tick into ``Parts``; ``build_snapshot`` only assembles, and reads each
process's typed histories (``daemon/model/``) for the snapshot's counters, rates and ratios.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from kvwatch.daemon.families.transfer import TransferProcessState
from kvwatch.daemon.model.cuda import CUDA
from kvwatch.daemon.model.engine_scrape import ENGINE, TierCounts, tier_key
from kvwatch.daemon.model.engines import AuditRow, EngineView, LossTotal, TenantsView, TierReading, loss_key
from kvwatch.daemon.model.history import History
from kvwatch.daemon.model.kv_counts import MediumCounts
from kvwatch.daemon.model.memory import MEMORY
from kvwatch.daemon.model.snapshot import (
    AlertsView,
    CudaView,
    FamilyCost,
    ProbeView,
    ProcessRates,
    ProcessView,
    SelfCostView,
    Snapshot,
    TierView,
    TransferView,
)
from kvwatch.daemon.model.transfers import NIXL, TransferCounts, effective_bandwidth
from kvwatch.daemon.tracker import Tracked, process_labels

RATE_WINDOW = 5.0


@dataclass(frozen=True, slots=True)
class ProcessParts:
    """What the components say of the watched processes this tick."""

    cuda: Callable[[int], CudaView | None]  # by pid
    transfers: Callable[[int], TransferProcessState | None]  # by pid
    engines: Callable[[Tracked], EngineView | None]  # the taps' view (ratios added here)
    engine_window: float  # the window of the engine's ratios (KVEvictionBurst's)
    block_bytes: Callable[[str], tuple[int, str] | None]  # by process key: the ledger's block size
    losses: Mapping[str, Mapping[tuple[str, str], LossTotal]]  # by process key
    audit: Mapping[str, tuple[AuditRow, ...]]  # by process key
    tenants: Callable[[str, EngineView | None], TenantsView | None]  # (key, engine view): the folded tenants
    costs: Callable[[str, int], tuple[FamilyCost, ...]]  # (key, pid)
    gpu_used: Mapping[int, int]


@dataclass(frozen=True, slots=True)
class Parts:
    """Everything a snapshot is made of, as the components handed it over for one tick."""

    wall: float
    now: float
    tick: int
    loop_seconds: float
    not_ready: tuple[str, ...]
    processes: tuple[ProcessView, ...]
    tiers: tuple[TierView, ...]
    alerts: AlertsView
    oom_kills: Mapping[tuple[str, str, str, str], int]
    probes: tuple[ProbeView, ...]
    lost: Mapping[str, int]
    errors: Mapping[str, int]
    label_overflow: int
    psi_memory_some_avg10: float | None
    link_bytes_per_second: float
    transfers_pending: int
    uprobe_releases_pending: int
    departed_losses: tuple[tuple[Mapping[str, str], Mapping[tuple[str, str], LossTotal]], ...]
    self_cost: SelfCostView | None


def process_rates(t: Tracked, losses: Mapping[tuple[str, str], LossTotal]) -> ProcessRates:
    """The process's rates over the rate window, from its histories; its loss rates per row of
    the ledger (``losses``) that has bytes."""
    mem = t.memory.rate(MEMORY, RATE_WINDOW)
    cuda = t.allocator.rate(CUDA, RATE_WINDOW)
    keys = {(tier, cause): loss_key(tier, cause) for tier, cause in losses}
    lost = {row: t.losses.rate(key, RATE_WINDOW).bytes for row, key in keys.items() if key in t.losses}
    removed, regretted = kv_rates(t.kv)
    return ProcessRates(
        page_free_pages=mem.page_free_pages,
        direct_reclaim_seconds=mem.direct_reclaim_seconds,
        memcg_reclaim_seconds=mem.memcg_reclaim_seconds,
        cuda_alloc_calls=cuda.alloc_calls,
        cuda_free_calls=cuda.free_calls,
        cuda_alloc_bytes=cuda.alloc_bytes,
        cuda_freed_bytes=cuda.freed_bytes,
        xfer_bytes=t.transfers.rate(NIXL, RATE_WINDOW).moved_bytes,
        kv_removed_blocks=removed,
        kv_regretted_blocks=regretted,
        kv_lost_bytes=lost,
    )


def regret_ratios(kv: History[MediumCounts], media: Sequence[str], window: float) -> dict[str, float]:
    """Per medium with removals over the window: blocks stored again after their removal,
    over blocks removed, both over the window."""
    out = {}
    for medium in sorted(media):
        d, _ = kv.delta(medium, window)
        if d.removed > 0:
            out[medium] = d.regretted / d.removed
    return out


def kv_rates(kv: History[MediumCounts]) -> tuple[dict[str, float], dict[str, float]]:
    """Per medium, blocks removed and regretted a second over the rate window."""
    removed, regretted = {}, {}
    for medium in kv:
        r = kv.rate(medium, RATE_WINDOW)
        removed[medium], regretted[medium] = r.removed, r.regretted
    return removed, regretted


def engine_view(
    view: EngineView | None, t: Tracked, window: float, block_bytes: tuple[int, str] | None
) -> EngineView | None:
    """The taps' view with what the process's observations say over the window: the prefix-hit
    ratio, the regret ratio per medium, each engine tier's hit ratio; and the block size the
    ledger priced with."""
    if view is None:
        return None
    engine, _ = t.engine.delta(ENGINE, window)
    q = engine.prefix_queries
    media = {m for st in view.streams for m in st.media}
    size, source = block_bytes or (None, "")
    return replace(
        view,
        hit_ratio=engine.prefix_hits / q if q > 0 else None,
        regret_ratio=regret_ratios(t.kv, sorted(media), window),
        tier_hit_ratio=tier_hit_ratios(t.engine_tiers, view.tiers, window),
        block_bytes=size,
        block_bytes_source=source,
    )


def tier_hit_ratios(
    counts: History[TierCounts], tiers: Iterable[TierReading], window: float
) -> dict[tuple[str, str], float]:
    """Per (source, tier): tokens found over tokens looked up, over the window, where the engine
    counts both; else the ratio it exports itself."""
    out: dict[tuple[str, str], float] = {}
    readings = list(tiers)
    hits = {(r.source, r.tier, r.unit) for r in readings if r.quantity == "hit"}
    for r in readings:
        if r.quantity == "hit_ratio":
            out[(r.source, r.tier)] = r.value
        elif r.quantity == "queried" and (r.source, r.tier, r.unit) in hits:
            d, _ = counts.delta(tier_key(r.source, r.tier, r.unit), window)
            if d.queried > 0:
                out[(r.source, r.tier)] = d.hit / d.queried
    return out


def transfer_view(st: TransferProcessState | None, transfers: History[TransferCounts]) -> TransferView | None:
    if st is None:
        return None
    c = st.counters
    return TransferView(
        xfers=dict(c.xfers) if c else {},
        registered_bytes=c.registered_bytes if c else 0,
        registrations=c.reg_calls if c else 0,
        deregistrations=c.dereg_calls if c else 0,
        registration_errors=c.reg_errors if c else 0,
        released_incomplete=c.released_incomplete if c else 0,
        symbols_attached=st.symbols_attached,
        libraries=st.libraries,
        effective_bytes_per_second=effective_bandwidth(transfers.delta(NIXL, RATE_WINDOW)[0]),
    )


def process_views(tracked: Sequence[Tracked], parts: ProcessParts) -> tuple[ProcessView, ...]:
    return tuple(_process_view(t, parts) for t in tracked)


def _process_view(t: Tracked, parts: ProcessParts) -> ProcessView:
    engine = engine_view(parts.engines(t), t, parts.engine_window, parts.block_bytes(t.key))
    return ProcessView(
        key=t.key,
        pid=t.pid,
        labels=process_labels(t),
        source=t.proc.source,
        alive=t.exited_at is None,
        memory=t.memory.last(MEMORY),
        rates=process_rates(t, parts.losses.get(t.key, {})),
        gpu_used_bytes=parts.gpu_used.get(t.pid),
        cuda=parts.cuda(t.pid),
        transfers=transfer_view(parts.transfers(t.pid), t.transfers),
        engine=engine,
        kv_losses=parts.losses.get(t.key, {}),
        kv_audit=parts.audit.get(t.key, ()),
        kv_tenants=parts.tenants(t.key, engine),
        uprobe_costs=parts.costs(t.key, t.pid),
    )


def build_snapshot(p: Parts) -> Snapshot:
    watched: dict[str, int] = {}
    for v in p.processes:
        if v.alive:
            watched[v.labels["engine"]] = watched.get(v.labels["engine"], 0) + 1
    return Snapshot(
        wall_time=p.wall,
        monotonic=p.now,
        tick=p.tick,
        ready=not p.not_ready,
        not_ready_reasons=p.not_ready,
        processes=p.processes,
        tiers=p.tiers,
        alerts=p.alerts.active,
        alerts_fired=p.alerts.fired,
        alert_labels=p.alerts.labels,
        oom_kills=p.oom_kills,
        probes=p.probes,
        lost=p.lost,
        errors={**p.errors, "alert_sink": p.alerts.sink_errors},
        watched_by_engine=watched,
        label_overflow=p.label_overflow,
        loop_seconds=p.loop_seconds,
        psi_memory_some_avg10=p.psi_memory_some_avg10,
        recent_alerts=p.alerts.recent,
        link_bytes_per_second=p.link_bytes_per_second,
        transfers_pending=p.transfers_pending,
        uprobe_releases_pending=p.uprobe_releases_pending,
        alertmanager=p.alerts.alertmanager,
        departed_losses=p.departed_losses,
        self_cost=p.self_cost,
    )
