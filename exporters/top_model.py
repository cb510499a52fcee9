"""What ``kvwatch top`` shows: one row per watched process and a header of node totals.

Pure: built from a published :class:`~kvwatch.daemon.model.snapshot.Snapshot`, so the
daemon can serve it as JSON (``/api/v1/top``) and ``top`` can build it from its
own probes when no daemon is reachable; both render the same frame. msgspec
structs: the daemon encodes and the client decodes (and validates) the same types.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any

import msgspec

from kvwatch.daemon.model.transfers import link_utilization

if TYPE_CHECKING:
    from kvwatch.daemon.model.snapshot import ProcessView, Snapshot

API_PATH = "/api/v1/top"
SCHEMA_VERSION = 1
MIB = 1024 * 1024


class TopRow(msgspec.Struct, frozen=True, kw_only=True):
    pid: int
    engine: str
    role: str
    component: str
    container: str
    pod: str
    alive: bool
    gpu_bytes: int | None  # NVML used memory; None where NVML is not available
    alloc_per_s: float  # successful CUDA segment allocations (cudaMalloc & co.)
    alloc_bytes_per_s: float
    free_per_s: float
    outstanding_device: int | None  # None: no CUDA library attached
    outstanding_host: int | None
    page_free_per_s: float  # pages released (kmem:mm_page_free)
    evict_reclaim_bps: float  # KV-tier page cache squeezed out by the kernel (tiers this process owns)
    evict_policy_bps: float  # deleted/truncated by the engine itself
    stall_ms_per_s: float  # direct + memcg reclaim stall
    xfer_bps: float  # KV transfer bytes moved (NIXL, UCX, NCCL)
    xfer_effective_bps: float  # NIXL: bytes over time spent in transfers
    link_pct: float | None  # effective bandwidth as % of the link; None when the link is unknown
    kv_removed_per_s: float | None  # KV blocks removed (engine events); None without an event stream
    regret_pct: float | None = None  # % of removed blocks stored again (the worst medium); None: no removals
    lost_bps: float | None = None  # KV bytes lost, every tier and cause (the loss ledger); None: no ledger
    lost_cause: str = ""  # the tier:cause losing the most bytes now
    alerts: tuple[str, ...] = ()


class TopTenant(msgspec.Struct, frozen=True, kw_only=True):
    """One tenant of one engine process's KV pool (a medium): cumulative blocks, its share now,
    and the noisy neighbour naming it (KVTenantThrash)."""

    pid: int
    engine: str
    tenant: str
    medium: str
    stored: float
    removed: float
    regretted: float
    regret_tokens: float
    resident: float
    share_pct: float  # of the medium's blocks held
    evicted_by: str = ""  # the aggressor, while KVTenantThrash fires with this tenant as victim


class TopAlert(msgspec.Struct, frozen=True, kw_only=True):
    alert: str
    severity: str
    cause: str
    pid: str
    summary: str
    started_at: float
    subject: str = ""  # the alert's subject key: one alert per (alert, subject)
    labels: dict[str, str] = msgspec.field(default_factory=dict)  # tier, tenant, aggressor, ...


class TopHeader(msgspec.Struct, frozen=True, kw_only=True):
    host: str
    wall_time: float
    tick: int
    ready: bool
    not_ready: tuple[str, ...]
    processes: int  # alive, watched
    engines: dict[str, int]
    gpu_bytes: int | None
    alloc_per_s: float
    evict_reclaim_bps: float  # all KV tiers on the node
    evict_policy_bps: float
    stall_ms_per_s: float
    xfer_bps: float
    link_bps: float
    probes_attached: int
    probes_failed: tuple[str, ...]  # name: state (failed, missing) for hooks that should be there
    probes_silent: tuple[str, ...]  # required hooks that have never fired
    lost_events: int
    lost: dict[str, int]
    loop_ms: float
    psi_some_avg10: float | None


class TopFrame(msgspec.Struct, frozen=True, kw_only=True):
    version: int = SCHEMA_VERSION
    header: TopHeader
    rows: tuple[TopRow, ...]
    alerts: tuple[TopAlert, ...]
    tenants: tuple[TopTenant, ...] = ()


def _row(p: ProcessView, snap: Snapshot, alerts: dict[str, list[str]]) -> TopRow:
    rates = p.rates
    owned = [t for t in snap.tiers if p.pid in t.owners]
    cuda = p.cuda
    xfer = p.transfers
    eff = xfer.effective_bytes_per_second if xfer is not None else 0.0
    removed = list(rates.kv_removed_blocks.values())
    return TopRow(
        pid=p.pid,
        engine=p.labels.get("engine", ""),
        role=p.labels.get("role", ""),
        component=p.labels.get("component", ""),
        container=p.labels.get("container", ""),
        pod=p.labels.get("pod", ""),
        alive=p.alive,
        gpu_bytes=p.gpu_used_bytes,
        alloc_per_s=rates.cuda_alloc_calls,
        alloc_bytes_per_s=rates.cuda_alloc_bytes,
        free_per_s=rates.cuda_free_calls,
        outstanding_device=int(cuda.outstanding.get("device", 0) + cuda.outstanding.get("vmm", 0))
        if cuda is not None
        else None,
        outstanding_host=int(cuda.outstanding.get("host", 0)) if cuda is not None else None,
        page_free_per_s=rates.page_free_pages,
        evict_reclaim_bps=sum(t.rates.reclaim_bytes for t in owned),
        evict_policy_bps=sum(t.rates.policy_bytes for t in owned),
        stall_ms_per_s=1000.0 * (rates.direct_reclaim_seconds + rates.memcg_reclaim_seconds),
        xfer_bps=rates.xfer_bytes,
        xfer_effective_bps=eff,
        link_pct=_percent(link_utilization(eff, snap.link_bytes_per_second)) if eff > 0 else None,
        kv_removed_per_s=sum(removed) if removed else None,
        regret_pct=100.0 * max(p.engine.regret_ratio.values()) if p.engine and p.engine.regret_ratio else None,
        **_lost(p),
        alerts=tuple(sorted(alerts.get(str(p.pid), []))),
    )


def _lost(p: ProcessView) -> dict[str, Any]:
    """Bytes lost per second over the ledger's rows, and the row losing the most."""
    rates = {f"{tier}:{cause}": v for (tier, cause), v in p.rates.kv_lost_bytes.items()}
    if not rates:
        return {}
    top = max(rates, key=lambda k: rates[k])
    return {"lost_bps": sum(rates.values()), "lost_cause": top if rates[top] > 0 else ""}


