"""Hostile KV event batches against one stream's accounting (``StreamCounts.ingest``, which decodes
with ``engines/wire.py``): a batch that would break decoding, corrupt a counter or cost more
memory than a real engine's batch is counted by reason and skipped, and the next batch counts.

The socket side (sequence numbers, the drain, the ZMQ queue) is in
``tests/integration/test_kv_events_hostile.py``; the property-based suite in ``test_wire_fuzz.py``.
"""

from __future__ import annotations

import math
import tracemalloc
from collections.abc import Iterable
from typing import Any

import msgspec
import pytest

from kvwatch.daemon.engines.stream_counts import StreamCounts
from kvwatch.daemon.model.engines import MediumTotals

ENC = msgspec.msgpack.Encoder()


def batch(ts: float, *events: Any) -> bytes:
    """A batch as vLLM 0.26 lays it out: an array ``[ts, events, rank]`` of map events."""
    return ENC.encode([ts, list(events), 0])


def store(hashes: Iterable[int], *, parent: Any = None, block_size: int = 16, **more: Any) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": [],
        "block_size": block_size,
        "medium": "GPU",
        **more,
    }


def remove(hashes: Iterable[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}


def counts() -> StreamCounts:
    return StreamCounts((1000, 1000), 5.0)


def gpu(c: StreamCounts) -> MediumTotals:
    m = c.media.get("GPU")
    return m.logical() if m is not None else MediumTotals()


def nested(depth: int) -> msgspec.Raw:
    """A value nested ``depth`` arrays deep: [[[...[nil]...]]]."""
    return msgspec.Raw(b"\x91" * depth + b"\xc0")


# --- item 1: a batch whose decoding would raise ----------------------------------------------------


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_extra_keys_nested_past_the_decoder_are_counted_and_the_next_batch_counts(depth: int) -> None:
    c = counts()
    c.ingest(batch(1.0, store([1])))
    c.ingest(batch(2.0, store([2], extra_keys=[nested(depth)])))
    c.ingest(batch(3.0, store([3])))
    assert c.errors == {"nesting": 1}
    assert c.batches == 2 and gpu(c).stored == 2


def test_a_parent_hash_of_invalid_utf8_after_a_salt_is_counted_not_raised() -> None:
    """Once a salt names a tenant, a store after a parent looks its parent up: a parent that is a
    string of invalid UTF-8 was decoded only then, and raised out of the accounting."""
    c = counts()
    c.ingest(batch(1.0, store([1], extra_keys=[["salt-of-a"]])))
    c.ingest(batch(2.0, store([2], parent=msgspec.Raw(b"\xa2\xff\xfe"))))
    c.ingest(batch(3.0, store([3], parent=1)))
    assert c.errors == {"field": 1}  # the parent is unreadable: its blocks count, undescribed
    assert c.batches == 3 and gpu(c).stored == 3


# --- item 4: values that decode but would corrupt counters ---------------------------------------


@pytest.mark.parametrize("ts", [math.nan, math.inf, -math.inf, -1.0], ids=["nan", "inf", "-inf", "negative"])
def test_a_timestamp_not_finite_or_negative_rejects_its_batch(ts: float) -> None:
    c = counts()
    c.ingest(batch(1.0, store([1])))
    c.ingest(batch(2.0, remove([1])))
    c.ingest(batch(ts, store([1])))  # would be a regret, at ts
    c.ingest(batch(3.0, store([2])))
    c.ingest(batch(4.0, remove([2])))
    c.ingest(batch(5.0, store([2])))  # a regret of 1 s: the histogram still sums
    assert c.errors == {"timestamp": 1}
    m = gpu(c)
    assert (m.stored, m.regretted, m.regret_seconds) == (3, 1, 1.0)
    assert c.last_ts == 5.0


@pytest.mark.parametrize("size", [-1, -(2**63), 2**62])
def test_a_block_size_negative_or_absurd_rejects_its_batch(size: int) -> None:
    c = counts()
    c.ingest(batch(1.0, store([1])))
    c.ingest(batch(2.0, remove([1])))
    c.ingest(batch(3.0, store([1], block_size=size)))  # a regret of block_size tokens
    c.ingest(batch(4.0, store([2])))
    assert c.errors == {"block_size": 1}
    m = gpu(c)
    assert (m.stored, m.regretted, m.regret_tokens) == (2, 0, 0)


def test_one_far_future_batch_does_not_pin_the_last_batch_time() -> None:
    c = counts()
    c.ingest(batch(100.0, store([1])))
    c.ingest(batch(4.0e9, store([2])))  # finite and plausible as a wall clock (year 2096)
    c.ingest(batch(101.0, store([3])))
    assert c.last_ts == 101.0


# --- item 5 (one message): a batch bigger than any engine's costs no memory for what it carries ----


def test_an_event_past_the_hash_cap_drops_its_batch_before_its_hashes_exist() -> None:
    """200,000 hashes in one event (a real one names at most one request's blocks: 65,536 for a
    1M-token context at block size 16) would be ~8 MiB of Python ints: refused at the array's
    header, counted as ``size``."""
    c = counts()
    c.ingest(batch(1.0, store([1])))
    payload = batch(2.0, store(range(1_000, 201_000)), store([2]))
    tracemalloc.start()
    try:
        c.ingest(payload)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    c.ingest(batch(3.0, store([3])))
    assert c.errors == {"size": 1}
    assert c.batches == 2 and gpu(c).stored == 2
    assert peak < 2 << 20, peak


def test_a_batch_past_the_hash_cap_is_dropped_whole() -> None:
    """1.1M hashes in events of 100,000 each: more than any engine step announces."""
    c = counts()
    c.ingest(batch(1.0, *(remove(range(i * 100_000, (i + 1) * 100_000)) for i in range(11))))
    c.ingest(batch(2.0, store([1])))
    assert c.errors == {"size": 1}
    m = gpu(c)
    assert (c.batches, m.removed, m.stored) == (1, 0, 1)


def test_a_batch_past_the_event_cap_is_dropped_whole() -> None:
    c = counts()
    c.ingest(ENC.encode([1.0, [["AllBlocksCleared"]] * 300_000, 0]))
    c.ingest(batch(2.0, store([1])))
    assert c.errors == {"size": 1}
    assert (c.batches, c.cleared, gpu(c).stored) == (1, 0, 1)
