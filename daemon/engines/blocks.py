"""One medium's blocks in one KV event stream: stored, removed, removed young, and regretted.

Two bounded memories keyed by block hash, in insertion order so that the oldest entries
go first when one is full (each entry dropped is counted):

* when each resident block was stored (the engine's timestamp): a removal within
  ``thrash_seconds`` of its store is *young*, a hot block evicted;
* when each recently removed block was removed: the same hash stored again is a
  *regretted* eviction, the engine recomputing (or reloading) a block it threw away.
  The block's ``block_size`` tokens are the recomputation it implies, and the time from
  the removal to the new store goes into a histogram.

An AllBlocksCleared (prefix-cache reset, sleep) or a publisher restart empties both:
blocks stored after a deliberate reset are not regrets, and a restarted engine's hashes
need not mean what they meant before.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from kvwatch.daemon.engines.records import REGRET_BUCKETS, MediumTotals

Hash = int | bytes


def _trim(memory: dict[Hash, float], bound: int) -> int:
    """Forget the oldest tenth of a full memory; returns how many entries went."""
    drop = max(len(memory) - bound * 9 // 10, 1)
    for k in list(memory)[:drop]:  # pragma: no branch
        del memory[k]
    return drop


class MediumBlocks:
    __slots__ = (
        "_regret_le",
        "_removed_at",
        "_stored_at",
        "max_removed",
        "max_stored",
        "regret_seconds",
        "regret_tokens",
        "regretted",
        "removals_forgotten",
        "removed",
        "stored",
        "stores_forgotten",
        "young",
    )

    def __init__(self, max_stored: int, max_removed: int) -> None:
        self.max_stored = max_stored
        self.max_removed = max_removed  # 0: no regret accounting
        self.stored = self.removed = self.young = 0
        self.regretted = self.regret_tokens = 0
        self.regret_seconds = 0.0
        self._regret_le = [0] * (len(REGRET_BUCKETS) + 1)  # per bucket, the last one +Inf
        self.stores_forgotten = self.removals_forgotten = 0
        self._stored_at: dict[Hash, float] = {}
        self._removed_at: dict[Hash, float] = {}

    def store(self, hashes: Sequence[Hash], ts: float, block_size: int) -> None:
        self.stored += len(hashes)
        stored_at, removed_at = self._stored_at, self._removed_at
        for h in hashes:
            gone = removed_at.pop(h, None)
            if gone is not None:
                self._regret(max(ts - gone, 0.0), block_size)
            stored_at.pop(h, None)
            stored_at[h] = ts
        if len(stored_at) > self.max_stored:
            self.stores_forgotten += _trim(stored_at, self.max_stored)

    def remove(self, hashes: Sequence[Hash], ts: float, young_before: float) -> None:
        self.removed += len(hashes)
        stored_at, removed_at = self._stored_at, self._removed_at
        remember = self.max_removed > 0
        for h in hashes:
            t = stored_at.pop(h, None)
            if t is not None and t > young_before:
                self.young += 1
            if remember:
                removed_at.pop(h, None)
                removed_at[h] = ts
        if len(removed_at) > self.max_removed > 0:
            self.removals_forgotten += _trim(removed_at, self.max_removed)

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
        """Hashes held in both memories (what they cost is about 100 bytes each)."""
        return len(self._stored_at) + len(self._removed_at)

    def totals(self) -> MediumTotals:
        return MediumTotals(
            stored=self.stored,
            removed=self.removed,
            removed_young=self.young,
            regretted=self.regretted,
            regret_tokens=self.regret_tokens,
            regret_seconds=self.regret_seconds,
            regret_buckets=tuple(self._regret_le),
            stores_forgotten=self.stores_forgotten,
            removals_forgotten=self.removals_forgotten,
        )
