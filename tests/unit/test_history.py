"""The typed history of keyed cumulative counts (daemon/model/history.py)."""

from __future__ import annotations

from kvwatch.daemon.model.engines import TenantCounts
from kvwatch.daemon.model.history import History


def test_the_increase_over_a_window_comes_back_typed_with_its_span() -> None:
    h: History[TenantCounts] = History(TenantCounts)
    for t in range(0, 31):
        h.add(float(t), {"a": TenantCounts(stored=23 * t, removed=7 * t, regretted=2 * t)})
    got, seconds = h.delta("a", 10.0)
    assert got == TenantCounts(stored=230, removed=70, regretted=20) and seconds == 10.0
    assert h.last("a") == TenantCounts(stored=690, removed=210, regretted=60)
    assert list(h) == ["a"] and "a" in h and bool(h)


def test_a_key_never_seen_is_zeros_and_an_unwritten_key_keeps_its_samples() -> None:
    h: History[TenantCounts] = History(TenantCounts)
    assert not h and h.delta("b", 10.0) == (TenantCounts(), 0.0) and h.last("b") == TenantCounts()
    h.add(0.0, {"a": TenantCounts(stored=1), "b": TenantCounts(stored=5)})
    h.add(1.0, {"a": TenantCounts(stored=4)})  # b left the observation: its samples stay as they were
    assert h.delta("b", 10.0) == (TenantCounts(), 0.0) and h.last("b").stored == 5
    assert h.delta("a", 10.0) == (TenantCounts(stored=3), 1.0)


def test_a_count_that_goes_back_restarts_only_its_own_field() -> None:
    """A tenant's stores restarting (its label given to another tenant) leave its regrets' history."""
    h: History[TenantCounts] = History(TenantCounts)
    h.add(0.0, {"a": TenantCounts(stored=100, regretted=10)})
    h.add(1.0, {"a": TenantCounts(stored=110, regretted=13)})
    h.add(2.0, {"a": TenantCounts(stored=3, regretted=17)})
    got, seconds = h.delta("a", 10.0)
    assert got.stored == 0 and got.regretted == 7 and seconds == 0.0


def test_samples_older_than_the_horizon_are_dropped() -> None:
    h: History[TenantCounts] = History(TenantCounts, horizon=5.0)
    for t in range(100):
        h.add(float(t), {"a": TenantCounts(stored=float(t))})
    assert h.delta("a", 1_000.0) == (TenantCounts(stored=5.0), 5.0)
