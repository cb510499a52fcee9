"""What the transfer family observes of a process's NIXL transfers each tick, typed.

``TransferCounts`` are cumulative (kept in the process's ``History`` under the library's name,
``NIXL``); ``TransfersInFlight`` is the moment's. The effective bandwidth is defined once here,
for the detector (over its window, with the transfers still in flight) and the snapshot (over its
rate window, completed transfers only), and so is its share of the link (for the detector, the
Prometheus exposition and `kvwatch top`).
"""

from __future__ import annotations

from dataclasses import dataclass

NIXL = "nixl"  # the history's key: the library whose transfers' completion kvwatch sees


@dataclass(frozen=True, slots=True)
class TransferCounts:
    """Cumulative: NIXL requests posted (to any peer), and the transfers completed to known (mature)
    peers with their bytes and summed per-transfer completion times; a new peer's first seconds
    are left out (``families/transfer.py``)."""

    posts: float = 0.0
    completed: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0
    moved_bytes: float = 0.0  # bytes posted by every transfer library, any peer (the process's transfer rate)


@dataclass(frozen=True, slots=True)
class TransfersInFlight:
    """Transfers to known peers posted and not completed yet: how many, their bytes, and how long
    they have been in flight so far. Slow transfers complete rarely; these are the evidence that
    they are slow before they complete."""

    transfers: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0


NONE_IN_FLIGHT = TransfersInFlight()


def effective_bandwidth(done: TransferCounts, in_flight: TransfersInFlight = NONE_IN_FLIGHT) -> float:
    """Bytes over busy time (the transfers' summed times): of the transfers completed in a window
    (``done``, an increase), plus those still in flight, whose bytes over their time so far are an
    upper bound of their bandwidth. 0 when nothing was busy."""
    busy = done.seconds + in_flight.seconds
    return (done.bytes + in_flight.bytes) / busy if busy > 0 else 0.0


def link_utilization(effective_bytes_per_second: float, link_bytes_per_second: float) -> float | None:
    """Effective over the link's bandwidth; None when the link's bandwidth is unknown (0)."""
    if link_bytes_per_second > 0:
        return effective_bytes_per_second / link_bytes_per_second
    return None
