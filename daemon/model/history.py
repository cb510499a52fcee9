"""A typed history of keyed cumulative counts, and their increase over trailing windows.

One observation per tick maps each key (a tenant's label, say) to a frozen dataclass of
cumulative counts (``Obs``); the history keeps each key's fields as ``CounterSeries`` (so a count
that goes backwards restarts its own series, and samples older than the horizon are dropped) and
answers with the same type: the increase of every field over a window. Readers name fields as
attributes, so mypy checks them; there are no string-keyed names to keep in step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from kvwatch.daemon.model.series import CounterSeries


class _Dataclass(Protocol):
    __dataclass_fields__: ClassVar[dict[str, Any]]


Obs = TypeVar("Obs", bound=_Dataclass)


class History(Generic[Obs]):
    """Cumulative counts of type ``Obs`` (a frozen dataclass of numbers) per key, over time."""

    __slots__ = ("_fields", "_kind", "_series", "horizon")

    def __init__(self, kind: type[Obs], horizon: float = 600.0) -> None:
        self._kind = kind
        self._fields = tuple(f.name for f in dataclasses.fields(kind))
        self.horizon = horizon
        self._series: dict[str, tuple[CounterSeries, ...]] = {}

    def add(self, t: float, observed: Mapping[str, Obs]) -> None:
        """One observation at ``t``; keys not in it keep their samples (not written this tick)."""
        for key, counts in observed.items():
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = tuple(CounterSeries(self.horizon) for _ in self._fields)
            for s, name in zip(series, self._fields, strict=True):
                s.add(t, float(getattr(counts, name)))

    def drop(self, keys: Iterable[str]) -> None:
        """Forget keys that will not be written again (a row folded into another)."""
        for key in keys:
            self._series.pop(key, None)

    def __bool__(self) -> bool:
        return bool(self._series)

    def __iter__(self) -> Iterator[str]:
        return iter(self._series)

    def __contains__(self, key: object) -> bool:
        return key in self._series

    def last(self, key: str) -> Obs:
        """The key's counts at its latest observation (zeros when never observed)."""
        series = self._series.get(key)
        if series is None:
            return self._kind()
        return self._kind(**{n: s.last for n, s in zip(self._fields, series, strict=True)})

    def delta(self, key: str, window: float) -> tuple[Obs, float]:
        """The key's increase over the trailing ``window`` (or what exists of it), and the seconds
        it spans (the first field's: every field is written at the same instants)."""
        series = self._series.get(key)
        if series is None:
            return self._kind(), 0.0
        got = {n: s.delta(window) for n, s in zip(self._fields, series, strict=True)}
        return self._kind(**{n: inc for n, (inc, _) in got.items()}), got[self._fields[0]][1]

    def rate(self, key: str, window: float) -> Obs:
        """The key's increase a second over the trailing ``window``, every field (zeros while the
        window spans no time)."""
        got, seconds = self.delta(key, window)
        if seconds <= 0:
            return self._kind()
        return self._kind(**{n: getattr(got, n) / seconds for n in self._fields})

    def at(self, key: str, t: float) -> Obs | None:
        """The key's counts at time ``t``, linear between its observations; None outside them."""
        series = self._series.get(key)
        if series is None:
            return None
        values = [s.value_at(t) for s in series]
        if any(v is None for v in values):
            return None
        return self._kind(**dict(zip(self._fields, values, strict=True)))
