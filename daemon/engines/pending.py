"""GPU removals waiting for their offload's announcement (``blocks.py``), in arrival order and
packed flat: per removal its fingerprint (8 bytes) and tenant tag (2, 0 untagged), per batch its
engine time (8) and length (4). A flood keeps tens of thousands waiting for OFFLOAD_SETTLE_SECONDS,
in batches of a block or two as often as not: as Python objects (a tuple and two arrays a batch)
that was ~80 bytes a removal."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

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

    def take(self, before: float) -> list[tuple[list[int], list[int] | None]]:
        """The batches removed at or before ``before``, oldest first, each with its tags (None
        when none is tagged); they wait no more."""
        out: list[tuple[list[int], list[int] | None]] = []
        b, k, batches = self.batch0, self.key0, len(self._ts)
        while b < batches and self._ts[b] <= before:
            end = k + self._len[b]
            tags = self._tags[k:end].tolist()
            out.append((self._fps[k:end].tolist(), tags if any(tags) else None))
            self.n -= end - k
            b, k = b + 1, end
        self.batch0, self.key0 = b, k
        if b == batches:
            self.clear()
        elif b >= COMPACT_BATCHES and 2 * b >= batches:
            del self._ts[:b], self._len[:b], self._fps[:k], self._tags[:k]
            self.batch0 = self.key0 = 0
        return out

    def clear(self) -> None:
        self._ts, self._len, self._fps, self._tags = array("d"), array("I"), array("Q"), array("H")
        self.batch0 = self.key0 = self.n = 0
