"""KVTenantThrash: one tenant's KV blocks evicted and recomputed because another tenant's
traffic took the GPU pool — a noisy neighbour, named.

Per engine process and tenant of its GPU pool (``engines/tenants.py``; the window's typed
``tenants`` history), over a trailing window:

* the victim: its regretted evictions (blocks it stored again after the pool removed them) per
  second reach max(factor x its own baseline, ``floor_regretted_per_second``);
* the aggressor: another tenant whose stores are at least ``aggressor_store_share`` of the
  pool's stores in the window, and more than the victim's own. A tenant that evicts its own
  blocks (its own stores dominate) is no victim of anyone; a pool with one tenant storing is
  not shared, and nothing fires;
* judged once the pool stored ``min_stored_blocks`` in the window and the victim has been seen
  for ``baseline_min_seconds`` (after the process's ``warmup_seconds``, 0 by default: an
  engine's start holds no tenant's regrets); a prefix-cache reset or sleep (AllBlocksCleared)
  is intentional: not judged in that window.

The victim's baselines learn its normal regrets from every window that is not thrash evidence.
Evidence (regrets at the bar while another tenant dominates the stores) is never learnt once the
victim's baseline is known, firing or not yet: a flood is not the new normal because it began
early, nor because it takes ``confirm_windows`` to confirm. What a victim already suffered before
its baseline was known is its normal: kvwatch cannot tell a standing arrangement it never saw
begin from a flood.

The tenants judged are the labels of the process's one tenant fold (``engines/tenant_view.py``),
the fold the exported tenant rows use: a finding names a tenant /metrics shows by name, or
``other``. ``unknown`` (blocks whose tenant the stream could not tell) is never a victim nor an
aggressor; ``other`` (the tenants past ``engines.tenant_top_k``, together) may be either.

One finding per (process, victim), its subject the process's with ``/tenant:NAME``; it names the
aggressor (kept while it fires), both tenants' shares of the window's stores and evictions, and
the victim's regret ratio (regretted / stored) before (its baseline) and during.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvwatch.daemon.config import TenantThrashConfig
from kvwatch.daemon.detectors.base import Baseline, Hysteresis, cleared_on_purpose, threshold
from kvwatch.daemon.detectors.per_process import ProcessDetector
from kvwatch.daemon.model.alerts import AlertSpec
from kvwatch.daemon.model.engines import TenantCounts
from kvwatch.daemon.model.findings import Finding, Subject
from kvwatch.daemon.model.history import History
from kvwatch.daemon.model.windows import ProcessWindow

ALERT = "KVTenantThrash"
SPECS = (
    AlertSpec(
        name=ALERT,
        fires_when=(
            "a tenant's evicted-and-recomputed blocks ≥ 5 × its baseline while another tenant stores "
            "≥ 50 % of the pool (names victim and aggressor)"
        ),
        severities=("warning",),
        causes=("noisy_neighbour",),
        labels=("tenant", "aggressor"),
        summary=(
            "Noisy neighbour: tenant {{ $labels.aggressor }} is evicting tenant {{ $labels.tenant "
            "}}'s KV cache on {{ $labels.engine }} pid {{ $labels.pid }} on {{ $labels.instance }}"
        ),
        description=(
            "{{ $labels.engine }} {{ $labels.role }} pid {{ $labels.pid }} (pod {{ $labels.pod }}): "
            "tenant {{ $labels.tenant }}'s KV blocks are evicted and recomputed far above its own "
            "baseline while tenant {{ $labels.aggressor }} fills the pool. {{ $labels.tenant }} "
            "recomputes {{ with printf \"sum(rate(kvwatch_kv_tenant_blocks_regretted_total{instance='%"
            "s',pid='%s',medium='GPU',tenant='%s'}[2m]))\" $labels.instance $labels.pid "
            "$labels.tenant | query }}{{ . | first | value | humanize }}{{ else }}unknown{{ end }} "
            "blocks/s; {{ $labels.aggressor }} stores {{ with printf "
            "\"sum(rate(kvwatch_kv_tenant_blocks_stored_total{instance='%s',pid='%s',medium='GPU',tena"
            "nt='%s'}[2m])) / sum(rate(kvwatch_kv_tenant_blocks_stored_total{instance='%s',pid='%s',m"
            "edium='GPU'}[2m]))\" $labels.instance $labels.pid $labels.aggressor $labels.instance "
            "$labels.pid | query }}{{ . | first | value | humanizePercentage }}{{ else }}unknown{{ "
            "end }} of the pool's blocks. The victim's time to first token rises with no error "
            "anywhere: isolate the tenants (separate pools or replicas, per-tenant rate limits) or "
            "give the pool more blocks."
        ),
    ),
)
NEVER = frozenset({"unknown"})  # neither victim nor aggressor


@dataclass(slots=True)
class _Victim:
    hysteresis: Hysteresis
    rate: Baseline  # regretted blocks/s, learnt from windows that are not evidence
    ratio: Baseline  # regretted / stored
    seen_at: float  # when the detector first saw the tenant: its baseline is known baseline_min_seconds on
    aggressor: str = ""


@dataclass(slots=True)
class _State:
    victims: dict[str, _Victim] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Window:
    stored: dict[str, float]
    removed: dict[str, float]
    regretted: dict[str, float]
    seconds: float

    @property
    def pool_stored(self) -> float:
        return sum(self.stored.values())

    def store_share(self, name: str) -> float:
        total = self.pool_stored
        return self.stored.get(name, 0.0) / total if total > 0 else 0.0

    def evicted_share(self, name: str) -> float:
        total = sum(self.removed.values())
        return self.removed.get(name, 0.0) / total if total > 0 else 0.0


def _window(h: History[TenantCounts], w: float) -> _Window:
    got = {name: h.delta(name, w) for name in h}
    stored = {n: d.stored for n, (d, _) in got.items()}
    removed = {n: d.removed for n, (d, _) in got.items()}
    regretted = {n: d.regretted for n, (d, _) in got.items()}
    return _Window(stored, removed, regretted, max((dt for _, dt in got.values()), default=0.0))


class TenantThrash(ProcessDetector[TenantThrashConfig, _State]):
    name = ALERT

    def applies(self, p: ProcessWindow) -> bool:
        return bool(p.tenants)

    def new_state(self) -> _State:
        return _State()

    def judge_all(self, key: str, st: _State, p: ProcessWindow, now: float) -> list[Finding]:
        c = self.config
        win = _window(p.tenants, c.window_seconds)
        intentional = cleared_on_purpose(p, c.window_seconds)
        measured = not intentional and win.pool_stored >= c.min_stored_blocks and win.seconds > 0
        out = []
        for name in sorted((win.stored.keys() | st.victims.keys()) - NEVER):
            v = st.victims.get(name)
            if v is None:
                v = st.victims[name] = _Victim(
                    Hysteresis(c.confirm_windows, c.clear_windows),
                    Baseline(c.baseline_half_life_seconds),
                    Baseline(c.baseline_half_life_seconds),
                    seen_at=now,
                )
            known = p.age >= c.warmup_seconds and now - v.seen_at >= c.baseline_min_seconds
            firing, rate, ratio = self._step(name, v, win, measured=measured, known=known, now=now)
            out.append(self._finding(key, p, name, v, win=win, firing=firing, rate=rate, ratio=ratio))
        return out

    def _aggressor(self, win: _Window, victim: str) -> str:
        others = [(win.stored[n], n) for n in win.stored if n != victim and n not in NEVER]
        if not others:
            return ""
        stored, name = max(others)
        dominant = win.store_share(name) >= self.config.aggressor_store_share
        return name if dominant and stored > win.stored.get(victim, 0.0) else ""

    def _step(
        self, name: str, v: _Victim, win: _Window, *, measured: bool, known: bool, now: float
    ) -> tuple[bool, float, float]:
        """One evaluation of a victim: whether it fires, its regrets/s and regret ratio."""
        c = self.config
        regretted, stored = win.regretted.get(name, 0.0), win.stored.get(name, 0.0)
        rate = regretted / win.seconds if win.seconds > 0 else 0.0
        ratio = regretted / stored if stored > 0 else 0.0
        bar = threshold(v.rate.value, c.factor, c.floor_regretted_per_second)
        aggressor = self._aggressor(win, name) if measured else ""
        evidence = known and measured and rate >= bar and bool(aggressor)
        cool = not (known and measured) or rate < bar / 2 or not aggressor
        firing, changed = v.hysteresis.step(evidence, cool, now)
        if firing:
            if changed or not v.aggressor:
                v.aggressor = aggressor
        else:
            v.aggressor = ""
        if firing or evidence or not measured:
            v.rate.hold(now)
            v.ratio.hold(now)
        else:
            v.rate.update(rate, now)
            if stored > 0:
                v.ratio.update(ratio, now)
        return firing, rate, ratio

    def _finding(
        self,
        key: str,
        p: ProcessWindow,
        name: str,
        v: _Victim,
        *,
        win: _Window,
        firing: bool,
        rate: float,
        ratio: float,
    ) -> Finding:
        a = v.aggressor
        values = {
            "victim_regretted_per_second": round(rate, 3),
            "baseline_regretted_per_second": round(v.rate.value, 3),
            "victim_regret_ratio_before": round(v.ratio.value, 4),
            "victim_regret_ratio_during": round(ratio, 4),
            "victim_store_share": round(win.store_share(name), 4),
            "victim_evicted_share": round(win.evicted_share(name), 4),
            "aggressor_store_share": round(win.store_share(a), 4) if a else 0.0,
            "aggressor_evicted_share": round(win.evicted_share(a), 4) if a else 0.0,
            "pool_stored_blocks": win.pool_stored,
            "window_seconds": self.config.window_seconds,
        }
        labels = {**p.subject.labels, "tenant": name, "aggressor": a}
        pid = p.subject.labels.get("pid", "?")
        return Finding(
            alert=ALERT,
            subject=Subject(f"{key}/tenant:{name}", labels),
            firing=firing,
            cause="noisy_neighbour" if firing else "",
            values=values,
            summary=(
                f"pid {pid}: tenant {name}'s KV blocks evicted and recomputed at {rate:.1f} blocks/s "
                f"(regret ratio {v.ratio.value:.0%} -> {ratio:.0%}) while tenant {a or '?'} stored "
                f"{win.store_share(a):.0%} of the pool's blocks"
            ),
        )
