"""KVHostTierEvictionUnderPressure: the kernel squeezing a pageable KV tier.

Per tier, over a trailing window: reclaim-caused page-cache eviction of the
tier's files above max(factor x baseline, floor), and at least one sign that it
hurts — evicted pages read back (refault ratio), the owning engine stalled in
reclaim, or memory PSI. Policy evictions (the engine deleting its own files)
are counted by the probes and never alert here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvwatch.daemon.config import HostTierEvictionConfig
from kvwatch.daemon.detectors.base import Baseline, Hysteresis, threshold
from kvwatch.daemon.model.alerts import AlertSpec
from kvwatch.daemon.model.findings import Finding
from kvwatch.daemon.model.memory import MEMORY, PAGES
from kvwatch.daemon.model.windows import NodeWindow, ProcessWindow, TierWindow

ALERT = "KVHostTierEvictionUnderPressure"
SPECS = (
    AlertSpec(
        name=ALERT,
        fires_when="reclaim evicts a KV tier and refaults, stalls or PSI rise",
        severities=("warning",),
        causes=("refault", "reclaim_stall", "psi", "reclaim"),
        labels=("tier",),
        summary=(
            "KV tier {{ $labels.tier }} squeezed out of the page cache by memory pressure: {{ "
            "$labels.engine }} pid {{ $labels.pid }} on {{ $labels.instance }}"
        ),
        description=(
            "The kernel is reclaiming the page cache of KV-tier {{ $labels.tier }} of {{ "
            "$labels.engine }} pid {{ $labels.pid }} (pod {{ $labels.pod }}) while the engine still "
            "reads it back (refaults / reclaim stalls); cause {{ $labels.cause }}. Evicted by "
            "reclaim now: {{ with printf \"sum(rate(kvwatch_pagecache_evicted_bytes_total{instance='%s"
            "',tier='%s',cause='reclaim'}[2m]))\" $labels.instance $labels.tier | query }}{{ . | "
            "first | value | humanize1024 }}B/s{{ else }}unknown{{ end }}."
        ),
    ),
)
MIB = 1024 * 1024


def _stall_rate(o: ProcessWindow, window: float) -> float:
    """Seconds a second the process stalled in reclaim, global and against its memcg's limit."""
    r = o.memory.rate(MEMORY, window)
    return r.direct_reclaim_seconds + r.memcg_reclaim_seconds


@dataclass(slots=True)
class _TierState:
    baseline: Baseline
    hysteresis: Hysteresis
    cause: str = ""


class HostTierEviction:
    name = ALERT
    alerts: ClassVar[tuple[str, ...]] = (ALERT,)
    outlives_subject: ClassVar[bool] = False

    def __init__(self, config: HostTierEvictionConfig) -> None:
        self.config = config
        self._state: dict[str, _TierState] = {}

    def forget(self, subject_key: str) -> None:
        self._state.pop(subject_key, None)

    def _state_for(self, key: str) -> _TierState:
        st = self._state.get(key)
        if st is None:
            c = self.config
            st = self._state[key] = _TierState(
                Baseline(c.baseline_half_life_seconds),
                Hysteresis(c.confirm_windows, c.clear_windows),
            )
        return st

    def measure(self, tier: TierWindow, view: NodeWindow) -> dict[str, float]:
        w = self.config.window_seconds
        pages, seconds = tier.pages.delta(PAGES, w)
        stall = max((_stall_rate(o, w) for o in tier.owners), default=0.0)
        psi_values = [o.psi_some_avg10 for o in tier.owners if o.psi_some_avg10 is not None]
        if view.psi_memory_some_avg10 is not None:
            psi_values.append(view.psi_memory_some_avg10)
        return {
            "evicted_bytes_per_second": pages.reclaim_bytes / seconds if seconds > 0 else 0.0,
            "refault_ratio": pages.refault_pages / pages.reclaim_pages if pages.reclaim_pages > 0 else 0.0,
            "reclaim_stall_ms_per_second": stall * 1000.0,
            "psi_some_avg10": max(psi_values, default=0.0),
        }

    def evaluate(self, view: NodeWindow) -> list[Finding]:
        if not self.config.enabled:
            return []
        c = self.config
        out: list[Finding] = []
        for key, tier in view.tiers.items():
            st = self._state_for(key)
            m = self.measure(tier, view)
            rate = m["evicted_bytes_per_second"]
            limit = threshold(st.baseline.value, c.factor, c.floor_bytes_per_second)
            warm = tier.age >= c.warmup_seconds and all(o.age >= c.warmup_seconds for o in tier.owners)
            causes = [
                name
                for name, ok in (
                    ("refault", m["refault_ratio"] > c.refault_ratio),
                    ("reclaim_stall", m["reclaim_stall_ms_per_second"] > c.reclaim_stall_ms_per_second),
                    ("psi", m["psi_some_avg10"] > c.psi_some_avg10),
                )
                if ok
            ]
            hot = warm and rate > 0 and rate >= limit and bool(causes)
            cool = rate < limit / 2
            firing, changed = st.hysteresis.step(hot, cool, view.now)
            if firing or hot:
                st.baseline.hold(view.now)  # the baseline learns only what is normal
            else:
                st.baseline.update(rate, view.now)
            if firing and changed:
                st.cause = causes[0] if causes else "reclaim"
            values = {
                **m,
                "baseline_bytes_per_second": st.baseline.value,
                "threshold_bytes_per_second": limit,
            }
            summary = (
                f"KV tier {tier.subject.labels.get('tier', key)} losing "
                f"{rate / MIB:.1f} MiB/s of page cache to reclaim "
                f"(threshold {limit / MIB:.1f} MiB/s; refault {m['refault_ratio']:.0%}, "
                f"stall {m['reclaim_stall_ms_per_second']:.0f} ms/s, PSI some {m['psi_some_avg10']:.1f})"
            )
            out.append(
                Finding(
                    alert=ALERT,
                    subject=tier.subject,
                    firing=firing,
                    cause=st.cause if firing else "",
                    values=values,
                    summary=summary,
                    severity="warning",
                )
            )
        return out