def build_frame(snap: Snapshot, host: str | None = None) -> TopFrame:
    by_pid: dict[str, list[str]] = {}
    for a in snap.alerts:
        by_pid.setdefault(a.labels.get("pid", ""), []).append(a.alert)
    rows = tuple(_row(p, snap, by_pid) for p in snap.processes)
    live = [r for r in rows if r.alive]
    gpu = [r.gpu_bytes for r in live if r.gpu_bytes is not None]
    failed = tuple(
        f"{p.name}: {p.state}"
        for p in snap.probes
        if p.state in ("failed", "missing") and (p.required or p.family == "memory")
    )
    # silent: an alert about a probe (its spec's label) with cause silent, KVWatchProbeDown's word for
    # a hook that fires constantly on any live node; quiet hooks (reclaim, OOM) legitimately stay at zero
    silent = tuple(a.labels["probe"] for a in snap.alerts if "probe" in a.labels and a.cause == "silent")
    lost = {k: int(v) for k, v in snap.lost.items() if v}
    header = TopHeader(
        host=host or socket.gethostname(),
        wall_time=snap.wall_time,
        tick=snap.tick,
        ready=snap.ready,
        not_ready=tuple(snap.not_ready_reasons),
        processes=len(live),
        engines=dict(snap.watched_by_engine),
        gpu_bytes=sum(gpu) if gpu else None,
        alloc_per_s=sum(r.alloc_per_s for r in live),
        evict_reclaim_bps=sum(t.rates.reclaim_bytes for t in snap.tiers),
        evict_policy_bps=sum(t.rates.policy_bytes for t in snap.tiers),
        stall_ms_per_s=sum(r.stall_ms_per_s for r in live),
        xfer_bps=sum(r.xfer_bps for r in live),
        link_bps=snap.link_bytes_per_second,
        probes_attached=sum(1 for p in snap.probes if p.state == "attached"),
        probes_failed=failed,
        probes_silent=silent,
        lost_events=sum(lost.values()),
        lost=lost,
        loop_ms=snap.loop_seconds * 1000.0,
        psi_some_avg10=snap.psi_memory_some_avg10,
    )
    alerts = tuple(
        TopAlert(
            alert=a.alert,
            severity=a.severity,
            cause=a.cause,
            pid=a.labels.get("pid", ""),
            summary=a.summary,
            started_at=a.started_at,
            subject=a.subject_key,
            labels=dict(a.labels),
        )
        for a in sorted(snap.alerts, key=lambda a: a.started_at)
    )
    return TopFrame(header=header, rows=rows, alerts=alerts, tenants=_tenants(snap))


def _tenants(snap: Snapshot) -> tuple[TopTenant, ...]:
    aggressors = {  # an alert naming a victim tenant and its aggressor (KVTenantThrash's labels)
        (a.labels.get("pid", ""), a.labels.get("tenant", "")): a.labels["aggressor"]
        for a in snap.alerts
        if "aggressor" in a.labels
    }
    out = []
    for p in snap.processes:
        if p.kv_tenants is None or not p.alive:
            continue
        held: dict[str, float] = {}
        for r in p.kv_tenants.rows:
            held[r.medium] = held.get(r.medium, 0.0) + r.resident
        for r in p.kv_tenants.rows:
            out.append(
                TopTenant(
                    pid=p.pid,
                    engine=p.labels.get("engine", ""),
                    tenant=r.tenant,
                    medium=r.medium,
                    stored=r.stored,
                    removed=r.removed,
                    regretted=r.regretted,
                    regret_tokens=r.regret_tokens,
                    resident=r.resident,
                    share_pct=100.0 * r.resident / held[r.medium] if held[r.medium] else 0.0,
                    evicted_by=aggressors.get((str(p.pid), r.tenant), "") if r.medium == "GPU" else "",
                )
            )
    return tuple(out)


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(TopFrame)


def encode(frame: TopFrame) -> bytes:
    return _ENCODER.encode(frame)


def decode(data: bytes) -> TopFrame:
    """Raises ``msgspec.ValidationError``/``DecodeError`` on anything that is not a frame."""
    return _DECODER.decode(data)


def _percent(share: float | None) -> float | None:
    return None if share is None else 100.0 * share
