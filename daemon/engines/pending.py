"""GPU removals waiting for their offload's announcement (``blocks.py``), in arrival order and
packed flat: per removal its fingerprint (8 bytes) and tenant tag (2, 0 untagged), per batch its
engine time (8) and length (4). A flood keeps tens of thousands waiting for OFFLOAD_SETTLE_SECONDS,
in batches of a block or two as often as not: as Python objects (a tuple and two arrays a batch)
that was ~80 bytes a removal."""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

COMPACT_BATCHES = 4096  # settled batches kept at the front before the arrays are cut down


class PendingRemovals:
    __slots__ = ("_fps", "_len", "_tags", "_ts", "batch0", "key0", "n")

    def __init__(self) -> None:
        self._ts = array("d")
        self._len = array("I")
        self._fps = array("Q")
        self._tags = array("H")
        self.batch0 = 0  # the first batch not settled
        self.key0 = 0  # its first removal
        self.n = 0  # removals waiting

    def add(self, ts: float, fps: Sequence[int], tags: Sequence[int] | None) -> None:
        self._ts.append(ts)
        self._len.append(len(fps))
        self._fps.extend(fps)
        if tags is None:
            self._tags.frombytes(bytes(2 * len(fps)))
        else:
            self._tags.extend(tags)
        self.n += len(fps)

    def take(self, before: float) -> Iterator[tuple[array[int], array[int] | None]]:
        """The batches removed at or before ``before``, oldest first, one at a time, each with
        its tags (None when none is tagged); each waits no more once it is yielded. One batch
        at a time, as slices of the packed arrays: a flood's backlog judged at once (past the
        cap on waiting removals) would otherwise be tens of thousands of ints alive together,
        and pymalloc keeps the arenas such a burst takes."""
        while self.batch0 < len(self._ts) and self._ts[self.batch0] <= before:
            k = self.key0
            end = k + self._len[self.batch0]
            tags = self._tags[k:end]
            self.batch0, self.key0 = self.batch0 + 1, end
            self.n -= end - k
            yield self._fps[k:end], tags if any(tags) else None
        b, batches = self.batch0, len(self._ts)
        if b == batches:
            self.clear()
        elif b >= COMPACT_BATCHES and 2 * b >= batches:
            del self._ts[:b], self._len[:b], self._fps[: self.key0], self._tags[: self.key0]
            self.batch0 = self.key0 = 0

    def clear(self) -> None:
        self._ts, self._len, self._fps, self._tags = array("d"), array("I"), array("Q"), array("H")
        self.batch0 = self.key0 = self.n = 0
