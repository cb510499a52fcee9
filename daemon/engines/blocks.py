"""One medium's blocks in one KV event stream: stored, removed, removed young, regretted, and
stored again while still resident (an engine that misses its own cache).

Two bounded memories of block hashes (``hashmem.py``): when one is full the oldest
entries go first, each one dropped counted.

* when each resident block was stored (the engine's timestamp): a removal within
  ``thrash_seconds`` of its store is *young*, a hot block evicted;
* when each recently removed block was removed: the same hash stored again is a
  *regretted* eviction, the engine recomputing (or reloading) a block it threw away.
  The block's ``block_size`` tokens are the recomputation it implies, and the time from
  the removal to the new store goes into a histogram.

An AllBlocksCleared (prefix-cache reset, sleep) or a publisher restart empties both:
blocks stored after a deliberate reset are not regrets, and a restarted engine's hashes
need not mean what they meant before. The blocks a reset drops (those resident) are counted.

A GPU removal of a block that no lower tier of the same stream holds or has removed is an
offload the engine dropped: the block left the GPU without ever reaching the tier below
(``dropped``, counted on the GPU medium; only once that tier has stored something, and only
for blocks whose store the stream saw).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from kvwatch.daemon.engines.hashmem import HashMemory
from kvwatch.daemon.engines.records import REGRET_BUCKETS, MediumTotals
from kvwatch.daemon.engines.wire import Hash


class MediumBlocks:
    __slots__ = (
        "_regret_le",
        "_removed_at",
        "_stored_at",
        "cleared",
        "dropped",
        "regret_seconds",
        "regret_tokens",
        "regretted",
        "removed",
        "restored",
        "stored",
        "young",
    )

    def __init__(self, max_stored: int, max_removed: int) -> None:
        self.stored = self.removed = self.young = 0
        self.regretted = self.regret_tokens = 0
        self.restored = 0  # stored again while still resident
        self.cleared = 0  # resident when an AllBlocksCleared dropped them
        self.dropped = 0  # removed without a lower tier ever holding them
        self.regret_seconds = 0.0
        self._regret_le = [0] * (len(REGRET_BUCKETS) + 1)  # per bucket, the last one +Inf
        self._stored_at = HashMemory(max_stored)
        self._removed_at = HashMemory(max_removed)  # capacity 0: no regret accounting

    def store(self, hashes: Sequence[Hash], ts: float, block_size: int) -> None:
        self.stored += len(hashes)
        for gone in self._removed_at.take(hashes):
            self._regret(max(ts - gone, 0.0), block_size)
        self.restored += len(self._stored_at.take(hashes))
        self._stored_at.put(hashes, ts)

    def remove(
        self, hashes: Sequence[Hash], ts: float, young_before: float, lower: Sequence[MediumBlocks] = ()
    ) -> None:
        self.removed += len(hashes)
        keys, times = self._stored_at.take_keys(hashes)
        self.young += sum(1 for t in times if t > young_before)
        if lower and keys:  # only blocks whose store this stream saw: older ones cannot be judged
            self.dropped += len(keys) - min(max(m.knows(keys) for m in lower), len(keys))
        self._removed_at.put(hashes, ts)

    def knows(self, fps: Sequence[int]) -> int:
        """How many of the hash fingerprints this medium holds or has removed (as far as it
        remembers)."""
        return self._stored_at.count(fps) + self._removed_at.count(fps)

    def drop_all(self) -> None:
        """AllBlocksCleared: what is resident is dropped on purpose, and counted."""
        self.cleared += len(self._stored_at)
        self.clear()

    def clear(self) -> None:
        self._stored_at.clear()
        self._removed_at.clear()

    def _regret(self, seconds: float, block_size: int) -> None:
        self.regretted += 1
        self.regret_tokens += block_size
        self.regret_seconds += seconds
        self._regret_le[bisect_left(REGRET_BUCKETS, seconds)] += 1

    @property
    def remembered(self) -> int:
        """Hashes held in both memories."""
        return len(self._stored_at) + len(self._removed_at)

    def totals(self) -> MediumTotals:
        return MediumTotals(
            stored=self.stored,
            removed=self.removed,
            removed_young=self.young,
            regretted=self.regretted,
            restored=self.restored,
            cleared=self.cleared,
            dropped=self.dropped,
            resident=len(self._stored_at),
            regret_tokens=self.regret_tokens,
            regret_seconds=self.regret_seconds,
            regret_buckets=tuple(self._regret_le),
            stores_forgotten=self._stored_at.forgotten,
            removals_forgotten=self._removed_at.forgotten,
        )
