"""A time series of one cumulative counter, and its increase over trailing windows.

Sources keep cumulative counters; each tick appends (time, value) here and readers ask for the
increase (or rate) over the last W seconds. Bounded: samples older than the horizon are dropped.
A ``History`` (``history.py``) keeps one per field of a typed observation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class CounterSeries:
    horizon: float = 600.0
    samples: deque[tuple[float, float]] = field(default_factory=deque)

    def add(self, t: float, value: float) -> None:
        if self.samples and value < self.samples[-1][1]:
            # counter went backwards (map entry recreated): restart the series
            self.samples.clear()
        self.samples.append((t, value))
        cutoff = t - self.horizon
        while len(self.samples) > 2 and self.samples[1][0] <= cutoff:
            self.samples.popleft()

    @property
    def last(self) -> float:
        return self.samples[-1][1] if self.samples else 0.0

    def delta(self, window: float) -> tuple[float, float]:
        """(increase, elapsed seconds) over the trailing ``window`` (or what exists of it)."""
        if len(self.samples) < 2:
            return 0.0, 0.0
        t_end, v_end = self.samples[-1]
        start = self.samples[0]
        for s in reversed(self.samples):
            if s[0] <= t_end - window + 1e-9:
                start = s
                break
        dt = t_end - start[0]
        return v_end - start[1], dt

    def rate(self, window: float) -> float:
        inc, dt = self.delta(window)
        return inc / dt if dt > 0 else 0.0

    def value_at(self, t: float) -> float | None:
        """The counter at time ``t``, linear between the samples around it; None outside them."""
        if not self.samples or t < self.samples[0][0] or t > self.samples[-1][0]:
            return None
        later = next(i for i in range(len(self.samples) - 1, -1, -1) if self.samples[i][0] <= t)
        t0, v0 = self.samples[later]
        if later + 1 == len(self.samples) or t0 == t:
            return v0
        t1, v1 = self.samples[later + 1]
        return v0 + (v1 - v0) * (t - t0) / (t1 - t0)
