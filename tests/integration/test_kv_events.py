"""The KV event subscriber (``engines/kv_events.py``) on real ZMQ sockets: vLLM's captured frames
sent as they were, the idle hub, gaps replayed or lost, a publisher restarting, bad messages.

Each wait ends on what the hub has counted; where a test must also show that nothing more
arrives (nothing counted twice), it sends one more batch after the rest and waits for that one:
the hub takes a stream's batches in order."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvwatch.daemon.engines.kv_events import KVEventHub
from kvwatch.daemon.lab import wire_encode as we
from kvwatch.daemon.lab.vllm_publisher import WirePublisher
from kvwatch.daemon.model.engines import StreamSpec, StreamStats
from tests.support.daemon import free_port, wait_until
from tests.support.kv_scripts import CAPTURES, frames, load

MARKER_HASH = 0x4D41524B  # a block no script stores: the batch that ends a wait


@pytest.fixture
def hub() -> Iterator[KVEventHub]:
    """A KV event hub running in its thread (thrash_seconds 5)."""
    h = KVEventHub(thrash_seconds=5.0, replay_timeout_seconds=1.0)
    h.start()
    try:
        yield h
    finally:
        h.close()


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
        time.sleep(1.0)  # a span of idleness; a slow machine only makes fewer calls
        assert calls <= 3, calls  # one-second waits when idle
        spec = StreamSpec(f"tcp://127.0.0.1:{free_port()}")
        h.set_streams([spec])
        wait_until(lambda: spec in h.stats(), 5, "stream set up", interval=0.01)
    finally:
        h.close()


def stored_events(n: int, first: int = 0) -> list[list[dict[str, Any]]]:
    return [[we.stored([first + i], list(range(16)))] for i in range(n)]


def through_marker(hub: KVEventHub, spec: StreamSpec, publish: Any) -> StreamStats:
    """Publish one marker batch (the removal of a block never stored: one batch, one removal,
    nothing stored) and wait until the hub has counted it and settled every batch it missed
    (replayed or lost: the replay's answer may come after the live marker): every batch published
    before the marker has then been counted, replays included."""

    def removed() -> int:
        gpu = stats_of(hub, spec).media.get("GPU")
        return gpu.removed if gpu is not None else 0

    def settled() -> bool:
        s = stats_of(hub, spec)
        return s.replayed + s.lost == s.missed

    before = removed()
    publish([[we.removed([MARKER_HASH])]])
    wait_until(lambda: removed() == before + 1 and settled(), 30, "the marker batch and every missed batch settled")
    return stats_of(hub, spec)


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
    # the replayed batches and the live ones queued behind the gap are handled one after another,
    # then the marker: each counted once
    s = through_marker(hub, spec, publish)
    assert (s.gaps, s.missed, s.replayed, s.lost, s.replay_requests) == (1, 3, 3, 0, 1)
    assert s.media["GPU"].stored == 12 and s.batches == 12 + 1  # and the marker

    pub.forget(2)  # gone for good: the replay cannot serve them
    publish(stored_events(4, 200))
    s = through_marker(hub, spec, publish)
    assert (s.gaps, s.missed, s.replayed, s.lost) == (2, 5, 3, 2)
    assert s.media["GPU"].stored == 14  # 12 + the 2 that arrived

    pub.close()  # the engine restarts: a new publisher, sequence from 0 again
    pub = WirePublisher(f"tcp://*:{port}", f"tcp://*:{rport}")
    try:
        assert pub.wait_subscribed(timeout=30), "the SUB did not reconnect"  # ZMQ reconnects it by itself
        publish(stored_events(23, 300))
        s = through_marker(hub, spec, publish)
        assert (s.restarts, s.gaps) == (1, 2)  # a restart is not a gap
        assert s.media["GPU"].stored == 14 + 23  # none twice
    finally:
        pub.close()


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
