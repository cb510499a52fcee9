"""A bounded memory of block hashes with a time each, about 23 bytes an entry.

A Python dict costs about 100 bytes per block hash (the key object, the float, the slot),
so a million remembered blocks would be 100 MB per stream and medium. Here the newest
entries sit in a dict (one sixteenth of the capacity, 16,384 at most); when it fills it is sealed:
merged into numpy arrays sorted by hash fingerprint, beside each entry's time, the seal it
came in (its generation), a live flag and a tag (23 bytes an entry). Each seal drops the entries
taken since the last; when the live ones would exceed the capacity the oldest generations
are forgotten, their live entries counted.

``take`` finds hashes, forgets them and returns their times, one binary search for all
of a call's hashes: the newest entry of a hash answers for it.

An entry may carry a small tag (a tenant's index, ``tenants.py``): 0, the common case, costs
nothing in the dict (only non-zero tags are kept beside it) and 2 bytes sealed. The live
entries of each non-zero tag are counted, through takes and forgetting alike. Hashes are compared by a
64-bit fingerprint (an int's low 64 bits, the last 8 bytes of a bytes hash): engines'
block hashes are uniform, and two distinct blocks sharing a fingerprint within one
memory is a 2^-64-per-pair event.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from kvwatch.daemon.engines.wire import Hash

MASK64 = (1 << 64) - 1
GENERATIONS = 16  # the dict holds at most capacity / GENERATIONS entries,
OPEN_MAX = 16_384  # and at most this many: a dict entry costs ~100 bytes, a sealed one 23


def fingerprint(h: Hash) -> int:
    if isinstance(h, int):
        return h & MASK64
    return int.from_bytes(h[-8:], "little")


class HashMemory:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.open_limit = max(min(capacity // GENERATIONS, OPEN_MAX), 1)
        self._open: dict[int, float] = {}
        # sealed entries, sorted by fingerprint (older before newer among equal ones)
        self._keys: npt.NDArray[np.uint64] = np.empty(0, dtype=np.uint64)
        self._times: npt.NDArray[np.float64] = np.empty(0, dtype=np.float64)
        self._gens: npt.NDArray[np.uint32] = np.empty(0, dtype=np.uint32)  # which seal each came in
        self._live: npt.NDArray[np.bool_] = np.empty(0, dtype=np.bool_)
        self._tags: npt.NDArray[np.uint16] = np.empty(0, dtype=np.uint16)
        self._open_tags: dict[int, int] = {}  # the open entries' non-zero tags
        self.live_by_tag: dict[int, int] = {}  # live entries per non-zero tag
        self._sealed_live = 0
        self._gen = 0
        self.forgotten = 0  # live entries dropped with their generation

    def resize(self, capacity: int) -> None:
        """A new bound; a smaller one forgets the oldest entries (counted) at once."""
        self.capacity = capacity
        self.open_limit = max(min(capacity // GENERATIONS, OPEN_MAX), 1)
        if capacity > 0 and len(self) > capacity - self.open_limit:
            self._seal()

    def __len__(self) -> int:
        """Live entries."""
        return len(self._open) + self._sealed_live

    def put(self, hashes: Sequence[Hash], at: float) -> None:
        self.put_keys([fingerprint(h) for h in hashes], at)

    def put_keys(self, fps: Sequence[int], at: float, tag: int = 0) -> None:
        """Callers take a hash before they put it again (a put over a live entry leaves the
        older one stale, forgotten with its generation)."""
        if self.capacity <= 0:
            return
        if tag or self._open_tags:
            self._put_tagged(fps, at, tag)
            return
        opened, limit = self._open, self.open_limit
        for fp in fps:
            opened.pop(fp, None)
            opened[fp] = at
            if len(opened) >= limit:
                self._seal()
                opened = self._open

    def _put_tagged(self, fps: Sequence[int], at: float, tag: int) -> None:
        opened, tags, limit = self._open, self._open_tags, self.open_limit
        for fp in fps:
            opened.pop(fp, None)
            opened[fp] = at
            old = tags.pop(fp, 0)
            if old:
                self._count(old, -1)
            if tag:
                tags[fp] = tag
                self._count(tag, 1)
            if len(opened) >= limit:
                self._seal()
                opened, tags = self._open, self._open_tags

    def _count(self, tag: int, n: int) -> None:
        left = self.live_by_tag.get(tag, 0) + n
        if left:
            self.live_by_tag[tag] = left
        else:
            self.live_by_tag.pop(tag, None)

    def take(self, hashes: Sequence[Hash]) -> list[float]:
        """The times of the hashes held (each forgotten here), in no particular order."""
        return self.take_keys([fingerprint(h) for h in hashes])[1]

    def take_keys(self, fps: Sequence[int], tags: list[int] | None = None) -> tuple[list[int], list[float]]:
        """The fingerprints held and their times (each forgotten here); their tags appended to
        ``tags`` in the same order, when given."""
        keys: list[int] = []
        found: list[float] = []
        rest: list[int] = []
        opened, otags = self._open, self._open_tags
        for fp in fps:
            t = opened.pop(fp, None)
            if t is None:
                rest.append(fp)
                continue
            keys.append(fp)
            found.append(t)
            tag = otags.pop(fp, 0) if otags else 0
            if tag:
                self._count(tag, -1)
            if tags is not None:
                tags.append(tag)
        if rest and self._sealed_live:
            k, t2 = self._take_sealed(np.array(rest, dtype=np.uint64), tags)
            keys += k
            found += t2
        return keys, found

    def peek_tag(self, fp: int) -> int | None:
        """The tag of a fingerprint held (kept), None when it is not."""
        if fp in self._open:
            return self._open_tags.get(fp, 0)
        if not self._sealed_live:
            return None
        i = max(int(np.searchsorted(self._keys, np.uint64(fp), side="right")) - 1, 0)
        if int(self._keys[i]) == fp and self._live[i]:
            return int(self._tags[i])
        return None

    def count(self, fps: Sequence[int]) -> int:
        """How many of the fingerprints are held, without forgetting them."""
        n, rest, opened = 0, [], self._open
        for fp in fps:
            if fp in opened:
                n += 1
            else:
                rest.append(fp)
        if rest and self._sealed_live:
            want = np.array(rest, dtype=np.uint64)
            idx = np.maximum(np.searchsorted(self._keys, want, side="right") - 1, 0)
            n += int(np.count_nonzero((self._keys[idx] == want) & self._live[idx]))
        return n

    def clear(self) -> None:
        self._open.clear()
        self._open_tags.clear()
        self.live_by_tag.clear()
        self._keys, self._times = self._keys[:0], self._times[:0]
        self._gens, self._live, self._tags = self._gens[:0], self._live[:0], self._tags[:0]
        self._sealed_live = 0

    def _take_sealed(self, fps: npt.NDArray[np.uint64], tags: list[int] | None) -> tuple[list[int], list[float]]:
        # the newest entry of a fingerprint is the last of its run; an older one left live
        # beside it (put again without a take) is stale and goes with its generation
        idx = np.searchsorted(self._keys, fps, side="right") - 1
        idx = np.maximum(idx, 0)
        hit = (self._keys[idx] == fps) & self._live[idx]
        where = idx[hit]
        if not len(where):
            return [], []
        where = np.unique(where)  # one hash twice in a call is taken once
        self._live[where] = False
        self._sealed_live -= len(where)
        keys: list[int] = self._keys[where].tolist()
        found: list[float] = self._times[where].tolist()
        if self.live_by_tag or tags is not None:
            got = self._tags[where]
            if self.live_by_tag:
                self._uncount(got)
            if tags is not None:
                tags += got.tolist()
        return keys, found

    def _uncount(self, tags: npt.NDArray[np.uint16]) -> None:
        for tag, n in enumerate(np.bincount(tags).tolist()):
            if tag and n:
                self._count(tag, -n)

    def _seal(self) -> None:
        n = len(self._open)
        keys = np.fromiter(self._open.keys(), dtype=np.uint64, count=n)
        times = np.fromiter(self._open.values(), dtype=np.float64, count=n)
        otags = self._open_tags
        tags = np.fromiter((otags.get(k, 0) for k in self._open), dtype=np.uint16, count=n) if otags else None
        self._open, self._open_tags = {}, {}
        self._gen += 1
        self._compact(n)
        order = np.argsort(keys)
        keys, times = keys[order], times[order]
        tags = tags[order] if tags is not None else np.zeros(n, dtype=np.uint16)
        # inserted field by field, so that only one field is ever copied at a time; after
        # the equal keys already there, so that the newest entry is the last of its run
        at = np.searchsorted(self._keys, keys, side="right")
        self._keys = np.insert(self._keys, at, keys)
        self._times = np.insert(self._times, at, times)
        self._gens = np.insert(self._gens, at, np.uint32(self._gen))
        self._live = np.insert(self._live, at, True)
        self._tags = np.insert(self._tags, at, tags)
        self._sealed_live += n

    def _compact(self, room_for: int) -> None:
        """Drop the entries already taken, then whole generations, oldest first, until
        ``room_for`` more fit; the live entries of a dropped generation are counted."""
        keep = self._live.copy()
        excess = self._sealed_live + room_for - (self.capacity - self.open_limit)
        if excess > 0:
            counts = np.bincount(self._gens[keep])
            through = int(np.searchsorted(np.cumsum(counts), excess))  # drop generations 0..through
            old = keep & (self._gens <= through)
            gone = int(np.count_nonzero(old))
            if self.live_by_tag:
                self._uncount(self._tags[old])
            self.forgotten += gone
            self._sealed_live -= gone
            keep &= ~old
        if not keep.all():
            self._keys = self._keys[keep]
            self._times = self._times[keep]
            self._gens = self._gens[keep]
            self._live = self._live[keep]
            self._tags = self._tags[keep]
