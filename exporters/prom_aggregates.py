"""The few values the Prometheus families derive from a snapshot (sums, cumulative buckets,
ratios), as plain functions: the collectors only lay them out as families."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvwatch.daemon.model.engines import StreamStats
from kvwatch.probes.records import BUCKET_BOUNDS, XferCounters


def snapshot_age(wall_time: float, now: float) -> float:
    """Seconds since the snapshot was published; 0 before the first one, never negative (clock steps)."""
    return max(0.0, now - wall_time) if wall_time else 0.0


def xfer_ok_calls(lib: str, c: XferCounters) -> int:
    """Calls that succeeded: NIXL counts failed posts among its calls, the other libraries apart."""
    return c.calls - c.errors if lib == "nixl" else c.calls


def completions_by_lib(xfers: Mapping[tuple[str, str], XferCounters]) -> dict[str, XferCounters]:
    """Completed transfers, their summed duration and duration buckets per library, over its operations.

    A library with one operation keeps its counters as they are; a sum carries only the completion
    fields (calls, errors and bytes stay per operation).
    """
    per_lib: dict[str, XferCounters] = {}
    for (lib, _op), c in sorted(xfers.items()):
        agg = per_lib.get(lib)
        per_lib[lib] = (
            c
            if agg is None
            else XferCounters(
                completed=agg.completed + c.completed,
                duration_ns=agg.duration_ns + c.duration_ns,
                buckets=tuple(a + b for a, b in zip(agg.buckets, c.buckets, strict=True)),
            )
        )
    return per_lib


def cumulative_buckets(c: XferCounters) -> list[tuple[str, float]]:
    """Prometheus histogram buckets (upper bound, cumulative count) of the transfer durations.

    The kernel's last bucket is open-ended: it is counted in +Inf, which is every completion.
    """
    running = 0
    buckets: list[tuple[str, float]] = []
    for bound, n in zip(BUCKET_BOUNDS, c.buckets, strict=False):
        running += n
        buckets.append((f"{bound:.9g}", running))
    buckets.append(("+Inf", c.completed))
    return buckets


def cache_resets(streams: Iterable[StreamStats]) -> int:
    """AllBlocksCleared events over the data-parallel ranks' streams."""
    return sum(x.cleared for x in streams)
