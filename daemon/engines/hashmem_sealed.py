"""The sealed entries of a hash memory (``hashmem.py``): numpy arrays sorted by fingerprint,
beside each entry's time, the seal it came in (its generation), a live flag and a tag.

A memory creates its sealed part on its first seal, and only then is this module (and numpy,
~15 MiB of the daemon's RSS with its BLAS library) imported: a daemon whose memories never
fill (nothing watched, or engines that store fewer blocks than one open dict holds) never
loads numpy.

A call with a few fingerprints (vLLM announces each block that fills during decoding alone)
pays numpy's per-call overhead several times over, ~5 µs, against ~0.15 µs for the open dict.
So a bit filter of the live fingerprints (three bits each from disjoint slices of the
fingerprint, 8 bits an entry: ~3 % false positives, 1 byte an entry) is kept beside the
arrays: a fingerprint it does not hold is certainly not sealed, and a few that it might hold
are looked up one by one. Takes and forgotten generations leave their bits set (a stale bit
only costs a lookup); a seal sets the new generation's bits, and the filter is rebuilt from the
live entries when it must grow or every REBUILD_SEALS seals (as the memory turns over).

numpy's BLAS library starts a worker thread per CPU when it loads, and each spins for a while
before sleeping: ~0.13 CPU s a thread, ~2 CPU s at once on a 16-CPU node, for a library kvwatch
never calls. Its pools are held to one thread before the import (the library reads these
variables once, when it loads).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import numpy as np  # noqa: E402 - after the thread limits
import numpy.typing as npt  # noqa: E402

FEW = 8  # calls with at most this many fingerprints take the one-by-one path
FILTER_BITS_PER_ENTRY = 8
REBUILD_SEALS = 16  # a memory's generations (hashmem.GENERATIONS)
SHIFTS = (0, 21, 42)  # the fingerprint slices a filter's three bits come from


class SealedEntries:
    def __init__(self) -> None:
        # sorted by fingerprint (older before newer among equal ones)
        self._keys: npt.NDArray[np.uint64] = np.empty(0, dtype=np.uint64)
        self._times: npt.NDArray[np.float64] = np.empty(0, dtype=np.float64)
        self._gens: npt.NDArray[np.uint32] = np.empty(0, dtype=np.uint32)  # which seal each came in
        self._live: npt.NDArray[np.bool_] = np.empty(0, dtype=np.bool_)
        self._tags: npt.NDArray[np.uint16] = np.empty(0, dtype=np.uint16)
        self.live = 0  # live entries
        self._gen = 0
        self._filter = bytearray(1)  # bit (fp & mask) and two more slices: see _might_hold
        self._fmask = 7
        self._seals_since_rebuild = 0

    def take(
        self, fps: Sequence[int], tags: list[int] | None, tagged: bool
    ) -> tuple[list[int], list[float], list[int]]:
        """The fingerprints held and their times (each forgotten here), their tags appended to
        ``tags`` when given, and when ``tagged`` the number taken per tag (indexed by tag)."""
        if len(fps) <= FEW:
            return self._take_few(fps, tags, tagged)
        # the newest entry of a fingerprint is the last of its run; an older one left live
        # beside it (put again without a take) is stale and goes with its generation
        want = np.array(fps, dtype=np.uint64)
        idx = np.maximum(np.searchsorted(self._keys, want, side="right") - 1, 0)
        hit = (self._keys[idx] == want) & self._live[idx]
        where = idx[hit]
        if not len(where):
            return [], [], []
        where = np.unique(where)  # one hash twice in a call is taken once
        self._live[where] = False
        self.live -= len(where)
        keys: list[int] = self._keys[where].tolist()
        found: list[float] = self._times[where].tolist()
        per_tag: list[int] = []
        if tagged or tags is not None:
            got = self._tags[where]
            if tagged:
                per_tag = np.bincount(got).tolist()
            if tags is not None:
                tags += got.tolist()
        return keys, found, per_tag

    def _might_hold(self, fp: int) -> bool:
        f, m = self._filter, self._fmask
        a, b, c = fp & m, (fp >> 21) & m, (fp >> 42) & m  # SHIFTS
        return bool(f[a >> 3] >> (a & 7) & f[b >> 3] >> (b & 7) & f[c >> 3] >> (c & 7) & 1)

    def _index(self, fp: int) -> int:
        """The index of fingerprint ``fp``'s live newest entry, -1 when it is not held."""
        if not self._might_hold(fp):
            return -1
        i = int(self._keys.searchsorted(np.uint64(fp), side="right")) - 1
        return i if i >= 0 and int(self._keys[i]) == fp and self._live[i] else -1

    def _take_few(
        self, fps: Sequence[int], tags: list[int] | None, tagged: bool
    ) -> tuple[list[int], list[float], list[int]]:
        """``take`` one fingerprint at a time, behind the filter."""
        keys: list[int] = []
        found: list[float] = []
        per_tag: list[int] = []
        for fp in fps:
            i = self._index(fp)
            if i < 0:
                continue  # not held, or taken earlier in this call
            self._live[i] = False
            self.live -= 1
            keys.append(fp)
            found.append(float(self._times[i]))
            if tagged or tags is not None:
                tag = int(self._tags[i])
                if tagged:
                    per_tag += [0] * (tag + 1 - len(per_tag))
                    per_tag[tag] += 1
                if tags is not None:
                    tags.append(tag)
        return keys, found, per_tag

    def tag_of(self, fp: int) -> int | None:
        """The tag of a live fingerprint, None when it is not held."""
        i = max(int(np.searchsorted(self._keys, np.uint64(fp), side="right")) - 1, 0)
        if len(self._keys) and int(self._keys[i]) == fp and self._live[i]:
            return int(self._tags[i])
        return None

    def count(self, fps: Sequence[int]) -> int:
        """How many of the fingerprints are held, without forgetting them."""
        if len(fps) <= FEW:
            return sum(1 for fp in fps if self._index(fp) >= 0)
        want = np.array(fps, dtype=np.uint64)
        idx = np.maximum(np.searchsorted(self._keys, want, side="right") - 1, 0)
        return int(np.count_nonzero((self._keys[idx] == want) & self._live[idx]))

    def clear(self) -> None:
        self._keys, self._times = self._keys[:0], self._times[:0]
        self._gens, self._live, self._tags = self._gens[:0], self._live[:0], self._tags[:0]
        self.live = 0
        self._filter, self._fmask, self._seals_since_rebuild = bytearray(1), 7, 0

    def seal(self, opened: dict[int, float], otags: dict[int, int], room: int, tagged: bool) -> tuple[int, list[int]]:
        """The open entries (and their non-zero tags) added as a new generation, after dropping
        the entries taken and, while more than ``room`` would be live, whole generations, oldest
        first. Returns the live entries so forgotten and, when ``tagged``, their number per tag."""
        n = len(opened)
        keys = np.fromiter(opened.keys(), dtype=np.uint64, count=n)
        times = np.fromiter(opened.values(), dtype=np.float64, count=n)
        tags = np.fromiter((otags.get(k, 0) for k in opened), dtype=np.uint16, count=n) if otags else None
        self._gen += 1
        gone, per_tag = self._compact(self.live + n - room, tagged)
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
        self.live += n
        self._refilter(keys)
        return gone, per_tag

    def _refilter(self, new: npt.NDArray[np.uint64]) -> None:
        """The new generation's bits set; or the filter rebuilt from the live fingerprints, at
        least FILTER_BITS_PER_ENTRY bits each, when it is too small or has aged."""
        self._seals_since_rebuild += 1
        if self._fmask + 1 >= FILTER_BITS_PER_ENTRY * self.live and self._seals_since_rebuild < REBUILD_SEALS:
            f = np.frombuffer(self._filter, dtype=np.uint8)  # a view: writes land in the bytearray
            for pos in self._positions(new, self._fmask):
                np.bitwise_or.at(f, pos >> np.uint64(3), np.left_shift(1, pos & np.uint64(7)).astype(np.uint8))
            return
        bits = 8
        while bits < FILTER_BITS_PER_ENTRY * max(self.live, 1):
            bits *= 2
        on = np.zeros(bits, dtype=np.bool_)
        for pos in self._positions(self._keys[self._live], bits - 1):
            on[pos] = True
        self._filter = bytearray(np.packbits(on, bitorder="little").tobytes())
        self._fmask = bits - 1
        self._seals_since_rebuild = 0

    @staticmethod
    def _positions(keys: npt.NDArray[np.uint64], mask: int) -> list[npt.NDArray[np.uint64]]:
        return [(keys >> np.uint64(shift)) & np.uint64(mask) for shift in SHIFTS]

    def _compact(self, excess: int, tagged: bool) -> tuple[int, list[int]]:
        """Drop the entries already taken, then whole generations, oldest first, until
        ``excess`` live entries are gone; returns those and their number per tag."""
        keep = self._live.copy()
        gone, per_tag = 0, []
        if excess > 0:
            counts = np.bincount(self._gens[keep])
            through = int(np.searchsorted(np.cumsum(counts), excess))  # drop generations 0..through
            old = keep & (self._gens <= through)
            gone = int(np.count_nonzero(old))
            if tagged:
                per_tag = np.bincount(self._tags[old]).tolist()
            self.live -= gone
            keep &= ~old
        if not keep.all():
            self._keys = self._keys[keep]
            self._times = self._times[keep]
            self._gens = self._gens[keep]
            self._live = self._live[keep]
            self._tags = self._tags[keep]
        return gone, per_tag
