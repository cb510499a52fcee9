"""What the KV event accounting retains, whatever a publisher sends (``memory_budget.py``).

* A stream's hash memories hold at most three media's worth (the GPU pool's, its first lower
  tier's, and one more that the other media share), a medium's worth being twice one group's
  bound: a publisher that names every medium and group it can does not multiply its memory.
* The node's streams share one budget (``engines.kv_memory_bytes``) by use: a stream that holds
  little takes nothing from the others, one that fills shrinks them to an equal share at once,
  one that leaves gives its part back, and every entry a shrink drops is counted as forgotten.

Streams are fed the bytes vLLM's encoder sends (``wire_encode``), through the real decoding.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import pytest

from kvwatch.daemon.config import EnginesConfig
from kvwatch.daemon.config.base import ConfigError, parse
from kvwatch.daemon.engines.blocks import MediumBlocks
from kvwatch.daemon.engines.groups import MAX_STREAM_GROUPS
from kvwatch.daemon.engines.memory_budget import (
    DEFAULT_BYTES,
    MemoryBudget,
    cost,
    fair,
    primaries,
    split,
    wanted,
)
from kvwatch.daemon.engines.stream_counts import MAX_MEDIA, StreamCounts
from kvwatch.daemon.lab import wire_encode as we

S, R = 4096, 4096  # max_tracked_blocks, regret_memory_blocks
GROUPS = 17  # 16 groups a medium, and the 17th and later counted together
ENC = msgspec.msgpack.Encoder()


def batch(ts: float, events: Sequence[dict[str, Any]]) -> bytes:
    return we.encode_batch(we.Layout.V0_33, ts, events, 0, ENC)


def fill(counts: StreamCounts, medium: str, group: int, first: int, n: int, ts: float = 1.0) -> None:
    """``2n`` blocks stored in one group, the first ``n`` of them removed: a group whose store
    and removal memories each get more than ``n`` entries offered."""
    hashes = list(range(first, first + 2 * n))
    counts.ingest(
        batch(
            ts,
            [
                we.stored(hashes, [], medium=medium, block_size=16, group_idx=group),
                we.removed(hashes[:n], medium=medium, group_idx=group),
            ],
        )
    )


def groups_of(counts: StreamCounts) -> Iterator[MediumBlocks]:
    for m in counts.media.values():
        yield from m.groups.values()


def tracked(counts: StreamCounts) -> int:
    """Hashes the stream's memories hold (its ``tracked_blocks``)."""
    return sum(m.remembered for m in counts.media.values())


def forgotten(counts: StreamCounts) -> int:
    return sum(g.totals().stores_forgotten + g.totals().removals_forgotten for g in groups_of(counts))


def assert_honest(counts: StreamCounts) -> None:
    """Every block stored is held, was removed, or is counted forgotten; every removal is
    remembered or counted forgotten (no hash is stored twice here, none comes back)."""
    for g in groups_of(counts):
        t = g.totals()
        assert t.stored == t.resident + (t.removed - g.unheld) + t.stores_forgotten
        assert t.removed == (g.remembered - t.resident) + t.removals_forgotten


def test_a_publisher_naming_every_medium_and_group_cannot_multiply_its_memory() -> None:
    counts = StreamCounts((S, R), 5.0)
    media = ["GPU", *(f"tier{i}" for i in range(MAX_MEDIA + 2))]  # past the cap: "other"
    first = 1 << 40
    for medium in media:
        fill(counts, medium, 0, first, S + R)  # its reference group, both memories filled
        for g in range(1, GROUPS):
            fill(counts, medium, g, first + 2 * (S + R) + 2 * g, 1)  # and every other group it can name
        first += 4 * (S + R)
    assert len(counts.media) == MAX_MEDIA + 1
    # groups past the stream's cap count as their medium's "other" group
    assert sum(len(m.groups) for m in counts.media.values()) <= MAX_STREAM_GROUPS + MAX_MEDIA + 1
    assert tracked(counts) <= 3 * 2 * (S + R)
    assert sum(sum(g.bounds) for g in groups_of(counts)) <= 3 * 2 * (S + R)
    # the pool's and its first lower tier's reference groups keep the configured bounds
    assert counts.media["GPU"].groups[0].bounds == counts.media["tier0"].groups[0].bounds == (S, R)
    assert_honest(counts)


