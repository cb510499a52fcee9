"""vLLM's KV event wire format and the subscriber, against bytes vLLM's own publisher produced.

``tests/fixtures/kv_events/vllm-*.json`` were captured off the wire from the real
``ZmqEventPublisher`` of vLLM 0.9.2, 0.11.0 and 0.33.0 (``tests/tools/vllm_capture.py``).
"""

from __future__ import annotations

import contextlib
import json
import struct
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvwatch.daemon.engines import wire as w
from kvwatch.daemon.engines.kv_events import KVEventHub
from kvwatch.daemon.engines.views import MediumTotals, StreamSpec, StreamStats
from kvwatch.daemon.lab import wire_encode as we
from kvwatch.daemon.lab.vllm_publisher import WirePublisher

from tests.privileged.helpers import free_port, wait_until

FIXTURES = Path(__file__).parent.parent / "fixtures" / "kv_events"
CAPTURES = sorted(FIXTURES.glob("vllm-*.json"))
LAYOUT = {"0.9.2": we.Layout.V0_9, "0.11.0": we.Layout.V0_11, "0.26.0": we.Layout.V0_26, "0.33.0": we.Layout.V0_33}


def load(path: Path) -> dict[str, Any]:
    d: dict[str, Any] = json.loads(path.read_text())
    return d


def unjson(x: Any) -> Any:
    if isinstance(x, dict) and set(x) == {"bytes"}:
        return bytes.fromhex(x["bytes"])
    if isinstance(x, list):
        return [unjson(v) for v in x]
    if isinstance(x, dict):
        return {k: unjson(v) for k, v in x.items()}
    return x


def frames(capture: dict[str, Any], key: str = "frames") -> list[list[bytes]]:
    return [[bytes.fromhex(f) for f in msg] for msg in capture[key]]


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


# --- the subscriber over real ZMQ sockets (the hub fixture: tests/unit/conftest.py) ----------------
def stats_of(hub: KVEventHub, spec: StreamSpec) -> StreamStats:
    return hub.stats()[spec]


def connected(hub: KVEventHub, spec: StreamSpec, pub: WirePublisher | zmq.Socket[bytes]) -> None:
    """The hub is connected and its subscription has reached the publisher (an XPUB socket):
    from here on it receives every batch sent."""
    wait_until(lambda: spec in hub.stats() and stats_of(hub, spec).connected, 10, "subscriber connected")
    if isinstance(pub, WirePublisher):
        assert pub.wait_subscribed(), "no subscription reached the publisher"
    else:
        assert pub.poll(10_000) and pub.recv()[:1] == b"\x01", "no subscription reached the publisher"


@contextlib.contextmanager
def one_stream(hub: KVEventHub) -> Iterator[tuple[StreamSpec, WirePublisher]]:
    """A publisher on a free port and the hub subscribed to it, its subscription landed."""
    port = free_port()
    spec = StreamSpec(f"tcp://127.0.0.1:{port}")
    pub = WirePublisher(f"tcp://*:{port}")
    try:
        hub.set_streams([spec])
        connected(hub, spec, pub)
        yield spec, pub
    finally:
        pub.close()


def publish_script(hub: KVEventHub, script: list[tuple[float, list[dict[str, Any]]]]) -> Mapping[str, MediumTotals]:
    """Every (engine ts, events) batch of a script through a fresh stream; its media once all counted."""
    return script_stats(hub, script).media


def script_stats(hub: KVEventHub, script: list[tuple[float, list[dict[str, Any]]]]) -> StreamStats:
    """Every (engine ts, events) batch of a script through a fresh stream; its stats once all counted."""
    with one_stream(hub) as (spec, pub):
        for ts, events in script:
            pub.publish(events, ts=ts)
        assert pub.flush()
        wait_until(lambda: stats_of(hub, spec).batches == len(script), 10, "every batch")
        return stats_of(hub, spec)


