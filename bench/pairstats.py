"""Paired on/off statistics for bench/bench_engine_cost.py: pure functions, standard library only.

Rounds run in pairs, one round with kvwatch on and one off, the order within a pair alternating
(ABBA: off on | on off | off on | ...), so that a drift linear in time adds as much to "on" as to
"off" over every two pairs. Each figure's on/off ratio is the ratio of means over the pairs,
sum(on) / sum(off), with a percentile bootstrap 95 % interval that resamples whole pairs.

Why the ratio of means and not the median of the per-pair ratios:

* ABBA's cancellation of drift is a property of sums: in an AB pair drift adds +d to "on", in the
  next BA pair -d, and the two cancel in a sum or mean, not in a median;
* with the 8-12 pairs a device call affords, the median of a resample takes only a few distinct
  values, so its bootstrap interval is coarse and too narrow or too wide by a whole gap between
  neighbouring pair ratios; a mean's bootstrap distribution is smooth;
* it is the figure asked for: total CPU with kvwatch over total CPU without it (pairs that ran
  more requests weigh more, as they should).

Resampling pairs, not rounds, keeps what pairing removed (the drift between pairs) out of the
interval. The median of the pair ratios is reported beside it, as a check against one outlier pair.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

Pair = tuple[float, float]  # (on, off)


def abba(pairs: int) -> list[tuple[int, bool]]:
    """(pair index, kvwatch on) for every round, in the order to run them."""
    out: list[tuple[int, bool]] = []
    for i in range(pairs):
        out += [(i, False), (i, True)] if i % 2 == 0 else [(i, True), (i, False)]
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the two nearest ranks (numpy's default)."""
    if not values:
        raise ValueError("no values")
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ratio_of_means(pairs: Sequence[Pair]) -> float:
    off = sum(p[1] for p in pairs)
    return sum(p[0] for p in pairs) / off if off else math.nan


def mean_difference(pairs: Sequence[Pair]) -> float:
    return sum(p[0] - p[1] for p in pairs) / len(pairs) if pairs else math.nan


def median_of_ratios(pairs: Sequence[Pair]) -> float:
    ratios = [on / off for on, off in pairs if off]
    return percentile(ratios, 50) if ratios else math.nan


def bootstrap(
    pairs: Sequence[Pair],
    statistic: Callable[[Sequence[Pair]], float],
    resamples: int = 10_000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``statistic`` over resamples of whole pairs (seeded: the
    same pairs give the same interval)."""
    if len(pairs) < 2:
        return math.nan, math.nan
    rng = random.Random(seed)  # noqa: S311 - resampling, not secrets
    n = len(pairs)
    stats = [statistic([pairs[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples)]
    stats = [s for s in stats if not math.isnan(s)]
    if not stats:
        return math.nan, math.nan
    tail = (1.0 - level) / 2 * 100
    return percentile(stats, tail), percentile(stats, 100 - tail)


@dataclass(frozen=True)
class Ratio:
    """One figure's on/off comparison over the pairs."""

    pairs: int
    on_mean: float
    off_mean: float
    ratio: float  # sum(on) / sum(off)
    low: float  # bootstrap interval of the ratio
    high: float
    median_pair_ratio: float
    diff_mean: float  # mean of on - off per pair
    diff_low: float
    diff_high: float

    @property
    def half_width_pct(self) -> float:
        """The interval's larger half, in percent of the ratio."""
        return max(self.ratio - self.low, self.high - self.ratio) / self.ratio * 100 if self.ratio else math.nan

    def narrow(self, bound_pct: float = 2.0) -> bool:
        return not math.isnan(self.half_width_pct) and self.half_width_pct < bound_pct

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "half_width_pct": self.half_width_pct, "narrower_than_2pct": self.narrow()}


def compare(pairs: Sequence[Pair], resamples: int = 10_000, seed: int = 0) -> Ratio:
    n = len(pairs)
    lo, hi = bootstrap(pairs, ratio_of_means, resamples, seed=seed)
    dlo, dhi = bootstrap(pairs, mean_difference, resamples, seed=seed)
    return Ratio(
        pairs=n,
        on_mean=sum(p[0] for p in pairs) / n if n else math.nan,
        off_mean=sum(p[1] for p in pairs) / n if n else math.nan,
        ratio=ratio_of_means(pairs),
        low=lo,
        high=hi,
        median_pair_ratio=median_of_ratios(pairs),
        diff_mean=mean_difference(pairs),
        diff_low=dlo,
        diff_high=dhi,
    )
