"""bench/pairstats.py: the ABBA order, the ratio of means with its pair bootstrap, and why ABBA:
a drift linear in time adds as much to "on" as to "off", so the mean on - off difference stays
exact and the ratio is not pushed either way (only diluted by the drift's own level)."""

from __future__ import annotations

import math

import pytest

from tests.support.bench import bench_module

ps = bench_module("pairstats")


def test_abba_alternates_the_order_within_pairs() -> None:
    order = ps.abba(4)
    assert [on for _, on in order] == [False, True, True, False, False, True, True, False]
    assert [p for p, _ in order] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_percentile_interpolates_like_numpy() -> None:
    assert ps.percentile([4, 1, 3, 2], 50) == 2.5
    assert ps.percentile([1, 2, 3, 4], 0) == 1 and ps.percentile([1, 2, 3, 4], 100) == 4
    assert ps.percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert ps.percentile([10, 20], 25) == pytest.approx(12.5)
    with pytest.raises(ValueError):
        ps.percentile([], 50)


def test_ratio_of_means_weighs_pairs_by_size() -> None:
    pairs = [(2.0, 1.0), (10.0, 10.0)]
    assert ps.ratio_of_means(pairs) == pytest.approx(12 / 11)
    assert ps.median_of_ratios(pairs) == pytest.approx(1.5)
    assert ps.mean_difference(pairs) == pytest.approx(0.5)
    assert math.isnan(ps.ratio_of_means([(1.0, 0.0)]))


def _abba_rounds(pairs: int, base: float, effect: float, drift: float) -> list[tuple[float, float]]:
    """Each round's value: base (x effect when on) + drift x its position in time."""
    values: dict[int, dict[bool, float]] = {}
    for t, (p, on) in enumerate(ps.abba(pairs)):
        values.setdefault(p, {})[on] = base * (effect if on else 1.0) + drift * t
    return [(v[True], v[False]) for _, v in sorted(values.items())]


def test_abba_cancels_a_linear_drift() -> None:
    pairs = _abba_rounds(8, base=100.0, effect=1.05, drift=2.0)
    assert ps.mean_difference(pairs) == pytest.approx(5.0)  # exact: +d and -d in turn
    # the same drift with "off" always first biases every pair the same way
    ab = [(100.0 * 1.05 + 2.0 * (2 * i + 1), 100.0 + 2.0 * 2 * i) for i in range(8)]
    assert ps.mean_difference(ab) == pytest.approx(7.0)
    drift = sum(2.0 * t for t, (_, on) in enumerate(ps.abba(8)) if on)
    assert drift == sum(2.0 * t for t, (_, on) in enumerate(ps.abba(8)) if not on)
    assert ps.ratio_of_means(pairs) == pytest.approx((8 * 105.0 + drift) / (8 * 100.0 + drift))
    assert ps.ratio_of_means(ab) > 1.06  # pushed past the true 1.05


def test_bootstrap_is_seeded_and_holds_the_estimate() -> None:
    pairs = [(105 + (i % 3), 100 + (i % 4)) for i in range(10)]
    a = ps.bootstrap(pairs, ps.ratio_of_means, resamples=2000, seed=7)
    assert a == ps.bootstrap(pairs, ps.ratio_of_means, resamples=2000, seed=7)
    assert a[0] < ps.ratio_of_means(pairs) < a[1]
    assert math.isnan(ps.bootstrap(pairs[:1], ps.ratio_of_means)[0])  # one pair: no interval


def test_identical_pairs_give_a_point_interval() -> None:
    r = ps.compare([(102.0, 100.0)] * 8, resamples=500)
    assert r.ratio == pytest.approx(1.02) and r.low == pytest.approx(1.02) and r.high == pytest.approx(1.02)
    assert r.half_width_pct == pytest.approx(0.0) and r.narrow()
    assert r.diff_mean == pytest.approx(2.0) and r.median_pair_ratio == pytest.approx(1.02)


def test_noisier_pairs_widen_the_interval() -> None:
    quiet = ps.compare([(101.0 + 0.1 * (i % 2), 100.0) for i in range(8)], resamples=2000)
    noisy = ps.compare([(101.0 + 8.0 * (i % 2), 100.0) for i in range(8)], resamples=2000)
    assert quiet.narrow() and not noisy.narrow()
    assert quiet.half_width_pct < noisy.half_width_pct
    d = noisy.as_dict()
    assert d["narrower_than_2pct"] is False and d["pairs"] == 8 and d["half_width_pct"] > 2
