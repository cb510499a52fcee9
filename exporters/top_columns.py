"""``kvwatch top``'s process table columns and number formats: no rendering library here, so
that ``kvwatch``'s argument parser (``--sort``) loads none in the daemon."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvwatch.exporters.top_model import TopRow

MIB = 1024 * 1024


# --- formatting ---------------------------------------------------------------------------------
def num(v: float | None) -> str:
    """Rates and counts: 0, 7, 12.5, 1.2k, 3.4M; '-' when unknown."""
    if v is None:
        return "-"
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.1f}M"
    if a >= 1e4:
        return f"{v / 1e3:.1f}k"
    if a >= 100 or v == int(v):
        return f"{v:.0f}"
    return f"{v:.1f}"


def mib(v: float | None) -> str:
    """Bytes (or bytes/s) in MiB with one decimal; '-' when unknown."""
    return "-" if v is None else f"{v / MIB:.1f}"


def pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}%"


@dataclass(frozen=True)
class Column:
    key: str  # sort key
    title: str
    cell: Callable[[TopRow], str]
    value: Callable[[TopRow], Any]
    justify: str = "right"


def _who(r: TopRow) -> str:
    s = r.engine + (f"/{r.role}" if r.role else "")
    return s + (f" {r.component}" if r.component else "")


def _where(r: TopRow) -> str:
    return r.pod or r.container or "-"


COLUMNS: tuple[Column, ...] = (
    Column("pid", "PID", lambda r: str(r.pid), lambda r: r.pid),
    Column("engine", "ENGINE/ROLE", _who, _who, "left"),
    Column("pod", "POD/CONTAINER", _where, _where, "left"),
    Column("gpu", "GPU MiB", lambda r: mib(r.gpu_bytes), lambda r: r.gpu_bytes or 0),
    Column("alloc", "ALLOC/s", lambda r: num(r.alloc_per_s), lambda r: r.alloc_per_s),
    Column("allocb", "ALLOC MiB/s", lambda r: mib(r.alloc_bytes_per_s), lambda r: r.alloc_bytes_per_s),
    Column("free", "FREE/s", lambda r: num(r.free_per_s), lambda r: r.free_per_s),
    Column("dev", "DEV MiB", lambda r: mib(r.outstanding_device), lambda r: r.outstanding_device or 0),
    Column("host", "HOST MiB", lambda r: mib(r.outstanding_host), lambda r: r.outstanding_host or 0),
    Column("pgfree", "PGFREE/s", lambda r: num(r.page_free_per_s), lambda r: r.page_free_per_s),
    Column("evict", "EVICT MiB/s", lambda r: mib(r.evict_reclaim_bps), lambda r: r.evict_reclaim_bps),
    Column("policy", "DEL MiB/s", lambda r: mib(r.evict_policy_bps), lambda r: r.evict_policy_bps),
    Column("stall", "STALL ms/s", lambda r: num(r.stall_ms_per_s), lambda r: r.stall_ms_per_s),
    Column("xfer", "XFER MiB/s", lambda r: mib(r.xfer_bps), lambda r: r.xfer_bps),
    Column("bw", "EFF MiB/s", lambda r: mib(r.xfer_effective_bps or None), lambda r: r.xfer_effective_bps),
    Column("link", "LINK", lambda r: pct(r.link_pct), lambda r: r.link_pct or 0.0),
    Column("kv", "KV RM/s", lambda r: num(r.kv_removed_per_s), lambda r: r.kv_removed_per_s or 0.0),
    Column("regret", "REGRET", lambda r: pct(r.regret_pct), lambda r: r.regret_pct or 0.0),
    Column("lost", "LOST MiB/s", lambda r: mib(r.lost_bps), lambda r: r.lost_bps or 0.0),
    Column("cause", "LOST MOST", lambda r: r.lost_cause or "-", lambda r: r.lost_cause, "left"),
    Column("alerts", "ALERTS", lambda r: ",".join(r.alerts) or "-", lambda r: len(r.alerts), "left"),
)
SORT_KEYS = tuple(c.key for c in COLUMNS)
