"""Strategies for the KV event fuzz suites (``tests/unit/test_wire_fuzz.py``,
``tests/integration/test_kv_events_fuzz.py``): good batches in each vLLM release's layout, each on
blocks of its own, and bad ones made from them for a known reason."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec
from hypothesis import strategies as st

from kvwatch.daemon.lab import wire_encode as we

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
