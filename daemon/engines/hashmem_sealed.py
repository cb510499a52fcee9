"""The sealed entries of a hash memory (``hashmem.py``): numpy arrays sorted by fingerprint,
beside each entry's time, the seal it came in (its generation), a live flag and a tag.

A memory creates its sealed part on its first seal, and only then is this module (and numpy,
~15 MiB of the daemon's RSS with its BLAS library) imported: a daemon whose memories never
fill (nothing watched, or engines that store fewer blocks than one open dict holds) never
loads numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


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

    def take(
        self, fps: Sequence[int], tags: list[int] | None, tagged: bool
    ) -> tuple[list[int], list[float], list[int]]:
        """The fingerprints held and their times (each forgotten here), their tags appended to
        ``tags`` when given, and when ``tagged`` the number taken per tag (indexed by tag)."""
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

    def tag_of(self, fp: int) -> int | None:
        """The tag of a live fingerprint, None when it is not held."""
        i = max(int(np.searchsorted(self._keys, np.uint64(fp), side="right")) - 1, 0)
        if len(self._keys) and int(self._keys[i]) == fp and self._live[i]:
            return int(self._tags[i])
        return None

    def count(self, fps: Sequence[int]) -> int:
        """How many of the fingerprints are held, without forgetting them."""
        want = np.array(fps, dtype=np.uint64)
        idx = np.maximum(np.searchsorted(self._keys, want, side="right") - 1, 0)
        return int(np.count_nonzero((self._keys[idx] == want) & self._live[idx]))

    def clear(self) -> None:
        self._keys, self._times = self._keys[:0], self._times[:0]
        self._gens, self._live, self._tags = self._gens[:0], self._live[:0], self._tags[:0]
        self.live = 0

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
        return gone, per_tag

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
