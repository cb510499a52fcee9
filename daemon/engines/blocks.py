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
for blocks whose store the stream saw; judged OFFLOAD_SETTLE_SECONDS after the removal, the
tier's announcement of a store in flight may come after it). Only blocks an engine offloads are judged: vLLM's
connector offloads a request's prompt, never the blocks it generates (``offload_prompt_only``,
its default), and a generated block is stored alone, after its parent. A block stored alone
after a parent is marked (its stored and removed times kept negative, so that the mark
outlives a removal and a store again) and not judged; so is a prompt's single new block after
a cached prefix, which the stream cannot tell from a generated one.

Per tenant (``tenants.py``): a store names the tenant of its blocks, kept as their tag in both
memories; the stores, removals, young removals, regrets, drops and clears of tagged blocks are
counted by tag, and a tag's resident blocks are its live entries. Untagged blocks are the
``default`` tenant's (the medium's totals less the tagged ones); the removal of a block whose
store the stream never saw is ``unknown``'s.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import replace
from math import copysign
from typing import Any

from kvwatch.daemon.engines.hashmem import HashMemory, fingerprint
from kvwatch.daemon.engines.memory_budget import cost
from kvwatch.daemon.engines.pending import PendingRemovals
from kvwatch.daemon.engines.removals import RemovalMemory
from kvwatch.daemon.engines.tenants import DEFAULT, UNKNOWN
from kvwatch.daemon.engines.wire import Hash
from kvwatch.daemon.model.engines import REGRET_BUCKETS, MediumTotals

OFFLOAD_SETTLE_SECONDS = 5.0  # engine time a GPU removal waits for its offload's announcement
MAX_PENDING = 1 << 16  # removals waiting, at most; past it the oldest are judged at once
PENDING_PER_STORED = 16  # and at most one per this many store times the group remembers
MIN_PENDING = 1024  # and at least this many (a small group's removals of one batch still wait)
# per-tenant counters, by tag: the MediumTotals fields a tenant has
T_FIELDS = ("stored", "removed", "removed_young", "regretted", "regret_tokens", "dropped", "cleared")
T_STORED, T_REMOVED, T_YOUNG, T_REGRET, T_REGRET_TOKENS, T_DROPPED, T_CLEARED = range(len(T_FIELDS))


