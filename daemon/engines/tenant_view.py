"""An engine's tenants for the snapshot: its streams' per-tenant counts and its ledger's
per-tenant losses, folded to the top-K labels (``TenantFold``) once a tick, one fold per engine
process for as long as it runs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvwatch.daemon.engines.tenants import TenantFold
from kvwatch.daemon.engines.views import EngineView, LossTotal, TenantRow, TenantsView

COUNTED = ("stored", "removed", "removed_young", "regretted", "regret_tokens")
Key = tuple[str, ...]


class TenantViews:
    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self._folds: dict[str, TenantFold] = {}

    def view(
        self, key: str, engine: EngineView | None, losses: Mapping[tuple[str, str, str], LossTotal]
    ) -> TenantsView | None:
        """None until the engine's streams name a tenant."""
        by_medium = engine.tenants if engine is not None else {}
        if not by_medium:
            return None
        counters: dict[str, dict[Key, float]] = {}
        gauges: dict[str, dict[Key, float]] = {}
        activity: dict[str, float] = {}
        for medium, tenants in by_medium.items():
            for name, m in tenants.items():
                c = counters.setdefault(name, {})
                for f in COUNTED:
                    c[(medium, f)] = float(getattr(m, f))
                gauges.setdefault(name, {})[(medium, "resident")] = float(m.resident)
                activity[name] = activity.get(name, 0.0) + m.stored + m.removed
        for (name, tier, cause), row in losses.items():
            c = counters.setdefault(name, {})
            c[("loss", tier, cause, "blocks")] = float(row.blocks)
            if row.bytes is not None:
                c[("loss", tier, cause, "bytes")] = row.bytes
        fold = self._folds.get(key)
        if fold is None:
            fold = self._folds[key] = TenantFold(self.top_k)
        folded = fold.fold(counters, gauges, activity)
        overflow = sum(s.tenants_overflow for s in engine.streams) if engine is not None else 0
        return TenantsView(_rows(folded), _losses(folded), len(fold.labels), len(fold.folded), overflow)

    def keep(self, keys: Iterable[str]) -> None:
        """Only the folds of these processes (the others are gone)."""
        alive = set(keys)
        for k in [k for k in self._folds if k not in alive]:
            del self._folds[k]


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
