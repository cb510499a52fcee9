"""``kvwatch top``'s tenant view (key ``t``, or ``--tenants``): per engine process and tenant of
its KV pool, blocks stored, evicted and recomputed per second, its share of the blocks held, and
the tenant evicting it while KVTenantThrash fires. Rates come from the frames the view has seen:
the daemon serves cumulative counts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.text import Text

from kvwatch.exporters.top_model import TopFrame, TopTenant

Key = tuple[int, str, str]  # pid, tenant, medium


@dataclass(frozen=True, slots=True)
class TenantLine:
    t: TopTenant
    stored_per_s: float | None  # None until two frames were seen
    evicted_per_s: float | None
    regretted_per_s: float | None


@dataclass
class TenantRates:
    """The last frame's counts, to turn the next frame's into rates."""

    _prev: dict[Key, TopTenant] = field(default_factory=dict)
    _at: float = 0.0
    _lines: list[TenantLine] = field(default_factory=list)
    _frame_at: float = -1.0

    def lines(self, frame: TopFrame) -> list[TenantLine]:
        at = frame.header.wall_time
        if at == self._frame_at:
            return self._lines  # the same frame drawn again (a key press): the same rates
        dt = at - self._at
        out = []
        for t in frame.tenants:
            before = self._prev.get((t.pid, t.tenant, t.medium)) if dt > 0 else None

            def rate(attr: str, t: TopTenant = t, before: TopTenant | None = before) -> float | None:
                return max(getattr(t, attr) - getattr(before, attr), 0.0) / dt if before is not None else None

            out.append(TenantLine(t, rate("stored"), rate("removed"), rate("regretted")))
        self._prev = {(t.pid, t.tenant, t.medium): t for t in frame.tenants}
        out.sort(key=lambda x: (x.t.pid, x.t.medium, -(x.regretted_per_s or 0.0), x.t.tenant))
        self._at, self._frame_at, self._lines = at, at, out
        return out


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}" if v >= 10 else f"{v:.1f}"


# title, cell
TENANT_COLUMNS: tuple[tuple[str, Callable[[TenantLine], str]], ...] = (
    ("PID", lambda x: str(x.t.pid)),
    ("ENGINE", lambda x: x.t.engine),
    ("TENANT", lambda x: x.t.tenant),
    ("MEDIUM", lambda x: x.t.medium),
    ("STORED/s", lambda x: _num(x.stored_per_s)),
    ("EVICTED/s", lambda x: _num(x.evicted_per_s)),
    ("RECOMPUTED/s", lambda x: _num(x.regretted_per_s)),
    ("HELD", lambda x: _num(x.t.resident)),
    ("SHARE", lambda x: f"{x.t.share_pct:.0f}%"),
    ("EVICTED BY", lambda x: x.t.evicted_by or "-"),
)


def tenant_cells(x: TenantLine) -> list[Any]:
    style = "bold red" if x.t.evicted_by else ""
    return [Text(cell(x), style=style) for _, cell in TENANT_COLUMNS]


def matches(x: TenantLine, text: str) -> bool:
    return any(text.lower() in cell(x).lower() for _, cell in TENANT_COLUMNS)