class MediumBlocks:
    __slots__ = (
        "_copies",
        "_pending",
        "_pending_max",
        "_regret_le",
        "_removed_at",
        "_stored_at",
        "_tenants",
        "announced",
        "announced_tokens",
        "cleared",
        "dropped",
        "regret_seconds",
        "regret_tokens",
        "regretted",
        "removed",
        "restored",
        "stored",
        "unheld",
        "young",
    )

    def __init__(self, max_stored: int, max_removed: int) -> None:
        self.stored = self.removed = self.young = 0
        self.regretted = self.regret_tokens = 0
        self.restored = 0  # stored again while still resident
        self.cleared = 0  # resident when an AllBlocksCleared dropped them
        self.dropped = 0  # removed without a lower tier ever holding them
        self.announced = 0  # held blocks announced again (prefix-cache hits): nothing changes
        self.announced_tokens = 0  # block_size x each of those
        self.regret_seconds = 0.0
        self._regret_le = [0] * (len(REGRET_BUCKETS) + 1)  # per bucket, the last one +Inf
        self._stored_at = HashMemory(max_stored)
        self._removed_at = RemovalMemory(max_removed)  # capacity 0: no regret accounting
        self._pending = PendingRemovals()  # GPU removals not offloaded yet (pending.py)
        self._pending_max = _pending_max(max_stored)
        # a hash held in more than one physical block (stored again while held): its copies beyond
        # the first, so that removing one copy leaves it held; at most max_stored // 16 such hashes
        self._copies: dict[int, int] = {}
        self._tenants: dict[int, list[int]] = {}  # tag -> T_FIELDS counts
        self.unheld = 0  # removals of blocks whose store is not remembered

    def store(self, hashes: Sequence[Hash], ts: float, block_size: int, alone: bool = False, tenant: int = 0) -> None:
        """``alone``: stored by itself after a parent block (a generated block, as like as not).
        A block once stored alone keeps that mark when the engine stores it again (a preempted
        request computing its generated blocks again in one go). ``tenant``: the blocks' tag."""
        fps = [fingerprint(h) for h in hashes]
        self.stored += len(fps)
        if tenant:
            self._tenant(tenant)[T_STORED] += len(fps)
        marked = set(fps) if alone else set()
        tags: list[int] | None = [] if self._removed_at.live_by_tag else None
        keys, gone = self._removed_at.take_keys(fps, tags)
        for fp, t in zip(keys, gone, strict=True):
            self._regret(max(ts - abs(t), 0.0), block_size)
            if copysign(1.0, t) < 0:
                marked.add(fp)
        for tag in tags or ():  # a regret is the tenant's whose block was removed
            if tag:
                c = self._tenant(tag)
                c[T_REGRET] += 1
                c[T_REGRET_TOKENS] += block_size
        keys, held = self._stored_at.take_keys(fps)
        self.restored += len(keys)
        marked.update(fp for fp, t in zip(keys, held, strict=True) if copysign(1.0, t) < 0)
        if keys:
            self._copy(keys)
        _put(self._stored_at, fps, ts, marked, tag=tenant)

    def _tenant(self, tag: int) -> list[int]:
        c = self._tenants.get(tag)
        if c is None:
            c = self._tenants[tag] = [0] * len(T_FIELDS)
        return c

    def _copy(self, fps: Sequence[int]) -> None:
        copies, room = self._copies, max(self._stored_at.capacity // 16, 1)
        for fp in fps:
            n = copies.get(fp, 0)
            if n or len(copies) < room:
                copies[fp] = n + 1

    def remove(
        self, hashes: Sequence[Hash], ts: float, young_before: float, lower: Sequence[MediumBlocks] = ()
    ) -> None:
        fps = [fingerprint(h) for h in hashes]
        self.removed += len(fps)
        tags: list[int] | None = [] if self._stored_at.live_by_tag else None
        keys, times = self._stored_at.take_keys(fps, tags)
        self.unheld += len(fps) - len(keys)
        self.young += sum(1 for t in times if abs(t) > young_before)
        tag_of = self._removed_tenants(keys, times, tags, young_before) if tags else {}
        if self._copies:
            keys, times, fps = self._uncopy(keys, times, fps, tag_of)
        alone = {k for k, t in zip(keys, times, strict=True) if copysign(1.0, t) < 0}
        # only blocks whose store the stream saw (older ones cannot be judged), and not alone
        judged = [k for k in keys if k not in alone] if lower else []
        if judged:
            self._pending.add(ts, judged, [tag_of.get(k, 0) for k in judged] if tag_of else None)
            if self._pending.n > self._pending_max:
                self.settle(float("inf"), lower)
        seen = set(keys)
        again = [f for f in fps if f not in seen]  # removed before without a store between
        if again:  # (one hash in two physical blocks): the mark of the first removal stays
            rtags: list[int] | None = [] if self._removed_at.live_by_tag else None
            rk, rt = self._removed_at.take_keys(again, rtags)
            alone.update(k for k, t in zip(rk, rt, strict=True) if copysign(1.0, t) < 0)
            if rtags:
                tag_of.update((k, g) for k, g in zip(rk, rtags, strict=True) if g)
        _put(self._removed_at, fps, ts, alone, tag_of=tag_of)

    def _removed_tenants(
        self, keys: Sequence[int], times: Sequence[float], tags: Sequence[int], young_before: float
    ) -> dict[int, int]:
        """Count the removal for each tagged block's tenant; the blocks' tags, by fingerprint."""
        tag_of: dict[int, int] = {}
        for k, t, tag in zip(keys, times, tags, strict=True):
            if tag:
                tag_of[k] = tag
                c = self._tenant(tag)
                c[T_REMOVED] += 1
                if abs(t) > young_before:
                    c[T_YOUNG] += 1
        return tag_of

    def _uncopy(
        self, keys: list[int], times: list[float], fps: list[int], tag_of: dict[int, int]
    ) -> tuple[list[int], list[float], list[int]]:
        """A removed copy of a hash held in several blocks: the hash stays held (with its time and
        tag); the rest of the removal goes on with the hashes whose last copy went."""
        copies = self._copies
        kept = [(k, t) for k, t in zip(keys, times, strict=True) if k in copies]
        if not kept:
            return keys, times, fps
        for k, t in kept:
            n = copies.pop(k) - 1
            if n:
                copies[k] = n
            self._stored_at.put_keys([k], t, tag_of.get(k, 0))
        still = {k for k, _ in kept}
        rest = [(k, t) for k, t in zip(keys, times, strict=True) if k not in still]
        return [k for k, _ in rest], [t for _, t in rest], [f for f in fps if f not in still]

    def settle(self, ts: float, lower: Sequence[MediumBlocks]) -> None:
        """Judge the GPU removals older than OFFLOAD_SETTLE_SECONDS: those no lower tier holds
        or removed by now were dropped. The offload's announcement may follow the removal (a
        request preempted with its store in flight), hence the wait."""
        for fps, tags in self._pending.take(ts - OFFLOAD_SETTLE_SECONDS):
            self.dropped += _dropped(fps, lower)
            if tags is not None:
                self._tenant_drops(fps, tags, lower)

    def _tenant_drops(self, fps: Sequence[int], tags: Sequence[int], lower: Sequence[MediumBlocks]) -> None:
        by_tag: dict[int, list[int]] = {}
        for fp, tag in zip(fps, tags, strict=True):
            if tag:
                by_tag.setdefault(tag, []).append(fp)
        for tag, group in by_tag.items():
            self._tenant(tag)[T_DROPPED] += _dropped(group, lower)

    def resize(self, max_stored: int, max_removed: int) -> None:
        self._stored_at.resize(max_stored)
        self._removed_at.resize(max_removed)
        self._pending_max = _pending_max(max_stored)

    @property
    def bounds(self) -> tuple[int, int]:
        """The capacities of the two memories: store times, removals."""
        return self._stored_at.capacity, self._removed_at.capacity

    def holds(self, h: Hash) -> bool:
        return self._stored_at.count([fingerprint(h)]) > 0

    def peek_tag(self, fp: int) -> int | None:
        """The tag of a block held, or else removed and remembered; None when neither."""
        tag = self._stored_at.peek_tag(fp)
        return tag if tag is not None else self._removed_at.peek_tag(fp)

    def announce(self, n: int, block_size: int) -> None:
        self.announced += n
        self.announced_tokens += n * block_size

    def knows(self, fps: Sequence[int]) -> int:
        """How many of the hash fingerprints this medium holds or has removed (as far as it
        remembers)."""
        return self._stored_at.count(fps) + self._removed_at.count(fps)

    def drop_all(self) -> None:
        """AllBlocksCleared: what is resident is dropped on purpose, and counted."""
        self.cleared += len(self._stored_at) + sum(self._copies.values())
        for tag, n in self._stored_at.live_by_tag.items():
            self._tenant(tag)[T_CLEARED] += n
        self.clear()

    def clear(self) -> None:
        self._copies.clear()
        self._pending.clear()
        self._stored_at.clear()
        self._removed_at.clear()

    def _regret(self, seconds: float, block_size: int) -> None:
        self.regretted += 1
        self.regret_tokens += block_size
        self.regret_seconds += seconds
        self._regret_le[bisect_left(REGRET_BUCKETS, seconds)] += 1

    def tenant_totals(self) -> dict[int, MediumTotals]:
        """Per tag: its blocks' counts; DEFAULT's are the medium's less every tag's (and less the
        removals of blocks not remembered, UNKNOWN's)."""
        live = self._stored_at.live_by_tag
        out: dict[int, MediumTotals] = {}
        for tag in sorted(self._tenants.keys() | live.keys()):
            c = self._tenants.get(tag) or [0] * len(T_FIELDS)
            counts: dict[str, Any] = dict(zip(T_FIELDS, c, strict=True))
            out[tag] = MediumTotals(**counts, resident=live.get(tag, 0))
        unknown = out.get(UNKNOWN, MediumTotals())
        out[UNKNOWN] = replace(unknown, removed=unknown.removed + self.unheld)
        total = self.totals()
        rest: dict[str, Any] = {
            f: getattr(total, f) - sum(getattr(m, f) for m in out.values()) for f in (*T_FIELDS, "resident")
        }
        out[DEFAULT] = MediumTotals(**rest)
        return out

    @property
    def remembered(self) -> int:
        """Hashes held in both memories."""
        return len(self._stored_at) + len(self._removed_at)

    @property
    def held_bytes(self) -> int:
        """What the two memories hold, as the node's budget counts it."""
        return cost(len(self._stored_at), len(self._removed_at))

    def regret_horizon(self, now: float) -> float:
        """Seconds back from ``now`` (engine time) within which every removal is remembered."""
        return self._removed_at.horizon(now)

    def totals(self) -> MediumTotals:
        return MediumTotals(
            stored=self.stored,
            removed=self.removed,
            removed_young=self.young,
            regretted=self.regretted,
            restored=self.restored,
            cleared=self.cleared,
            dropped=self.dropped,
            resident=len(self._stored_at) + sum(self._copies.values()),
            regret_tokens=self.regret_tokens,
            regret_seconds=self.regret_seconds,
            regret_buckets=tuple(self._regret_le),
            stores_forgotten=self._stored_at.forgotten,
            removals_forgotten=self._removed_at.forgotten,
            announced=self.announced,
            announced_tokens=self.announced_tokens,
        )


def _pending_max(max_stored: int) -> int:
    """GPU removals a group keeps waiting for their offload: in proportion to what it remembers."""
    return min(MAX_PENDING, max(max_stored // PENDING_PER_STORED, MIN_PENDING))


def _dropped(fps: Sequence[int], lower: Sequence[MediumBlocks]) -> int:
    known = max((m.knows(fps) for m in lower), default=0)
    return len(fps) - min(known, len(fps))


def _put(
    memory: HashMemory | RemovalMemory,
    fps: Sequence[int],
    ts: float,
    marked: set[int],
    *,
    tag: int = 0,
    tag_of: Mapping[int, int] | None = None,
) -> None:
    """Each fingerprint with its time, kept negative for those marked (stored alone once), and
    its tag: ``tag`` for all, or each one's in ``tag_of`` (0 where it has none)."""
    if tag_of:
        by_tag: dict[int, list[int]] = {}
        for f in fps:
            by_tag.setdefault(tag_of.get(f, 0), []).append(f)
        for t, group in by_tag.items():
            _put(memory, group, ts, marked, tag=t)
        return
    if not marked:
        memory.put_keys(fps, ts, tag)
        return
    memory.put_keys([f for f in fps if f not in marked], ts, tag)
    memory.put_keys([f for f in fps if f in marked], -ts, tag)
