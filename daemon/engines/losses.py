"""Filling the KV loss ledger (``engines/ledger.py``) once a tick: from each tapped engine's
streams and counters, the KV tiers' page cache, and the OOM kills of engine processes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvwatch.daemon.engines.ledger import LossLedger
from kvwatch.daemon.engines.taps import EngineTaps
from kvwatch.daemon.model.engine_scrape import ENGINE
from kvwatch.daemon.model.engines import LostBytes, loss_key
from kvwatch.daemon.model.windows import OomEvent, TierPageLoss
from kvwatch.daemon.tracker import Tracked


def preempt_window(scrape_interval: float) -> float:
    """How recently the engine's preemption counter must have risen for its GPU evictions to
    count as preemption's: a scrape or two, the counter being read every scrape_interval."""
    return max(5.0, 2.5 * scrape_interval)


def account_losses(
    ledger: LossLedger,
    taps: EngineTaps | None,
    tier_losses: Sequence[TierPageLoss],
    tracked: Sequence[Tracked],
    now: float,
    *,
    owners: Mapping[int, list[Tracked]],
) -> None:
    if taps is not None:
        _engines(ledger, taps, tracked)
    _tiers(ledger, tier_losses, owners)
    for t in tracked:
        led = ledger.engines.get(t.key)
        if led is not None:
            rows = led.totals().items()
            t.losses.add(
                now, {loss_key(tier, cause): LostBytes(r.bytes) for (tier, cause), r in rows if r.bytes is not None}
            )


def _engines(ledger: LossLedger, taps: EngineTaps, tracked: Sequence[Tracked]) -> None:
    window = preempt_window(taps.config.scrape_interval_seconds)
    for t in tracked:
        if taps.tapped(t):
            preempting = t.engine.delta(ENGINE, window)[0].preemptions > 0
            ledger.of(t.key).streams(taps.streams_of(t.key), taps.sample_of(t.key), preempting)


def account_oom(ledger: LossLedger, taps: EngineTaps, tracked: Sequence[Tracked], oom: Sequence[OomEvent]) -> None:
    """Run right after the kernel's events are read, before the engine taps let go of the
    killed process's plan and streams: what its streams held is what the kill lost."""
    alive = {t.pid: t for t in tracked if t.exited_at is None}
    by_key = {t.key: t for t in tracked}
    for ev in oom:
        victim = by_key.get(ev.subject.key) if not ev.sibling_of else None  # a sibling held no KV
        owner = taps.tapped_owner(victim, alive) if victim is not None else None
        if owner is not None:
            ledger.of(owner).oom(g for s in taps.streams_of(owner) for g in s.groups)


def _tiers(ledger: LossLedger, losses: Sequence[TierPageLoss], owners: Mapping[int, list[Tracked]]) -> None:
    """A disk tier's losses go to the first process it belongs to; one owned by none is only
    in the tier's own families (kvwatch_kv_tier_evicted_bytes_total)."""
    for loss in losses:
        first = owners.get(loss.tier_id)
        if first:
            ledger.of(first[0].key).tier(loss.tier_id, loss.reclaim_bytes, loss.policy_bytes)
