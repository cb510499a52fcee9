"""The lanes of ``kvwatch record``'s process tracks, and the cumulative totals each counter lane
draws from a process's view (``record.py`` turns them into counts per tick)."""

from __future__ import annotations

from collections.abc import Mapping

from kvwatch.daemon.model.engines import LATENCY_NAMES
from kvwatch.daemon.model.snapshot import ProcessView
from kvwatch.probes.records import SEGMENT_ALLOCS, SEGMENT_FREES

MIB = 1024 * 1024


class Lane:
    CUDA = 1
    TRANSFERS = 2
    PAGE_CACHE = 3
    RECLAIM = 4
    KV_BLOCKS = 5
    ALERTS = 6
    KV_LOST = 7
    KV_TENANTS = 8
    ENGINE_LATENCY = 9


LANE_NAMES = {
    Lane.CUDA: "CUDA allocations",
    Lane.TRANSFERS: "KV transfers",
    Lane.PAGE_CACHE: "page cache",
    Lane.RECLAIM: "reclaim stalls",
    Lane.KV_BLOCKS: "KV blocks",
    Lane.ALERTS: "alerts",
    Lane.KV_LOST: "KV lost by tier and cause",
    Lane.KV_TENANTS: "KV tenants",
    Lane.ENGINE_LATENCY: "engine latency",
}
LATENCY_LABELS = {n: n.replace("_", " ") for n in LATENCY_NAMES}  # ttft, e2e, lmcache retrieve, nixl xfer, ...


def deltas(before: Mapping[str, float], now: Mapping[str, float]) -> dict[str, float]:
    """A counter lane's args: what each total grew by over the tick."""
    return {k: round(v - before.get(k, 0.0), 3) for k, v in now.items()}


def cuda_totals(p: ProcessView) -> dict[str, float]:
    if p.cuda is None:
        return {}
    apis = p.cuda.apis
    return {
        "allocs": float(sum(apis[a].ok for a in SEGMENT_ALLOCS if a in apis)),
        "frees": float(sum(apis[a].ok for a in SEGMENT_FREES if a in apis)),
        "alloc_mib": sum(apis[a].bytes for a in SEGMENT_ALLOCS if a in apis) / MIB,
        "failed": float(sum(apis[a].err for a in SEGMENT_ALLOCS if a in apis)),
    }


def kv_totals(p: ProcessView) -> dict[str, float]:
    if p.engine is None:
        return {}
    out: dict[str, float] = {}
    for medium, m in p.engine.media.items():
        out[f"stored {medium}"] = float(m.stored)
        out[f"removed {medium}"] = float(m.removed)
        out[f"regretted {medium}"] = float(m.regretted)
    return out


def tenant_totals(p: ProcessView) -> dict[str, float]:
    """The GPU pool's tenants (their labels: names, never a salt)."""
    if p.kv_tenants is None:
        return {}
    out: dict[str, float] = {}
    for r in p.kv_tenants.rows:
        if r.medium == "GPU":
            out[f"stored {r.tenant}"] = r.stored
            out[f"evicted {r.tenant}"] = r.removed
            out[f"recomputed {r.tenant}"] = r.regretted
    return out


def lost_totals(p: ProcessView) -> dict[str, float]:
    """The loss ledger's rows in MiB (blocks where the block size is not known yet)."""
    out: dict[str, float] = {}
    for (tier, cause), row in p.kv_losses.items():
        if row.bytes is not None:
            out[f"{tier} {cause} MiB"] = row.bytes / MIB
        else:
            out[f"{tier} {cause} blocks"] = float(row.blocks)
    return out


def reclaim_totals(p: ProcessView) -> dict[str, float]:
    m = p.memory
    return {
        "direct ms": 1000.0 * m.direct_reclaim_seconds,
        "memcg ms": 1000.0 * m.memcg_reclaim_seconds,
        "pages freed": m.page_free_pages,
    }


def latency_totals(p: ProcessView) -> dict[str, float]:
    """The engine's latency histograms, cumulative: ``<name> sum`` (seconds) and ``<name> count``."""
    if p.engine is None:
        return {}
    out: dict[str, float] = {}
    for r in p.engine.latencies:
        out[f"{r.name} sum"] = r.sum_seconds
        out[f"{r.name} count"] = r.count
    return out


def latency_args(before: Mapping[str, float], now: Mapping[str, float]) -> dict[str, float]:
    """Per histogram, ``<label> count``: observations over the tick, and ``<label> ms``: their
    mean in milliseconds (Δsum / Δcount), only where there were some: a tick without requests
    has no mean. A count that went back is an engine restarted: its counts since then are the
    tick's, as Prometheus' rate() reads a reset."""
    out: dict[str, float] = {}
    for name, label in LATENCY_LABELS.items():
        count, total = now.get(f"{name} count"), now.get(f"{name} sum")
        if count is None or total is None:
            continue
        count0, total0 = before.get(f"{name} count", 0.0), before.get(f"{name} sum", 0.0)
        if count < count0:
            count0, total0 = 0.0, 0.0
        n = count - count0
        out[f"{label} count"] = round(n, 3)
        if n > 0:
            out[f"{label} ms"] = round(1000.0 * (total - total0) / n, 3)
    return out
