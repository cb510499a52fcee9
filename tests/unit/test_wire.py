"""vLLM's KV event wire format (``engines/wire.py``, and the encoder the lab's publishers use),
against bytes vLLM's own publisher produced: the frames, the decoder, and the decoder fuzzed.

``tests/fixtures/kv_events/vllm-*.json`` were captured off the wire from the real
``ZmqEventPublisher`` of vLLM 0.9.2, 0.11.0, 0.26.0 and 0.33.0 (``tests/tools/vllm_capture.py``).
Counting a stream's batches: ``test_blocks.py``, ``test_stream_counts_hostile.py``; the subscriber on its sockets:
``tests/integration/test_kv_events.py``.
"""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwatch.daemon.engines import wire as w
from kvwatch.daemon.lab import wire_encode as we
from tests.support.kv_scripts import CAPTURES, FIXTURES, LAYOUT, frames, load, unjson


def test_four_releases_captured() -> None:
    assert [load(p)["vllm_version"] for p in CAPTURES] == ["0.11.0", "0.26.0", "0.33.0", "0.9.2"]


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.stem)
def test_encoder_matches_vllm_byte_for_byte(path: Path) -> None:
    """Our test publisher's payloads are the bytes vLLM's encoder produced for the same batches."""
    cap = load(path)
    layout = LAYOUT[cap["vllm_version"]]
    for batch, msg in zip(cap["batches"], frames(cap), strict=True):
        assert msg[0] == cap["topic"].encode()
        mine = we.encode_batch(layout, batch["ts"], unjson(batch["events"]), cap["data_parallel_rank"])
        assert mine == msg[2]


def test_hand_decoded_bytes() -> None:
    """Independent of any struct definition: the AllBlocksCleared batch, read with the msgpack spec."""
    ts = struct.pack(">d", 1764400001.75)
    tag = b"\xb0AllBlocksCleared"  # fixstr of 16 bytes
    for path in CAPTURES:
        cap = load(path)
        payload = frames(cap)[3][2]  # the fourth scripted batch is the reset
        rank = b"\x01"  # positive fixint 1: the publisher's data-parallel rank
        if cap["vllm_version"] in ("0.26.0", "0.33.0"):  # event as a map {"type": tag}
            expected = b"\x93\xcb" + ts + b"\x91\x81\xa4type" + tag + rank
        else:  # event as an array [tag]
            expected = b"\x93\xcb" + ts + b"\x91\x91" + tag + rank
        assert payload == expected, cap["vllm_version"]


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.stem)
def test_replay_frames_from_vllm(path: Path) -> None:
    cap = load(path)
    replies = frames(cap, "replay_frames")
    seqs = [w.parse_replay(m)[0] for m in replies]
    n = len(cap["frames"])
    assert seqs == [*range(cap["replay_start"], n), -1]
    live = {w.parse_frames(m)[1]: m[2] for m in frames(cap)}
    for m in replies[:-1]:
        seq, payload = w.parse_replay(m)
        assert payload == live[seq]
    assert w.parse_replay(replies[-1])[1] == b""
    topic = cap["vllm_version"] in ("0.26.0", "0.33.0")  # these add the topic frame
    assert len(replies[0]) == (4 if topic else 3)


def count(batches: list[w.Batch]) -> dict[str, Any]:
    stored: dict[str, int] = {}
    removed: dict[str, int] = {}
    cleared = 0
    for b in batches:
        for ev in b.events:
            medium = getattr(ev, "medium", None) or "GPU"
            if isinstance(ev, w.STORED):
                stored[medium] = stored.get(medium, 0) + len(ev.block_hashes)
            elif isinstance(ev, w.REMOVED):
                removed[medium] = removed.get(medium, 0) + len(ev.block_hashes)
            else:
                cleared += 1
    return {"stored": stored, "removed": removed, "cleared": cleared, "batches": len(batches)}


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.stem)
def test_decoder_counts_what_vllm_sent(path: Path) -> None:
    cap = load(path)
    dec = w.Decoder()
    batches = [dec.decode(m[2]) for m in frames(cap)]
    assert count(batches) == cap["expected"]
    assert all(b.skipped == 0 and b.data_parallel_rank == cap["data_parallel_rank"] for b in batches)
    big = batches[0].events[0]
    assert isinstance(big, w.STORED) and big.block_hashes == [0xDEADBEEF12345678, 0xFFFFFFFFFFFFFFFF]


# --- fuzzing the decoder ----------------------------------------------------------------------------
VALID = [m[2] for p in CAPTURES for m in frames(load(p))]

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda kids: st.lists(kids, max_size=6) | st.dictionaries(st.text(max_size=12), kids, max_size=6),
    max_leaves=40,
)


def survives(payload: bytes) -> w.Batch | None:
    try:
        return w.Decoder().decode(payload)
    except w.WireError:
        return None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_fuzz_garbage(data: bytes) -> None:
    survives(data)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(VALID), st.data())
def test_fuzz_truncated_and_flipped(payload: bytes, data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(payload) - 1))
    assert survives(payload[:cut]) is None  # a proper prefix never decodes
    i = data.draw(st.integers(0, len(payload) - 1))
    flipped = payload[:i] + bytes([payload[i] ^ data.draw(st.integers(1, 255))]) + payload[i + 1 :]
    survives(flipped)


@settings(max_examples=400, deadline=None)
@given(msgpack_values)
def test_fuzz_structured(value: Any) -> None:
    survives(msgspec.msgpack.encode(value))


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=30), st.lists(st.integers(0, 2**64 - 1), max_size=5), st.booleans())
def test_fuzz_unknown_tags_keep_the_rest(tag: str, hashes: list[int], as_map: bool) -> None:
    known = (
        {"type": "BlockRemoved", "block_hashes": hashes, "medium": "CPU"} if as_map else ["BlockRemoved", hashes, "CPU"]
    )
    other = {"type": tag, "block_hashes": hashes} if as_map else [tag, hashes]
    b = survives(msgspec.msgpack.encode([2.5, [other, known], 3]))
    assert b is not None
    names = {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    if tag not in names:
        assert b.skipped == 1 and len(b.events) == 1
    assert any(isinstance(e, w.REMOVED) and e.block_hashes == hashes for e in b.events)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=12), max_size=5))
def test_fuzz_frames(parts: list[bytes]) -> None:
    for parse in (w.parse_frames, w.parse_replay):
        with contextlib.suppress(w.WireError):
            parse(parts)


def test_real_vllm_026_frames() -> None:
    """Frames as vLLM 0.26.0's publisher sent them on the H200 (GPU pool and OffloadingConnector
    placeholders on medium CPU, a prefix-cache reset), each with the counts vLLM's own classes
    decoded from it (tests/gpu/vllm_subscriber.py): kvwatch's decoder counts the same."""
    cap = json.loads((FIXTURES / "vllm_run" / "raw_frames.json").read_text())
    dec = w.Decoder()
    media: set[str] = set()
    for f in cap["frames"]:
        _topic, seq, payload = w.parse_frames([bytes.fromhex(x) for x in f["frames"]])
        batch = dec.decode(payload)
        assert seq == f["seq"] and batch.skipped == 0
        got = count([batch])
        want = f["expected"]
        assert (got["stored"], got["removed"], got["cleared"]) == (want["stored"], want["removed"], want["cleared"])
        assert len(batch.events) == want["events"]
        media |= set(got["stored"]) | set(got["removed"])
    assert media == {"GPU", "CPU"} and sum(f["expected"]["cleared"] for f in cap["frames"]) >= 1
