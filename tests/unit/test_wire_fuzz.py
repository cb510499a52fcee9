"""Property-based: a bad input never stops a good one from counting, and every bad input is
counted by reason.

Good batches are vLLM's, in each release's layout (``daemon/lab/wire_encode.py``), each on
blocks of its own; bad ones are made from them with a known reason (a timestamp, a block size,
a hash past its cap, nesting past the decoder, a truncation, garbage), or are any bytes at all.
A stream of both is counted beside the same stream without the bad ones: the counts must be the
same, and the decode errors exactly the bad ones' reasons. The last property drives the hub's
own message path (frames, sequence, decoding) the same way.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvwatch.daemon.engines.kv_events import KVEventHub
from kvwatch.daemon.engines.stream_counts import StreamCounts
from kvwatch.daemon.engines.views import StreamSpec
from kvwatch.daemon.lab import wire_encode as we

BATCH_KINDS = frozenset({"payload", "nesting", "timestamp", "block_size", "size"})  # the whole batch dropped
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAP_LAYOUTS = (we.Layout.V0_26, we.Layout.V0_33)


@dataclass(frozen=True)
class Slot:
    payload: bytes
    kind: str | None  # None: a good batch


@st.composite
def good_events(draw: st.DrawFn, base: int, layout: we.Layout) -> list[dict[str, Any]]:
    """Stores (first blocks, continuations, salted, LoRA, on GPU or CPU, in one of two groups),
    removals of some of them, now and then a reset: all on hashes base*100 + i."""
    events: list[dict[str, Any]] = []
    stored: list[int] = []
    for j in range(draw(st.integers(1, 4))):
        hashes = [base * 100 + j * 10 + k for k in range(draw(st.integers(1, 3)))]
        what = draw(st.sampled_from(["first", "after", "salted", "lora", "cpu", "remove", "cleared"]))
        more: dict[str, Any] = {}
        if layout in MAP_LAYOUTS:
            g = draw(st.integers(0, 1))
            more = {"group_idx": g, "kv_cache_spec_kind": "full_attention" if g == 0 else "sliding_window"}
            if what == "salted":
                more["extra_keys"] = [[f"salt-{base % 3}"]] + [None] * (len(hashes) - 1)
            elif what == "lora":
                more |= {"lora_name": "adapter", "extra_keys": [["adapter"]] * len(hashes)}
        if what == "remove" and stored:
            events.append(we.removed(stored[: len(hashes)], **{k: v for k, v in more.items() if k == "group_idx"}))
        elif what == "cleared":
            events.append(we.cleared())
        else:
            parent = stored[-1] if what == "after" and stored else None
            medium = "CPU" if what == "cpu" else "GPU"
            events.append(we.stored(hashes, list(range(16 * len(hashes))), medium=medium, parent=parent, **more))
            stored += hashes
    return events


def nested(depth: int) -> msgspec.Raw:
    return msgspec.Raw(b"\x91" * depth + b"\xc0")


Events = list[dict[str, Any]]


def _timestamp(draw: st.DrawFn, layout: we.Layout, ts: float, events: Events, base: int) -> bytes:
    bad_ts = draw(st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 2.0**33]))
    return we.encode_batch(layout, bad_ts, events, 0)


def _block_size(draw: st.DrawFn, layout: we.Layout, ts: float, events: Events, base: int) -> bytes:
    size = draw(st.sampled_from([-1, -(2**63), (1 << 24) + 1, 2**63 - 1]))
    return we.encode_batch(layout, ts, [*events, we.stored([base * 100 + 99], [], block_size=size)], 0)


def _size(draw: st.DrawFn, layout: we.Layout, ts: float, events: Events, base: int) -> bytes:
    """A hash longer than any engine's (vLLM's are 64-bit ints or 32-byte digests)."""
    return we.encode_batch(layout, ts, [*events, we.removed([bytes(draw(st.integers(65, 300)))])], 0)


def _nesting(draw: st.DrawFn, layout: we.Layout, ts: float, events: Events, base: int) -> bytes:
    depth = draw(st.integers(50_000, 200_000))  # past any recursion limit (hypothesis raises it to ~2,000)
    if layout in MAP_LAYOUTS and draw(st.booleans()):
        deep = we.stored([base * 100 + 98], [], extra_keys=[nested(depth)])
        return we.encode_batch(layout, ts, [*events, deep], 0)
    return msgspec.msgpack.encode([ts, [nested(depth)], 0])


def _payload(draw: st.DrawFn, layout: we.Layout, ts: float, events: Events, base: int) -> bytes:
    good = we.encode_batch(layout, ts, events, 0)
    if draw(st.booleans()):
        return good[: draw(st.integers(0, len(good) - 1))]  # a proper prefix
    return draw(st.sampled_from([b"\xc1", b"\x00", b"\xa3abc"])) + good


BAD = {"timestamp": _timestamp, "block_size": _block_size, "size": _size, "nesting": _nesting, "payload": _payload}


@st.composite
def slot(draw: st.DrawFn, base: int) -> Slot:
    """A good batch, or one made bad from it for a known reason."""
    layout = draw(st.sampled_from(list(we.Layout)))
    events = draw(good_events(base, layout))
    ts = draw(st.floats(0.0, 1e6))
    kind = draw(st.sampled_from([None, None, *BAD]))
    if kind is None:
        return Slot(we.encode_batch(layout, ts, events, 0), None)
    return Slot(BAD[kind](draw, layout, ts, events, base), kind)


@st.composite
def streams(draw: st.DrawFn) -> list[Slot]:
    return [draw(slot(i + 1)) for i in range(draw(st.integers(1, 10)))]


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


# --- the hub's message path: frames, sequence numbers, decoding ------------------------------------


@st.composite
def messages(draw: st.DrawFn) -> tuple[list[list[bytes]], Counter[str], int]:
    """Good messages numbered in order, bad ones between them: (frames, reasons, good count)."""
    out: list[list[bytes]] = []
    reasons: Counter[str] = Counter()
    good = 0
    for seq, s in enumerate(draw(streams())):
        bad = draw(st.sampled_from([None, None, "frames", "sequence"]))
        if bad == "frames":
            out.append(draw(st.lists(st.binary(max_size=10), max_size=5).filter(lambda f: len(f) != 3)))
            reasons["frames"] += 1
        elif bad == "sequence":
            out.append([b"", bytes(draw(st.sampled_from([0, 1, 7, 9]))), s.payload])
            reasons["sequence"] += 1
        out.append([b"", seq.to_bytes(8, "big"), s.payload])  # a bad payload still takes its number
        if s.kind is None:
            good += 1
        else:
            reasons[s.kind] += 1
    return out, reasons, good


@FUZZ
@given(messages())
def test_fuzz_the_hub_counts_every_good_message_and_every_bad_one_by_reason(
    case: tuple[list[list[bytes]], Counter[str], int],
) -> None:
    frames, reasons, good = case
    hub = KVEventHub(thrash_seconds=5.0)
    spec = StreamSpec("tcp://127.0.0.1:9")  # never reached: the test hands the hub its messages
    try:
        hub.set_streams([spec])
        hub.run_once(0)
        st_ = hub._streams[spec]
        for f in frames:
            hub._take(st_, [memoryview(x) for x in f], 0.0)
        s = hub.stats()[spec]
    finally:
        hub.close()
    assert dict(s.decode_errors) == reasons
    assert s.batches == good
    assert (s.gaps, s.lost, s.restarts) == (0, 0, 0)