def xpub(ctx: zmq.Context[zmq.Socket[bytes]], port: int) -> zmq.Socket[bytes]:
    """A PUB socket that also hands up subscriptions (read by ``connected``)."""
    sock = ctx.socket(zmq.XPUB)
    sock.bind(f"tcp://127.0.0.1:{port}")
    return sock


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.stem)
def test_subscriber_counts_vllm_frames(hub: KVEventHub, path: Path) -> None:
    """vLLM's own frames, sent as they were captured, counted per medium."""
    cap = load(path)
    port = free_port()
    ctx = zmq.Context()
    pub = xpub(ctx, port)
    spec = StreamSpec(f"tcp://127.0.0.1:{port}", topic=cap["topic"])
    try:
        hub.set_streams([spec])
        connected(hub, spec, pub)
        for m in frames(cap):
            pub.send_multipart(m)
        wait_until(lambda: stats_of(hub, spec).batches == cap["expected"]["batches"], 10, "all batches")
        s = stats_of(hub, spec)
        assert {k: v.stored for k, v in s.media.items() if v.stored} == cap["expected"]["stored"]
        assert {k: v.removed for k, v in s.media.items() if v.removed} == cap["expected"]["removed"]
        assert s.cleared == cap["expected"]["cleared"]
        assert (s.gaps, s.lost, dict(s.decode_errors)) == (0, 0, {})
    finally:
        pub.close(0)
        ctx.term()


def test_idle_hub_sleeps_then_takes_new_streams() -> None:
    """With no stream (most nodes most of the time) the hub thread must block, not spin:
    a poll with nothing registered returns at once, and a spinning thread holding the GIL
    slowed every daemon tick tenfold."""
    h = KVEventHub(thrash_seconds=5.0, replay_timeout_seconds=1.0)
    calls = 0
    run_once = h.run_once

    def counting(timeout_ms: int) -> None:
        nonlocal calls
        calls += 1
        run_once(timeout_ms)

    h.run_once = counting  # type: ignore[method-assign]
    h.start()
    try:
        time.sleep(1.0)
        assert calls <= 3, calls  # one-second waits when idle
        spec = StreamSpec(f"tcp://127.0.0.1:{free_port()}")
        h.set_streams([spec])
        wait_until(lambda: spec in h.stats(), 5, "stream set up", interval=0.01)
    finally:
        h.close()


def stored_events(n: int, first: int = 0) -> list[list[dict[str, Any]]]:
    return [[we.stored([first + i], list(range(16)))] for i in range(n)]


def test_gap_replayed_then_lost_then_publisher_restart(hub: KVEventHub) -> None:
    port, rport = free_port(), free_port()
    spec = StreamSpec(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}")
    pub = WirePublisher(f"tcp://*:{port}", f"tcp://*:{rport}")
    hub.set_streams([spec])
    connected(hub, spec, pub)

    def publish(batches: list[list[dict[str, Any]]]) -> None:
        for b in batches:
            pub.publish(b)
        assert pub.flush()

    publish(stored_events(7))
    pub.lose(3)  # three batches miss the wire but stay in the replay buffer
    publish(stored_events(5, 100))
    # the replayed batches and the live ones queued behind the gap are handled one after another:
    # wait for the last of them, then check nothing more arrives (none counted twice)
    wait_until(
        lambda: stats_of(hub, spec).batches >= 12 and stats_of(hub, spec).replayed >= 3,
        10,
        "replay and the live batches after it",
    )
    time.sleep(0.3)
    s = stats_of(hub, spec)
    assert (s.gaps, s.missed, s.replayed, s.lost, s.replay_requests) == (1, 3, 3, 0, 1)
    assert s.media["GPU"].stored == 12 and s.batches == 12

    pub.forget(2)  # gone for good: the replay cannot serve them
    publish(stored_events(4, 200))
    wait_until(
        lambda: stats_of(hub, spec).media["GPU"].stored >= 14 and stats_of(hub, spec).lost >= 2,
        10,
        "loss counted, the rest stored",
    )
    time.sleep(0.3)
    s = stats_of(hub, spec)
    assert (s.gaps, s.missed, s.replayed, s.lost) == (2, 5, 3, 2)
    assert s.media["GPU"].stored == 14  # 12 + the 2 that arrived

    pub.close()  # the engine restarts: a new publisher, sequence from 0 again
    pub = WirePublisher(f"tcp://*:{port}", f"tcp://*:{rport}")
    try:
        assert pub.wait_subscribed(timeout=30), "the SUB did not reconnect"  # ZMQ reconnects it by itself
        publish(stored_events(23, 300))
        wait_until(lambda: stats_of(hub, spec).media["GPU"].stored >= 14 + 23, 15, "counting after restart")
        time.sleep(0.3)
        s = stats_of(hub, spec)
        assert (s.restarts, s.gaps) == (1, 2)  # a restart is not a gap
        assert s.media["GPU"].stored == 14 + 23  # none twice
    finally:
        pub.close()


