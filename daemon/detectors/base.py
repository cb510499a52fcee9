"""Machinery shared by every detector (docs/architecture.md): baseline, warm-up, evidence
floor, hysteresis (the ``Finding`` a detector reports per subject: model/findings.py).

Detectors are pure: their output is a function of their own previous state, the
read-only windows of per-subject histories handed to them, their config and ``now``.
No kernel, no I/O, no wall clock — the same code runs in the daemon and in unit
tests on synthetic histories.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvwatch.daemon.model.kv_counts import STREAM
from kvwatch.daemon.model.windows import ProcessWindow


@dataclass(slots=True)
class Baseline:
    """Exponentially weighted mean with a half-life in seconds, bias-corrected: early on it is
    the plain mean of what it has seen (not the first sample held for a half-life), later
    the weight of the past fades by half every ``half_life``. Frozen while alerting
    (``hold``: time passes, nothing is learnt)."""

    half_life: float
    weighted_sum: float = 0.0
    weight: float = 0.0  # how much history backs the value (0 → none yet)
    last_t: float | None = None
    nominal_step: float = 1.0  # the first sample's share, as if one tick had passed

    @property
    def value(self) -> float:
        return self.weighted_sum / self.weight if self.weight > 0 else 0.0

    def update(self, x: float, t: float) -> None:
        dt = self.nominal_step if self.last_t is None else max(t - self.last_t, 0.0)
        self.last_t = t
        if dt == 0.0 and self.weight > 0:
            return
        keep = math.pow(0.5, max(dt, 1e-9) / self.half_life) if self.half_life > 0 else 0.0
        self.weighted_sum = keep * self.weighted_sum + (1.0 - keep) * x
        self.weight = keep * self.weight + (1.0 - keep)

    def hold(self, t: float) -> None:
        """Time passes without learning; the past keeps its weight relative to what comes next."""
        self.last_t = t


@dataclass(slots=True)
class Hysteresis:
    """Fire after ``confirm`` consecutive hot evaluations; clear after ``clear``
    consecutive evaluations below the clear condition (typically half the threshold)."""

    confirm: int
    clear: int
    firing: bool = False
    hot_streak: int = 0
    cool_streak: int = 0
    started_at: float | None = None

    def step(self, hot: bool, cool: bool, t: float) -> tuple[bool, bool]:
        """Returns (firing, changed)."""
        if not self.firing:
            self.hot_streak = self.hot_streak + 1 if hot else 0
            if self.hot_streak >= self.confirm:
                self.firing, self.cool_streak, self.started_at = True, 0, t
                return True, True
            return False, False
        self.cool_streak = self.cool_streak + 1 if cool else 0
        if self.cool_streak >= self.clear:
            self.firing, self.hot_streak, self.started_at = False, 0, None
            return False, True
        return True, False


def threshold(baseline: float, factor: float, floor: float) -> float:
    return max(factor * baseline, floor)


def cleared_on_purpose(p: ProcessWindow, window: float) -> bool:
    """The engine dropped its KV cache on purpose within ``window``: an AllBlocksCleared (a prefix
    cache reset, a sleep) or asleep now. What is evicted or missed then is intended, not thrash:
    the KV detectors judge nothing of such a window."""
    return p.kv_events.delta(STREAM, window)[0].cleared > 0 or p.engine_state.sleeping
