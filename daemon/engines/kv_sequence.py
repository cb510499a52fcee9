"""A KV event stream's sequence numbers (no sockets: ``kv_events.py`` owns those): which batches
count, which are missing and asked of the replay endpoint, which are lost.

vLLM numbers its batches from 0, one a step, in an 8-byte unsigned frame. Every number is the
publisher's word, so none is believed blindly:

* the next number is counted; a jump ahead of at most ``max_jump`` is a gap: those batches are
  missing (asked again where there is a replay endpoint; what it cannot serve is lost);
* a number further ahead, or one going back, is held until the next message decides: a stream
  that continues from it is a publisher that began again (a restart: its held batch and the next
  count, the missing ones are lost); a stream that continues the old sequence makes it a stray
  batch, dropped and counted as a ``sequence`` decode error. A stray numbered 2**63 is one bad
  batch, not 2**63 lost ones.
* The numbers awaiting replay are kept as ranges, at most ``max_replay`` numbers: past it the
  oldest are given up (lost, and counted abandoned), so that a publisher jumping ahead again and
  again costs no memory.

``max_jump`` (MAX_JUMP): about 17 minutes of an engine stepping 1,000 times a second; vLLM's
replay buffer holds 10,000 batches by default (``buffer_steps``), so a real gap anywhere near it
is lost anyway, while a restart or a reconnection after a long partition goes on from its number.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Generic, TypeVar

MAX_JUMP = 1 << 20

P = TypeVar("P")
Ranges = tuple[tuple[int, int], ...]


class Missing:
    """Sequence numbers awaiting replay: ascending, disjoint ``[lo, hi)`` ranges, at most
    ``limit`` numbers (so at most as many ranges)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._ranges: list[tuple[int, int]] = []
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def first(self) -> int:
        return self._ranges[0][0]

    def snapshot(self) -> Ranges:
        return tuple(self._ranges)

    def add(self, lo: int, hi: int) -> int:
        """Add ``[lo, hi)`` (numbers only grow between restarts); returns how many of the oldest
        were given up to stay within the limit."""
        if self._ranges:
            lo = max(lo, self._ranges[-1][1])
        if hi <= lo:
            return 0
        self._ranges.append((lo, hi))
        self.count += hi - lo
        given = 0
        while self.count > self.limit:
            a, b = self._ranges[0]
            n = min(b - a, self.count - self.limit)
            if n == b - a:
                self._ranges.pop(0)
            else:
                self._ranges[0] = (a + n, b)
            self.count -= n
            given += n
        return given

    def discard(self, seq: int) -> bool:
        i = bisect_right(self._ranges, seq, key=lambda r: r[0]) - 1
        if i < 0 or seq >= self._ranges[i][1]:
            return False
        a, b = self._ranges[i]
        self._ranges[i : i + 1] = [r for r in ((a, seq), (seq + 1, b)) if r[0] < r[1]]
        self.count -= 1
        return True

    def take(self, covered: Ranges) -> int:
        """Remove what ``covered`` (ascending, disjoint) covers; returns how many of those were
        still missing. One sweep over both."""
        kept: list[tuple[int, int]] = []
        j, m = 0, len(covered)
        for a, b in self._ranges:
            while j < m and covered[j][1] <= a:
                j += 1
            k, lo = j, a  # lo: the range's start not yet covered
            while lo < b and k < m and covered[k][0] < b:
                c, d = covered[k]
                if c > lo:
                    kept.append((lo, c))
                lo = max(lo, d)
                if d > b:
                    break  # it reaches into the next range too
                k += 1
            j = k
            if lo < b:
                kept.append((lo, b))
        before = self.count
        self._ranges = kept
        self.count = sum(b - a for a, b in kept)
        return before - self.count

    def clear(self) -> int:
        n, self.count = self.count, 0
        self._ranges.clear()
        return n


@dataclass(slots=True)
class Verdict(Generic[P]):
    """What one live message asks of the stream, in this order."""

    restart: bool = False  # the publisher began again: forget its blocks, drop the pending replay
    strays: int = 0  # batches dropped for a sequence number the stream did not go on from
    payloads: list[P] = field(default_factory=list)  # to count, in order
    ask: bool = False  # new numbers await replay


class StreamSequence(Generic[P]):
    """``replayable``: the stream has a replay endpoint, which serves gaps of up to ``max_replay``."""

    def __init__(self, replayable: bool, max_replay: int, max_jump: int = MAX_JUMP) -> None:
        self.replayable = replayable
        self.max_replay = max_replay
        self.max_jump = max_jump
        self.expected: int | None = None
        self.gaps = self.missed = self.replayed = self.lost = self.restarts = self.abandoned = 0
        self.missing = Missing(max_replay)
        self._held: tuple[int, P] | None = None

    def live(self, seq: int, payload: P) -> Verdict[P]:
        v: Verdict[P] = Verdict()
        held, self._held = self._held, None
        exp = self.expected
        if held is not None:
            if seq == held[0] + 1 and seq != exp:  # the held number's sequence goes on: a restart
                self.restarts += 1
                self.lost += self.missing.clear()
                v.restart = True
                v.payloads.append(held[1])
                exp = seq
            else:
                v.strays += 1
        if exp is not None and seq != exp:
            if not exp < seq <= exp + self.max_jump:
                self.expected = exp
                self._held = (seq, payload)  # far ahead, or back: the next message decides
                return v
            self.gaps += 1
            self.missed += seq - exp
            v.ask = self._gap(exp, seq)
        self.expected = seq + 1
        v.payloads.append(payload)
        return v

    def _gap(self, lo: int, hi: int) -> bool:
        if not self.replayable or hi - lo > self.max_replay:
            self.lost += hi - lo
            return False
        given = self.missing.add(lo, hi)
        self.lost += given
        self.abandoned += given
        return True

    def replayed_one(self, seq: int) -> bool:
        """A replayed batch: True when it was missing (count it)."""
        if self.missing.discard(seq):
            self.replayed += 1
            return True
        return False

    def settle(self, covered: Ranges) -> None:
        """A replay request answered (or timed out): what it covered and did not bring is lost."""
        self.lost += self.missing.take(covered)

    def lose_missing(self) -> None:
        """The replay endpoint cannot be asked: every missing batch is lost."""
        self.lost += self.missing.clear()
