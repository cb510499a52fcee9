"""How much the KV event accounting may remember: one budget for the node, shared by its
streams, and each stream's part split over its media.

A medium keeps two memories: store times (``hashmem.py``: at most STORE_BYTES an entry of its
capacity when full, 23 bytes an entry sealed, 1-2 of bit filter, the open dict's ~110 bytes an
entry for at most a sixteenth of the capacity, and up to a sixteenth of its capacity of hashes
held twice and of GPU removals waiting for their offload's judgement, ``blocks.py``) and
removals (``removals.py``: at most REMOVAL_BYTES an entry, 6.5 bytes in its large segments, 10 in
its newest, 2 more with tenants, up to 2 of bit filter). A part is in bytes; a medium's bounds
are entries, so many bytes each.

Per stream (``StreamPlan``): the GPU pool and its first lower tier (the first other medium the
stream names: vLLM's CPU offload, LMCache's tier) each keep the configured bounds
(``engines.max_tracked_blocks``, and ``engines.regret_memory_seconds`` x
``engines.regret_memory_rate`` removals); every further medium shares one more such medium's
bounds. A medium gives its reference group its bounds and its other groups one more such bound
between them (``groups.py``), so a publisher that names every medium and group it can holds at
most three media's worth: 6 x that medium's bytes. That is what a stream *wants*.

Per node (``MemoryBudget``): the streams that have named a medium share
``engines.kv_memory_bytes``, max-min fair by use: each stream is first given what it holds with
room to double (at least a sixteenth of what it wants, at most all of it), the fairest split of
the budget where those do not all fit; what is left goes, as fairly, to what they want beyond.
So a stream that holds little leaves the rest to the others, and a stream that fills its part is
given more while there is more, else no less than an equal share. A stream nearing its part
asks again (after a batch, each time it has grown by a quarter); a stream that joins, leaves or
names a medium or group re-plans every stream. A part that shrinks forgets its oldest entries at
once, counted as ``stores_forgotten`` / ``removals_forgotten``. Where a stream's part is less than
it wants, the GPU pool and its first lower tier keep as much of their bounds as it allows and
the further media get what is left. The hub's one thread serves every stream, so a re-plan
happens on the thread that fills the memories.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import structlog

log = structlog.get_logger("kvwatch.kv_events")

STORE_BYTES = 40  # per entry of a store-time memory's capacity, when full, at worst (see above)
REMOVAL_BYTES = 11  # per entry of a removal memory's capacity
DEFAULT_BYTES = 384 << 20  # engines.kv_memory_bytes' default
DEFAULT_MEDIUM = "GPU"  # stream_counts.DEFAULT_MEDIUM: the GPU pool
GROWTH = 2  # a stream is first given what it holds times this
FLOOR_PART = 16  # and at least this part of what it wants
ASK_AT = 3 / 4  # a stream holding this much of its part asks again,
ASK_GROWTH = 5 / 4  # once it holds this much more than when it last asked


class Medium(Protocol):
    """What a plan needs of a medium (``groups.MediumGroups``)."""

    @property
    def groups(self) -> Mapping[int, object]: ...

    @property
    def grouped(self) -> bool: ...

    @property
    def held_bytes(self) -> int: ...

    def set_bounds(self, bounds: tuple[int, int]) -> None: ...


class MemoryBudget:
    """The node's hash memories: ``nbytes`` shared by the streams that hold any."""

    def __init__(self, nbytes: int = DEFAULT_BYTES) -> None:
        self.nbytes = max(nbytes, 1)
        self._plans: list[StreamPlan] = []
        self._told = False  # the budget binding, logged once

    def join(self, plan: StreamPlan) -> None:
        if plan not in self._plans:
            self._plans.append(plan)
        self.replan()

    def leave(self, plan: StreamPlan) -> None:
        if plan in self._plans:
            self._plans.remove(plan)
            self.replan()

    def replan(self) -> None:
        """Every stream's part, from what each holds and wants (see the module's doc)."""
        plans = self._plans
        wants = [p.wanted() for p in plans]
        held = [min(w, max(GROWTH * p.used(), w // FLOOR_PART)) for p, w in zip(plans, wants, strict=True)]
        first = fair(self.nbytes, held)
        more = fair(self.nbytes - sum(first), [w - a for w, a in zip(wants, first, strict=True)])
        for p, w, a, b in zip(plans, wants, first, more, strict=True):
            if a + b < w:
                self._binding(a + b, w)
            p.allot(a + b, w)

    def _binding(self, part: int, wanted: int) -> None:
        """A stream is given less than it wants: said once."""
        if not self._told:
            self._told = True
            log.warning(
                "kv event memory budget binds: hash memories scaled down (engines.kv_memory_bytes)",
                streams=len(self._plans),
                part_bytes=part,
                wanted_bytes=wanted,
            )


def fair(total: int, caps: Sequence[int]) -> list[int]:
    """``total`` split max-min fairly: each gets its cap, or an equal share of what the smaller
    caps leave, whichever is less."""
    out = [0] * len(caps)
    left = max(total, 0)
    for k, i in enumerate(sorted(range(len(caps)), key=caps.__getitem__)):
        out[i] = min(max(caps[i], 0), left // (len(caps) - k))
        left -= out[i]
    return out


class StreamPlan:
    """One stream's part of the budget, split over its media (by name, in the order named)."""

    def __init__(self, bounds: tuple[int, int], budget: MemoryBudget, media: Mapping[str, Medium]) -> None:
        self.bounds = bounds
        self.budget = budget
        self.media = media
        self.joined = False
        self.part = 0  # bytes given
        self.want = 0  # bytes it would hold at full bounds
        self._asked = 0  # bytes held when it last asked for more

    def apply(self) -> None:
        """A medium or group named: every stream's part again (the first time, this one joins)."""
        if not self.media:
            return
        if not self.joined:
            self.joined = True
            self.budget.join(self)
        else:
            self.budget.replan()

    def _shape(self) -> list[tuple[bool, bool]]:
        return [(primary, m.grouped) for primary, m in zip(primaries(self.media), self.media.values(), strict=True)]

    def wanted(self) -> int:
        return wanted(self.bounds, self._shape())

    def used(self) -> int:
        return sum(m.held_bytes for m in self.media.values())

    def allot(self, nbytes: int, want: int) -> None:
        self.part, self.want = nbytes, want
        for m, b in zip(self.media.values(), split(nbytes, self.bounds, self._shape()), strict=True):
            m.set_bounds(b)

    def check(self) -> None:
        """After a batch: a stream nearing its part, given less than it wants, asks again."""
        if not self.joined or self.part >= self.want:
            return
        used = self.used()
        if used >= ASK_AT * self.part and used > ASK_GROWTH * self._asked:
            self._asked = used
            self.budget.replan()

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


def cost(stored: int, removed: int) -> int:
    """The bytes of memories of these many entries (or bounds)."""
    return stored * STORE_BYTES + removed * REMOVAL_BYTES


def _held(bounds: tuple[int, int], media: Sequence[tuple[bool, bool]]) -> list[float]:
    """Per medium, the bytes it holds at full bounds: a medium with more than one group
    twice its bounds; the further media one medium's bounds between them."""
    unit = cost(*bounds)
    extras = sum(1 for primary, _ in media if not primary)
    return [(2 if grouped else 1) * (unit if primary else unit / extras) for primary, grouped in media]


def wanted(bounds: tuple[int, int], media: Sequence[tuple[bool, bool]]) -> int:
    """The bytes a stream of these media holds at full bounds."""
    return round(sum(_held(bounds, media)))


def split(part: int, bounds: tuple[int, int], media: Sequence[tuple[bool, bool]]) -> list[tuple[int, int]]:
    """Each medium's bounds (entries), from a part in bytes, given per medium whether it is
    primary and whether it has more than one group. The primary media are scaled to the part if
    they must; the others share one medium's bounds and are scaled to what the primary media
    leave of the part."""
    stored, removed = bounds
    held = _held(bounds, media)
    extras = sum(1 for primary, _ in media if not primary)
    first = sum(h for h, (primary, _) in zip(held, media, strict=True) if primary)
    rest = sum(held) - first
    f_first = min(1.0, part / first) if first else 1.0
    f_rest = min(1.0, max(part - f_first * first, 0.0) / rest) if rest else 1.0
    out = []
    for primary, _ in media:
        f = f_first if primary else f_rest / extras
        out.append((_scaled(stored, f), _scaled(removed, f)))
    return out


def _scaled(bound: int, f: float) -> int:
    """A bound scaled down, never to 0 (which turns a memory off) unless it was 0."""
    return max(int(bound * f), 1) if bound > 0 else 0
