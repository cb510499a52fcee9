"""A bounded memory of block hashes with a time each, about 23 bytes an entry.

A Python dict costs about 100 bytes per block hash (the key object, the float, the slot),
so a million remembered blocks would be 100 MB per stream and medium. Here the newest
entries sit in a dict (one sixteenth of the capacity, 16,384 at most, 64 at least); when it fills it is sealed:
merged into numpy arrays sorted by hash fingerprint, beside each entry's time, the seal it
came in (its generation), a live flag and a tag (23 bytes an entry; ``hashmem_sealed.py``,
created on the first seal, so that numpy is imported only by a memory that fills). Each seal drops the entries
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
from typing import TYPE_CHECKING

from kvwatch.daemon.engines.wire import Hash

if TYPE_CHECKING:
    from kvwatch.daemon.engines.hashmem_sealed import SealedEntries

MASK64 = (1 << 64) - 1
GENERATIONS = 16  # the dict holds at most capacity / GENERATIONS entries,
OPEN_MAX = 16_384  # and at most this many: a dict entry costs ~100 bytes, a sealed one 23;
OPEN_MIN = 64  # but at least this many (or half the capacity): a seal costs ~100 µs however small


def fingerprint(h: Hash) -> int:
    if isinstance(h, int):
        return h & MASK64
    return int.from_bytes(h[-8:], "little")


def _open_limit(capacity: int) -> int:
    return max(min(capacity // GENERATIONS, OPEN_MAX), min(OPEN_MIN, capacity // 2), 1)


class HashMemory:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.open_limit = _open_limit(capacity)
        self._open: dict[int, float] = {}
        self._sealed: SealedEntries | None = None  # from the first seal on
        self._open_tags: dict[int, int] = {}  # the open entries' non-zero tags
        self.live_by_tag: dict[int, int] = {}  # live entries per non-zero tag
        self.forgotten = 0  # live entries dropped with their generation

    @property
    def _sealed_live(self) -> int:
        return self._sealed.live if self._sealed is not None else 0

    def resize(self, capacity: int) -> None:
        """A new bound; a smaller one forgets the oldest entries (counted) at once."""
        self.capacity = capacity
        self.open_limit = _open_limit(capacity)
        for _ in range(2):  # a second seal, of nothing, drops a newest generation larger than the room
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
        if rest and self._sealed is not None and self._sealed.live:
            k, t2, per_tag = self._sealed.take(rest, tags, bool(self.live_by_tag))
            self._uncount(per_tag)
            keys += k
            found += t2
        return keys, found

    def peek_tag(self, fp: int) -> int | None:
        """The tag of a fingerprint held (kept), None when it is not."""
        if fp in self._open:
            return self._open_tags.get(fp, 0)
        if self._sealed is None or not self._sealed.live:
            return None
        return self._sealed.tag_of(fp)

    def count(self, fps: Sequence[int]) -> int:
        """How many of the fingerprints are held, without forgetting them."""
        n, rest, opened = 0, [], self._open
        for fp in fps:
            if fp in opened:
                n += 1
            else:
                rest.append(fp)
        if rest and self._sealed is not None and self._sealed.live:
            n += self._sealed.count(rest)
        return n

    def clear(self) -> None:
        self._open.clear()
        self._open_tags.clear()
        self.live_by_tag.clear()
        if self._sealed is not None:
            self._sealed.clear()

    def _uncount(self, per_tag: list[int]) -> None:
        for tag, n in enumerate(per_tag):
            if tag and n:
                self._count(tag, -n)

    def _seal(self) -> None:
        """The open entries become the newest sealed generation; past the capacity the oldest
        generations go, their live entries counted as forgotten."""
        if self._sealed is None:
            from kvwatch.daemon.engines.hashmem_sealed import SealedEntries  # noqa: PLC0415 - numpy on first seal

            self._sealed = SealedEntries()
        room = self.capacity - self.open_limit
        gone, per_tag = self._sealed.seal(self._open, self._open_tags, room, bool(self.live_by_tag))
        self._open, self._open_tags = {}, {}
        self._uncount(per_tag)
        self.forgotten += gone
