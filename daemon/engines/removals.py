"""A stream medium's memory of removed blocks, to see them stored again (regretted evictions):
sized to remember minutes of a flood, at 6.5 bytes a removal (8.5 with tenants).

The newest removals sit in a dict (fingerprint -> signed time, as ``hashmem.py``: a sixteenth of
the capacity, 16,384 at most); when it fills it is sealed into a segment (``removal_segments.py``:
48-bit keys and 16-bit times), and every FANOUT segments of a level are merged into one of the
next, up to a segment of an eighth of the capacity. Segments stay in the order of their removals,
so the oldest are forgotten first, a segment at a time, once the live entries pass the capacity;
their live entries are counted (``forgotten``), and the newest removal so forgotten bounds the
*horizon*: every removal since then is remembered.

A bit filter of the live keys (BITS_PER_ENTRY bits each, three of them set: ~3 % false
positives) answers most lookups of hashes never removed without touching a segment: in a flood
of new prompts, nearly all. Taken and forgotten entries leave their bits set until the filter is
rebuilt (when it must grow, or when those reach half the live entries).

The API is the part of ``HashMemory`` that a removal memory needs (``blocks.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvwatch.daemon.engines.hashmem import MASK64, OPEN_MAX, OPEN_MIN

if TYPE_CHECKING:
    from kvwatch.daemon.engines.removal_segments import Segment

FANOUT = 8  # segments of a level merged into one of the next
TOP_PART = 8  # no segment holds more than this part of the capacity
BITS_PER_ENTRY = 8
FEW = 8  # lookups of at most this many candidates go one by one
# three multiplicative hashes of a key to the filter's bit positions
MULTIPLIERS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9)
KEY_SHIFT = 16  # a key: the top 48 bits of a fingerprint times MIX (a bijection of 64-bit values:
MIX = 0xD6E8FEB86659FD93  # fingerprints that differ in their low bits only still get distinct keys)


def _key(fp: int) -> int:
    return ((fp * MIX) & MASK64) >> KEY_SHIFT


def _keys(np: Any, fps: Any) -> Any:
    """``_key`` of a uint64 array."""
    return (fps * np.uint64(MIX)) >> np.uint64(KEY_SHIFT)


def _open_limit(capacity: int) -> int:
    return max(min(capacity // 16, OPEN_MAX), min(OPEN_MIN, capacity // 2), 1)


class RemovalMemory:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.open_limit = _open_limit(capacity)
        self._open: dict[int, float] = {}
        self._open_tags: dict[int, int] = {}
        self._segments: list[Segment] = []  # oldest first
        self._sealed_live = 0
        self.live_by_tag: dict[int, int] = {}
        self.forgotten = 0
        self.forgotten_until: float | None = None  # the newest removal forgotten (engine time)
        self.first: float | None = None  # the first removal put (engine time)
        self._filter: Any = None  # numpy uint8 bits, from the first seal
        self._fview: Any = None  # the same bytes, for lookups one at a time
        self._fbits = 0  # log2 of the filter's bits
        self._stale = 0  # filter bits of entries no longer live

    def __len__(self) -> int:
        return len(self._open) + self._sealed_live

    @property
    def nbytes(self) -> int:
        """What the sealed part holds (the open dict's entries not counted)."""
        sealed = sum(s.nbytes for s in self._segments)
        return sealed + (self._filter.nbytes if self._filter is not None else 0)

    def horizon(self, now: float) -> float:
        """Seconds back from ``now`` (engine time) within which every removal is remembered."""
        since = self.forgotten_until if self.forgotten_until is not None else self.first
        return max(now - since, 0.0) if since is not None else 0.0

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        self.open_limit = _open_limit(capacity)
        self._forget(max(capacity - self.open_limit, 0))
        if len(self._open) > capacity:
            self._seal()

    def put_keys(self, fps: Sequence[int], at: float, tag: int = 0) -> None:
        """Callers take a hash before they put it again."""
        if self.capacity <= 0 or not fps:
            return
        if self.first is None:
            self.first = abs(at)
        opened, tags, limit = self._open, self._open_tags, self.open_limit
        for fp in dict.fromkeys(fps):  # once each: a repeat after a seal would be held twice
            opened.pop(fp, None)
            opened[fp] = at
            old = tags.pop(fp, 0) if tags else 0
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

    def take_keys(self, fps: Sequence[int], tags: list[int] | None = None) -> tuple[list[int], list[float]]:
        """The fingerprints held and their signed times (each forgotten here); their tags
        appended to ``tags`` in the same order, when given."""
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
            self._take_sealed(rest, keys, found, tags)
        return keys, found

    def _candidates(self, fps: Sequence[int]) -> list[int]:
        """The fingerprints the filter may hold, each once."""
        if len(fps) > FEW:
            return self._candidates_many(fps)
        f, shift = self._fview, 64 - self._fbits
        out, seen = [], set()
        for fp in fps:
            k = _key(fp)
            if k in seen:
                continue
            if all(f[p >> 3] >> (p & 7) & 1 for p in (((k * m) & MASK64) >> shift for m in MULTIPLIERS)):
                seen.add(k)
                out.append(fp)
        return out

    def _candidates_many(self, fps: Sequence[int]) -> list[int]:
        import numpy as np  # noqa: PLC0415

        arr = np.array(fps, dtype=np.uint64)
        maybe = np.ones(len(arr), dtype=np.bool_)
        for pos in self._positions(np, _keys(np, arr)):
            maybe &= (self._filter[pos >> np.uint64(3)] >> (pos & np.uint64(7)).astype(np.uint8)) & 1 == 1
        if not maybe.any():
            return []
        _, first = np.unique(_keys(np, arr[maybe]), return_index=True)
        picked: list[int] = arr[maybe][np.sort(first)].tolist()
        return picked

    def _search(self, fps: Sequence[int]) -> Iterator[tuple[Segment, Any, list[int]]]:
        """Per segment, newest first, the live entries (indices) of the fingerprints it holds, and
        those fingerprints; each fingerprint found once (a key has at most one live entry)."""
        import numpy as np  # noqa: PLC0415 - loaded with the first seal

        want = self._candidates(fps)
        if not want:
            return
        left = _keys(np, np.array(want, dtype=np.uint64))
        fp_left = list(want)
        for seg in reversed(self._segments):
            if not seg.live:
                continue
            idx = seg.find(left)
            hit = idx >= 0
            if not hit.any():
                continue
            flags = hit.tolist()
            yield seg, idx[hit], [fp for fp, h in zip(fp_left, flags, strict=True) if h]
            fp_left = [fp for fp, h in zip(fp_left, flags, strict=True) if not h]
            left = left[~hit]
            if not len(left):
                return

    def _take_sealed(self, fps: Sequence[int], keys: list[int], found: list[float], tags: list[int] | None) -> None:
        import numpy as np  # noqa: PLC0415

        for seg, at, hit in self._search(fps):
            keys += hit
            found += seg.times(at)
            got = seg.take(at)
            self._sealed_live -= len(at)
            self._stale += len(at)
            if got is not None:
                for tag, n in enumerate(np.bincount(got).tolist()):
                    if tag and n:
                        self._count(tag, -n)
            if tags is not None:
                tags += got.tolist() if got is not None else [0] * len(at)

    def count(self, fps: Sequence[int]) -> int:
        """How many of the fingerprints are held, without forgetting them."""
        n, rest = 0, []
        for fp in fps:
            if fp in self._open:
                n += 1
            else:
                rest.append(fp)
        if rest and self._sealed_live:
            held = {fp for _, _, hit in self._search(rest) for fp in hit}
            n += sum(1 for fp in rest if fp in held)  # a hash asked twice counts twice, as in the open dict
        return n

    def peek_tag(self, fp: int) -> int | None:
        """The tag of a fingerprint held (kept), None when it is not."""
        if fp in self._open:
            return self._open_tags.get(fp, 0)
        for seg, at, _ in self._search([fp]) if self._sealed_live else ():
            return int(seg.tags[at[0]]) if seg.tags is not None else 0
        return None

    def clear(self) -> None:
        """Everything forgotten on purpose (not counted): the horizon starts again."""
        self.first = self.forgotten_until = None
        self._open.clear()
        self._open_tags.clear()
        self._segments.clear()
        self._sealed_live = 0
        self.live_by_tag.clear()
        self._filter, self._fview, self._fbits, self._stale = None, None, 0, 0

    def _seal(self) -> None:
        """The open entries become the newest segment; segments merged; the oldest forgotten
        past the capacity; the filter kept up."""
        import numpy as np  # noqa: PLC0415

        from kvwatch.daemon.engines import removal_segments as rs  # noqa: PLC0415 - numpy on first seal

        opened, otags = self._open, self._open_tags
        n = len(opened)
        self._open, self._open_tags = {}, {}
        if n:
            keys = _keys(np, np.fromiter(opened.keys(), dtype=np.uint64, count=n))
            times = np.fromiter(opened.values(), dtype=np.float64, count=n)
            tags = np.fromiter((otags.get(k, 0) for k in opened), dtype=np.uint16, count=n) if otags else None
            seg = rs.build(keys, times, tags, 0)
            self._segments.append(seg)
            self._sealed_live += n
            self._set_bits(keys)
        self._merge(rs)
        self._forget(max(self.capacity - self.open_limit, 0))

    def _merge(self, rs: Any) -> None:
        """Every FANOUT newest segments of one level merged into one of the next, while the
        merged one holds at most a TOP_PART of the capacity."""
        top = max(self.capacity // TOP_PART, self.open_limit)
        level = 0
        while True:
            same = [s for s in self._segments if s.level == level]
            if len(same) < FANOUT or sum(s.live for s in same[-FANOUT:]) > top:
                return
            group = same[-FANOUT:]
            merged = rs.merge(group, level + 1)
            at = self._segments.index(group[0])
            self._segments[at : at + FANOUT] = [merged]  # taken entries go; their bits stay stale
            level += 1

    def _forget(self, room: int) -> None:
        """The oldest segments dropped while more than ``room`` entries are live."""
        while self._segments and self._sealed_live + len(self._open) > room:
            seg = self._segments.pop(0)
            self._sealed_live -= seg.live
            self._stale += seg.live
            self.forgotten += seg.live
            tags = seg.live_tags()
            if tags is not None and len(tags):
                import numpy as np  # noqa: PLC0415

                for tag, n in enumerate(np.bincount(tags).tolist()):
                    if tag and n:
                        self._count(tag, -n)
            if seg.live:
                last = seg.t_last
                self.forgotten_until = last if self.forgotten_until is None else max(self.forgotten_until, last)
        if not self._segments and self._filter is not None and self._stale:
            self._filter, self._fview, self._fbits, self._stale = None, None, 0, 0

    def _set_bits(self, keys: Any) -> None:
        """The new keys' bits set; the filter rebuilt from every live key when it is too small
        for the live entries or stale bits reach half of them."""
        import numpy as np  # noqa: PLC0415

        live = self._sealed_live
        if self._filter is None or (1 << self._fbits) < BITS_PER_ENTRY * live or 2 * self._stale > live:
            self._rebuild(np)
            return
        for pos in self._positions(np, keys):
            np.bitwise_or.at(self._filter, pos >> np.uint64(3), np.left_shift(1, pos & np.uint64(7)).astype(np.uint8))

    def _rebuild(self, np: Any) -> None:
        bits = 6
        while (1 << bits) < BITS_PER_ENTRY * 2 * max(self._sealed_live, 1):  # room to double
            bits += 1
        self._fbits = bits
        on = np.zeros(1 << bits, dtype=np.bool_)
        from kvwatch.daemon.engines.removal_segments import TAKEN  # noqa: PLC0415

        for seg in self._segments:
            keys = seg.keys()[(seg.flags & TAKEN) == 0]
            for pos in self._positions(np, keys):
                on[pos] = True
        self._filter = np.packbits(on, bitorder="little")
        self._fview = memoryview(self._filter)
        self._stale = 0

    def _positions(self, np: Any, keys: Any) -> list[Any]:
        shift = np.uint64(64 - self._fbits)
        return [(keys * np.uint64(m)) >> shift for m in MULTIPLIERS]
