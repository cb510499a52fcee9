"""An engine process's tenants, folded once for everyone who reads them.

One sticky ``TenantFold`` per tapped process, for as long as it runs (``TenantFolds``): the taps
fold the GPU pool's per-tenant counts through it for the detectors' tenant history (``pool``), and the
snapshot folds the streams' per-tenant counts and the ledger's per-tenant losses through the same
fold for the exporters (``view``). So every tenant an alert can name (KVTenantThrash's victim and
aggressor) is a tenant the exported rows carry under its own label, and a tenant the rows count
under ``other`` is ``other`` in the alert too.

Both fold with the same activity (blocks stored and removed, every medium, summed over the
process's streams) from the same tick's stream stats, so whichever folds first gives the labels
the other would have given.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields

from kvwatch.daemon.engines.tenants import TenantFold
from kvwatch.daemon.model.engines import (
    EngineView,
    LossTotal,
    MediumTotals,
    StreamStats,
    TenantCounts,
    TenantRow,
    TenantsView,
    tenants_by_medium,
)

COUNTED = ("stored", "removed", "removed_young", "regretted", "regret_tokens")
POOL = tuple(f.name for f in fields(TenantCounts))  # the GPU pool's counts the detectors judge
Key = tuple[str, ...]


class TenantFolds:
    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self._folds: dict[str, TenantFold] = {}

    def fold_of(self, key: str) -> TenantFold:
        """The process's fold, made at its first use."""
        fold = self._folds.get(key)
        if fold is None:
            fold = self._folds[key] = TenantFold(self.top_k)
        return fold

    def pool(self, key: str, streams: Iterable[StreamStats]) -> dict[str, TenantCounts]:
        """The process's GPU pool by label: its streams' per-tenant ``POOL`` counts, summed and folded."""
        by_medium = tenants_by_medium(streams)
        if not by_medium:
            return {}
        gpu = by_medium.get("GPU", {})
        counters = {name: {f: float(getattr(m, f)) for f in POOL} for name, m in gpu.items()}
        folded = self.fold_of(key).fold(counters, {}, _activity(by_medium))
        return {label: TenantCounts(**{f: v.get(f, 0.0) for f in POOL}) for label, v in folded.items()}

    def view(
        self, key: str, engine: EngineView | None, losses: Mapping[tuple[str, str, str], LossTotal]
    ) -> TenantsView | None:
        """The snapshot's tenants of the process; None until its streams name a tenant."""
        by_medium = engine.tenants if engine is not None else {}
        if not by_medium:
            return None
        counters: dict[str, dict[Key, float]] = {}
        gauges: dict[str, dict[Key, float]] = {}
        for medium, tenants in by_medium.items():
            for name, m in tenants.items():
                c = counters.setdefault(name, {})
                for f in COUNTED:
                    c[(medium, f)] = float(getattr(m, f))
                gauges.setdefault(name, {})[(medium, "resident")] = float(m.resident)
        for (name, tier, cause), row in losses.items():
            c = counters.setdefault(name, {})
            c[("loss", tier, cause, "blocks")] = float(row.blocks)
            if row.bytes is not None:
                c[("loss", tier, cause, "bytes")] = row.bytes
        fold = self.fold_of(key)
        folded = fold.fold(counters, gauges, _activity(by_medium))
        overflow = sum(s.tenants_overflow for s in engine.streams) if engine is not None else 0
        return TenantsView(_rows(folded), _losses(folded), len(fold.labels), len(fold.folded), overflow)

    def keep(self, keys: Iterable[str]) -> None:
        """Only the folds of these processes (the others are gone)."""
        alive = set(keys)
        for k in [k for k in self._folds if k not in alive]:
            del self._folds[k]


def _activity(by_medium: Mapping[str, Mapping[str, MediumTotals]]) -> dict[str, float]:
    """Per tenant, the blocks it stored and had removed, every medium: what a free label goes by."""
    out: dict[str, float] = {}
    for tenants in by_medium.values():
        for name, m in tenants.items():
            out[name] = out.get(name, 0.0) + m.stored + m.removed
    return out


def _rows(folded: Mapping[str, Mapping[Key, float]]) -> tuple[TenantRow, ...]:
    out = []
    for name, values in sorted(folded.items()):
        media = sorted({k[0] for k in values if k[0] != "loss"})
        for medium in media:
            got = {f: values.get((medium, f), 0.0) for f in (*COUNTED, "resident")}
            out.append(TenantRow(name, medium, **got))
    return tuple(out)


def _losses(folded: Mapping[str, Mapping[Key, float]]) -> dict[tuple[str, str, str], LossTotal]:
    out: dict[tuple[str, str, str], LossTotal] = {}
    for name, values in sorted(folded.items()):
        for k, v in values.items():
            if k[0] == "loss" and k[3] == "blocks":
                priced = ("loss", k[1], k[2], "bytes")
                out[(name, k[1], k[2])] = LossTotal(blocks=int(v), bytes=values.get(priced))
    return out
