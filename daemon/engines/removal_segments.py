"""The sealed segments of a removal memory (``removals.py``): numpy arrays, one segment per seal
or merge, immutable but for the taken flag.

A segment keeps, per entry, the top 48 bits of the block hash's 64-bit fingerprint (its *key*)
and its removal time:

* a *flat* segment (fewer than BUCKETED_MIN entries) keeps the keys whole, sorted (8 bytes);
* a *bucketed* one keeps their low 32 bits (4 bytes), sorted within 65,536 buckets of their top
  16 bits, and where each bucket begins (256 KiB: under half a byte an entry).

The time is 16 bits (2 bytes): a removal's offset from the segment's first, in units of a power
of two of 1/1024 s, the smallest that spans the segment within TICKS (1 ms for a segment filled
in under 16 s; 64 ms for one that spans 17 minutes); its top two bits are the entry's mark
(kept with its time, as a negative time) and its taken flag. A tenant's tag (2 bytes) is kept
only by a segment that has a tagged entry.

So an entry of a bucketed segment costs 6.5 bytes (8.5 tagged), a flat one's 10 (12).

Two distinct blocks share a key with probability 2^-48 per pair: a store of a new block is
taken for a regret with probability (live entries) / 2^48 (4e-8 at 12 million remembered).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # numpy's BLAS pool is never used here: one thread

import numpy as np  # noqa: E402 - after the thread limits
import numpy.typing as npt  # noqa: E402

KEY_SHIFT = 16  # a key is a fingerprint's top 48 bits
BUCKET_BITS = 16
BUCKETS = 1 << BUCKET_BITS
BUCKETED_MIN = 1 << 19  # entries from which a segment is bucketed (its table under 0.5 B an entry)
LOW32 = np.uint64(0xFFFFFFFF)
TICKS = (1 << 14) - 1  # time offsets 0..TICKS
MARK = np.uint16(1 << 14)
TAKEN = np.uint16(1 << 15)
TIME_BITS = np.uint16(TICKS)
BASE_UNIT = 1.0 / 1024

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
_NO_REM: npt.NDArray[np.uint32] = np.empty(0, dtype=np.uint32)
_NO_OFF: I64 = np.empty(0, dtype=np.int64)


def unit_for(span: float) -> float:
    """The time unit of a segment spanning ``span`` seconds: a power of two of 1/1024 s."""
    unit = BASE_UNIT
    while span / unit > TICKS and unit < 1 << 30:
        unit *= 2
    return unit


class Segment:
    __slots__ = ("_keys", "_off", "_rem", "bucketed", "flags", "level", "live", "t0", "t_last", "tags", "unit")

    def __init__(
        self, keys: U64, times: npt.NDArray[np.float64], tags: npt.NDArray[np.uint16] | None, level: int
    ) -> None:
        """``keys`` sorted (equal keys oldest first), ``times`` signed (negative: marked)."""
        self.level = level
        self.live = len(keys)
        mag = np.abs(times)
        self.t0 = float(mag.min()) if len(mag) else 0.0
        self.t_last = float(mag.max()) if len(mag) else 0.0
        self.unit = unit_for(self.t_last - self.t0)
        ticks = np.clip(np.rint((mag - self.t0) / self.unit), 0, TICKS).astype(np.uint16)
        self.flags = ticks | np.where(np.signbit(times), MARK, np.uint16(0))
        self.tags = tags if tags is not None and tags.any() else None
        # flat: the keys; bucketed: their low 32 bits, and where each bucket begins (the other empty)
        self.bucketed = len(keys) >= BUCKETED_MIN
        self._keys: U64 = keys[:0] if self.bucketed else keys
        self._rem: npt.NDArray[np.uint32] = (keys & LOW32).astype(np.uint32) if self.bucketed else _NO_REM
        self._off: I64 = _NO_OFF
        if self.bucketed:
            counts = np.bincount((keys >> np.uint64(32)).astype(np.int64), minlength=BUCKETS)
            self._off = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)

    def __len__(self) -> int:
        return len(self.flags)

    @property
    def nbytes(self) -> int:
        tags = self.tags.nbytes if self.tags is not None else 0
        return self._keys.nbytes + self._rem.nbytes + self._off.nbytes + self.flags.nbytes + tags

    def keys(self) -> U64:
        """Every entry's key, in order."""
        if not self.bucketed:
            return self._keys
        high = np.repeat(np.arange(BUCKETS, dtype=np.uint64), np.diff(self._off))
        return (high << np.uint64(32)) | self._rem.astype(np.uint64)

    def times(self, idx: I64) -> list[float]:
        """The signed removal times of entries ``idx``."""
        out: list[float] = self.time_array(idx).tolist()
        return out

    def time_array(self, idx: I64) -> npt.NDArray[np.float64]:
        """The same as an array: a merge of millions of entries makes no Python float each (their
        small-object arenas outlive the merge in the daemon's resident memory)."""
        f = self.flags[idx]
        mag = self.t0 + (f & TIME_BITS).astype(np.float64) * self.unit
        return np.where((f & MARK) != 0, -mag, mag)

    def find(self, want: U64) -> I64:
        """Per key wanted, the index of its live entry here, -1 where none."""
        lo, end = self._first(want)
        idx = np.full(len(want), -1, dtype=np.int64)
        pending = np.arange(len(want))
        while len(pending):  # over the run of equal keys: the live one, if any
            at = lo[pending]
            inside = at < end[pending]
            pending, at = pending[inside], at[inside]
            same = self._key_at(at) == want[pending]
            pending, at = pending[same], at[same]
            live = (self.flags[at] & TAKEN) == 0
            idx[pending[live]] = at[live]
            pending = pending[~live]
            lo[pending] += 1
        return idx

    def _key_at(self, at: I64) -> U64:
        if not self.bucketed:
            return self._keys[at]
        high = (np.searchsorted(self._off, at, side="right") - 1).astype(np.uint64)
        return (high << np.uint64(32)) | self._rem[at].astype(np.uint64)

    def _first(self, want: U64) -> tuple[I64, I64]:
        """Per key wanted, the first index not below it, and the end of the range searched."""
        if not self.bucketed:
            lo = np.searchsorted(self._keys, want, side="left").astype(np.int64)
            return lo, np.full(len(want), len(self._keys), dtype=np.int64)
        bucket = (want >> np.uint64(32)).astype(np.int64)
        rem = (want & LOW32).astype(np.uint32)
        lo, hi = self._off[bucket].copy(), self._off[bucket + 1].copy()
        end = hi.copy()
        last = max(len(self._rem) - 1, 0)
        while True:  # a binary search in each key's bucket, all at once
            active = lo < hi
            if not active.any():
                return lo, end
            mid = (lo + hi) >> 1
            below = self._rem[np.minimum(mid, last)] < rem
            lo = np.where(active & below, mid + 1, lo)
            hi = np.where(active & ~below, mid, hi)

    def take(self, idx: I64) -> npt.NDArray[np.uint16] | None:
        """Entries ``idx`` (live, distinct) taken; their tags where this segment keeps tags."""
        self.flags[idx] |= TAKEN
        self.live -= len(idx)
        return self.tags[idx] if self.tags is not None else None

    def live_tags(self) -> npt.NDArray[np.uint16] | None:
        if self.tags is None:
            return None
        live: npt.NDArray[np.uint16] = self.tags[(self.flags & TAKEN) == 0]
        return live


def build(keys: U64, times: npt.NDArray[np.float64], tags: npt.NDArray[np.uint16] | None, level: int) -> Segment:
    """A segment of unsorted entries (oldest first)."""
    order = np.argsort(keys, kind="stable")
    return Segment(keys[order], times[order], tags[order] if tags is not None else None, level)


def merge(segments: Sequence[Segment], level: int) -> Segment:
    """One segment of the live entries of ``segments`` (oldest first)."""
    keys, times, tags = [], [], []
    tagged = any(s.tags is not None for s in segments)
    for s in segments:
        live = np.flatnonzero((s.flags & TAKEN) == 0)
        keys.append(s.keys()[live])
        times.append(s.time_array(live))
        if tagged:
            tags.append(s.tags[live] if s.tags is not None else np.zeros(len(live), dtype=np.uint16))
    return build(np.concatenate(keys), np.concatenate(times), np.concatenate(tags) if tagged else None, level)
