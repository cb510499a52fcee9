"""A uprobe probe family as the agent runs it: load once, drain its ring buffer between
ticks, attach/ingest every tick, feed per-process series, close. A family that fails
to load is reported (not ready, with the reason) and the rest of kvwatch goes on."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

from kvwatch.daemon.logs import ErrorBook
from kvwatch.daemon.tracker import Tracked
from kvwatch.daemon.uprobe_tracking import FamilyTracker
from kvwatch.probes.errors import ProbeError
from kvwatch.probes.uprobes import PerProcessUprobes


class _Loadable(Protocol):
    def start(self) -> None: ...

    def consume(self) -> None: ...


P = TypeVar("P", bound=PerProcessUprobes)
T = TypeVar("T", bound=FamilyTracker)


class UprobeFamily(Generic[P, T]):
    def __init__(self, name: str, probes: P | None, make_tracker: Callable[[P], T], *, enabled: bool) -> None:
        self.name = name
        self.probes = probes
        self.probe_apis = tuple(type(probes).apis) if probes is not None else ()
        self.make_tracker = make_tracker
        self.enabled = enabled
        self.tracker: T | None = None
        self.failure = ""

    def start(self, errors: ErrorBook) -> None:
        if self.probes is None:
            return
        try:
            self.probes.start()  # type: ignore[attr-defined]
        except ProbeError as err:
            errors.record(f"probe_load_{self.name}", f"{self.name} probes did not load", err)
            self.failure = str(err)
            self.probes = None
            return
        self.tracker = self.make_tracker(self.probes)

    def consume(self, errors: ErrorBook) -> None:
        if self.probes is None:
            return
        try:
            self.probes.consume()  # type: ignore[attr-defined]
        except Exception as err:
            errors.record(f"ring_poll_{self.name}", "ring buffer poll failed", err)

    def tick(self, tracked: list[Tracked]) -> None:
        if self.tracker is not None:
            self.tracker.sync(tracked)
            self.tracker.ingest()  # type: ignore[attr-defined]

    def add_series(
        self, tracked: Iterable[Tracked], now: float, extra: Callable[[int], dict[str, float]] | None = None
    ) -> None:
        if self.tracker is None:
            return
        for t in tracked:
            values = self.tracker.series(t.pid)  # type: ignore[attr-defined]
            if values is not None:
                if extra is not None:
                    values.update(extra(t.pid))
                t.series.add(now, values)
                t.series.set_gauges(self.tracker.gauges(t.pid))

    def not_ready(self) -> str | None:
        if self.enabled and self.probes is None:
            return f"{self.name} probes not loaded ({self.failure or 'bcc unavailable'})"
        return None

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
        if self.probes is not None:
            self.probes.close()