def test_streams_share_the_node_budget_and_a_shrink_is_counted() -> None:
    budget = MemoryBudget(3 * cost(S, R) // 2)  # one and a half stream's worth
    entries = 3 * (S + R) // 2  # as many entries (both memories scale alike)
    a = StreamCounts((S, R), 5.0, budget=budget)
    fill(a, "GPU", 0, 1 << 40, S + R)
    ref = a.media["GPU"].groups[0]
    assert ref.bounds == (S, R) and ref.remembered > S  # alone: its whole bound, filled
    kept, before = forgotten(a), tracked(a)
    b = StreamCounts((S, R), 5.0, budget=budget)
    fill(b, "GPU", 0, 1 << 41, 8)  # b joins, holding little: a keeps its bounds and all it holds
    assert ref.bounds == (S, R) and forgotten(a) == kept
    fill(b, "GPU", 0, 1 << 42, S + R)  # b fills: a's memories shrink to an equal share at once
    held = [tracked(c) for c in (a, b)]
    assert sum(held) <= entries, held
    assert held[0] <= entries // 2 and sum(ref.bounds) <= entries // 2
    assert forgotten(a) - kept == before - held[0]  # every entry the shrink dropped counted
    assert_honest(a)
    assert_honest(b)
    b.close()  # gone: its part back to a
    fill(a, "GPU", 0, 1 << 43, S + R, ts=2.0)
    assert ref.bounds == (S, R) and ref.remembered > entries // 2
    assert_honest(a)


def test_the_memory_keys_are_bounded() -> None:
    """A bound past what any node could hold is a mistake said at start-up, not an out-of-memory."""
    for key in ("max_tracked_blocks", "regret_memory_seconds", "regret_memory_rate", "kv_memory_bytes"):
        with pytest.raises(ConfigError, match=key):
            parse(EnginesConfig, {key: 10**14})
    assert EnginesConfig().kv_memory_bytes == DEFAULT_BYTES


def test_the_pool_and_its_lower_tier_keep_their_bounds_first() -> None:
    """The split of a stream's part: GPU and its first lower tier (primary) whole while the part
    allows, the further media one medium's bounds between them, scaled to what is left."""
    one, grouped = (True, False), (True, True)
    extra = (False, False)
    shape = [grouped, one, extra, extra]
    assert wanted((S, R), shape) == 4 * cost(S, R)
    assert split(10 * cost(S, R), (S, R), shape) == [(S, R), (S, R), (S // 2, R // 2), (S // 2, R // 2)]
    tight = split(3 * cost(S, R) + cost(S, R) // 2, (S, R), shape)
    assert tight[:2] == [(S, R), (S, R)] and tight[2] == tight[3] == (S // 4, R // 4)  # half of what they want
    scarce = split(cost(S, R), (S, R), [grouped, one, extra])
    assert scarce == [(S // 3, R // 3), (S // 3, R // 3), (1, 1)]  # the primary media scaled, the rest at 1
    assert split(cost(S, R), (S, 0), [one]) == [(S, 0)]  # a memory turned off stays off
    assert primaries({"CPU": 0, "GPU": 0, "disk": 0, "other": 0}) == [True, True, False, False]


def test_the_budget_is_split_max_min_fair() -> None:
    assert fair(100, [10, 80, 80]) == [10, 45, 45]
    assert fair(100, [10, 20]) == [10, 20]
    assert fair(10, [0, 100, 100]) == [0, 5, 5]