def test_young_removals_from_engine_timestamps(hub: KVEventHub) -> None:
    with one_stream(hub) as (spec, pub):
        t0 = 1_000_000.0
        pub.publish([we.stored(list(range(10)), list(range(160)))], ts=t0)
        pub.publish([we.removed([0, 1, 2])], ts=t0 + 1.0)  # 1 s old: young (thrash_seconds 5)
        pub.publish([we.removed([3, 4])], ts=t0 + 60.0)  # a minute old: not young
        pub.publish([we.removed([999])], ts=t0 + 61.0)  # never seen stored: not young
        pub.publish([we.cleared()], ts=t0 + 62.0)
        pub.publish([we.removed([5])], ts=t0 + 62.5)  # the reset forgot its store time
        assert pub.flush()
        wait_until(lambda: stats_of(hub, spec).batches == 6, 10, "batches")
        m = stats_of(hub, spec).media["GPU"]
        assert (m.stored, m.removed, m.removed_young) == (10, 7, 3)
        assert stats_of(hub, spec).cleared == 1


def test_every_bad_message_counted_and_the_stream_goes_on(hub: KVEventHub) -> None:
    port = free_port()
    ctx = zmq.Context()
    raw = xpub(ctx, port)
    spec = StreamSpec(f"tcp://127.0.0.1:{port}")
    good = we.encode_batch(we.Layout.V0_33, 1.0, [we.removed([1, 2])])
    unknown = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockMoved", "x": 1}, {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}], 0]
    )
    seq = iter(range(1000))

    def s() -> bytes:
        return next(seq).to_bytes(8, "big")

    try:
        hub.set_streams([spec])
        connected(hub, spec, raw)
        raw.send_multipart([b"", s(), good])
        raw.send_multipart([b"", b"\x00" * 8])  # two frames
        raw.send_multipart([b"", b"\x00\x01", good])  # a 2-byte sequence
        raw.send_multipart([b"", s(), b"\xc1"])  # not msgpack
        raw.send_multipart([b"", s(), good[:-5]])  # truncated
        raw.send_multipart([b"", s(), msgspec.msgpack.encode({"ts": "x"})])  # wrong shape
        raw.send_multipart([b"", s(), unknown])  # one unknown event beside a good one
        raw.send_multipart([b"", s(), good])
        wait_until(
            lambda: stats_of(hub, spec).media.get("GPU") is not None and stats_of(hub, spec).media["GPU"].removed == 5,
            10,
            "good ones",
        )
        st_ = stats_of(hub, spec)
        assert dict(st_.decode_errors) == {"frames": 1, "sequence": 1, "payload": 3, "event": 1}
        assert st_.batches == 3 and st_.gaps == 0
    finally:
        raw.close(0)
        ctx.term()


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
    cap = json.loads((Path(__file__).parent.parent / "fixtures" / "vllm_run" / "raw_frames.json").read_text())
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
