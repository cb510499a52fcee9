"""How much the KV event accounting may remember: one budget for the node, shared by its
streams, and each stream's share split over its media.

A hash memory (``hashmem.py``) costs at most ENTRY_BYTES per entry of its capacity when full:
23 bytes an entry sealed, 1-2 of bit filter, the open dict's ~110 bytes an entry for at most a
sixteenth of the capacity; a store-time memory also keeps up to a sixteenth of its capacity of
hashes held twice and of GPU removals waiting for their offload's judgement (``blocks.py``).

Per stream (``StreamPlan``): the GPU pool and its first lower tier (the first other medium the
stream names: vLLM's CPU offload, LMCache's tier) each keep the configured bounds
(``engines.max_tracked_blocks``, ``engines.regret_memory_blocks``); every further medium shares
one more such medium's bounds. A medium gives its reference group its bounds and its other
groups one more such bound between them (``groups.py``), so a publisher that names every medium
and group it can holds at most three media's worth: 6 x (max_tracked_blocks +
regret_memory_blocks) entries.

Per node (``MemoryBudget``): the streams that have named a medium share
``engines.kv_memory_bytes`` equally. Where a stream's share is less than its media would hold,
the GPU pool and its first lower tier keep as much of their bounds as the share allows and the
further media get what is left. A stream that joins shrinks the others' memories at once (their
oldest entries forgotten, counted as ``stores_forgotten`` / ``removals_forgotten``); one that
leaves gives its share back. The hub's one thread serves every stream, so a re-plan happens on
the thread that fills the memories.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import structlog

log = structlog.get_logger("kvwatch.kv_events")

ENTRY_BYTES = 40  # per entry of capacity, a full hash memory's worst (see above)
DEFAULT_BYTES = 256 << 20  # engines.kv_memory_bytes' default
DEFAULT_MEDIUM = "GPU"  # stream_counts.DEFAULT_MEDIUM: the GPU pool


class Medium(Protocol):
    """What a plan needs of a medium (``groups.MediumGroups``)."""

    @property
    def groups(self) -> Mapping[int, object]: ...

    @property
    def grouped(self) -> bool: ...

    def set_bounds(self, bounds: tuple[int, int]) -> None: ...


class MemoryBudget:
    """The node's hash memories: ``nbytes`` shared equally by the streams that hold any."""

    def __init__(self, nbytes: int = DEFAULT_BYTES) -> None:
        self.entries = max(nbytes // ENTRY_BYTES, 1)
        self._plans: list[StreamPlan] = []
        self._told = False  # the budget binding, logged once

    @property
    def share(self) -> int:
        return self.entries // max(len(self._plans), 1)

    def join(self, plan: StreamPlan) -> None:
        if plan not in self._plans:
            self._plans.append(plan)
            self._replan()

    def leave(self, plan: StreamPlan) -> None:
        if plan in self._plans:
            self._plans.remove(plan)
            self._replan()

    def _replan(self) -> None:
        for p in self._plans:
            p.apply()

    def binding(self, wanted: int) -> None:
        """A stream's media would hold ``wanted`` entries, more than its share: said once."""
        if not self._told:
            self._told = True
            log.warning(
                "kv event memory budget binds: hash memories scaled down (engines.kv_memory_bytes)",
                streams=len(self._plans),
                share_entries=self.share,
                wanted_entries=wanted,
            )


class StreamPlan:
    """One stream's share of the budget, split over its media (by name, in the order named)."""

    def __init__(self, bounds: tuple[int, int], budget: MemoryBudget, media: Mapping[str, Medium]) -> None:
        self.bounds = bounds
        self.budget = budget
        self.media = media
        self.joined = False

    def apply(self) -> None:
        """Each medium's bounds from the stream's share; the first call joins the budget."""
        if not self.media:
            return
        if not self.joined:
            self.joined = True
            self.budget.join(self)  # re-plans every stream, this one included
            return
        shape = [(primary, m.grouped) for primary, m in zip(primaries(self.media), self.media.values(), strict=True)]
        share = self.budget.share
        bounds, wanted = split(share, self.bounds, shape)
        if wanted > share:
            self.budget.binding(wanted)
        for m, b in zip(self.media.values(), bounds, strict=True):
            m.set_bounds(b)

    def room(self, most: int) -> bool:
        """Fewer than ``most`` groups across the stream's media."""
        return sum(len(m.groups) for m in self.media.values()) < most

    def close(self) -> None:
        if self.joined:
            self.joined = False
            self.budget.leave(self)


def primaries(media: Mapping[str, object]) -> list[bool]:
    """Per medium in order: the GPU pool, and the first other medium named (its lower tier)."""
    out, lower = [], False
    for name in media:
        if name == DEFAULT_MEDIUM:
            out.append(True)
        else:
            out.append(not lower)
            lower = True
    return out


def split(share: int, bounds: tuple[int, int], media: Sequence[tuple[bool, bool]]) -> tuple[list[tuple[int, int]], int]:
    """Each medium's bounds, given per medium whether it is primary and whether it has more than
    one group (then it holds twice its bounds), and the entries the media would hold unscaled.
    The primary media are scaled to the share if they must; the others share one medium's bounds
    and are scaled to what the primary media leave of the share."""
    stored, removed = bounds
    unit = stored + removed
    extras = sum(1 for primary, _ in media if not primary)
    held = [(2 if grouped else 1) * (unit if primary else unit / extras) for primary, grouped in media]
    first = sum(h for h, (primary, _) in zip(held, media, strict=True) if primary)
    rest = sum(held) - first
    f_first = min(1.0, share / first) if first else 1.0
    f_rest = min(1.0, max(share - f_first * first, 0.0) / rest) if rest else 1.0
    out = []
    for primary, _ in media:
        f = f_first if primary else f_rest / extras
        out.append((_scaled(stored, f), _scaled(removed, f)))
    return out, round(first + rest)


def _scaled(bound: int, f: float) -> int:
    """A bound scaled down, never to 0 (which turns a memory off) unless it was 0."""
    return max(int(bound * f), 1) if bound > 0 else 0
