"""Property-based: a bad input never stops a good one from counting, and every bad input is
counted by reason.

Good batches are vLLM's, in each release's layout (``daemon/lab/wire_encode.py``), each on
blocks of its own; bad ones are made from them with a known reason (a timestamp, a block size,
a hash past its cap, nesting past the decoder, a truncation, garbage), or are any bytes at all.
A stream of both is counted beside the same stream without the bad ones: the counts must be the
same, and the decode errors exactly the bad ones' reasons (strategies: ``tests/support/kv_fuzz.py``;
the hub's own message path, frames and sequence numbers too: ``tests/integration/test_kv_events_fuzz.py``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwatch.daemon.engines.stream_counts import StreamCounts
from kvwatch.daemon.lab import wire_encode as we
from tests.support.kv_fuzz import Slot, streams

BATCH_KINDS = frozenset({"payload", "nesting", "timestamp", "block_size", "size"})  # the whole batch dropped
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def counts() -> StreamCounts:
    return StreamCounts((4096, 4096), 5.0)


def reading(c: StreamCounts) -> dict[str, Any]:
    """Everything a stream's counts export."""
    return {
        "batches": c.batches,
        "events": c.events,
        "cleared": c.cleared,
        "last_ts": c.last_ts,
        "media": {k: m.logical() for k, m in c.media.items()},
        "groups": [g for k, m in c.media.items() for g in m.totals(k)],
        "extras": dict(c.extras),
        "tenants": c.tenants(),
    }


@FUZZ
@given(streams())
def test_fuzz_a_bad_batch_never_stops_a_good_one(slots: list[Slot]) -> None:
    mixed, clean = counts(), counts()
    for s in slots:
        mixed.ingest(s.payload)
        if s.kind is None:
            clean.ingest(s.payload)
    assert mixed.errors == Counter(s.kind for s in slots if s.kind is not None)
    assert reading(mixed) == reading(clean)
    assert clean.errors == {}


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=70),
    lambda kids: st.lists(kids, max_size=6) | st.dictionaries(st.text(max_size=12), kids, max_size=6),
    max_leaves=40,
)
event_like = st.fixed_dictionaries(
    {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockMoved"])},
    optional={
        "block_hashes": msgpack_values,
        "parent_block_hash": msgpack_values,
        "block_size": msgpack_values,
        "medium": msgpack_values,
        "extra_keys": msgpack_values,
        "lora_name": msgpack_values,
        "group_idx": msgpack_values,
    },
)
anything = st.one_of(
    st.binary(max_size=300),
    msgpack_values.map(msgspec.msgpack.encode),
    st.tuples(st.floats(), st.lists(event_like, max_size=4), msgpack_values).map(
        lambda t: msgspec.msgpack.encode(list(t))
    ),
)


def batch_level(c: StreamCounts) -> int:
    return c.batches + sum(n for k, n in c.errors.items() if k in BATCH_KINDS)


@FUZZ
@given(st.lists(anything, min_size=1, max_size=8), st.data())
def test_fuzz_any_input_is_a_batch_or_one_reason_and_the_next_good_one_counts(
    inputs: list[bytes], data: st.DataObject
) -> None:
    c = counts()
    for i, x in enumerate(inputs):
        before = batch_level(c)
        c.ingest(x)
        assert batch_level(c) == before + 1  # counted as a batch, or as exactly one reason
        assert set(c.errors) <= BATCH_KINDS | {"event", "field"}
        good = we.encode_batch(we.Layout.V0_33, 1.0, [we.stored([10_000 + i], list(range(16)))], 0)
        batches = c.batches
        c.ingest(good)
        assert c.batches == batches + 1
