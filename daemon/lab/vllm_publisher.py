"""A KV event publisher that speaks vLLM's wire protocol, for tests, the demo and benchmarks.

It behaves as vLLM's ``ZmqEventPublisher`` does on the wire (checked byte for byte
against frames vLLM's own publisher produced, ``tests/fixtures/kv_events``): a PUB
socket sending ``[topic, seq, payload]`` with a sequence counter starting at 0, a
buffer of the last ``buffer_steps`` payloads, and a ROUTER replay endpoint answering
``start_seq`` with every buffered batch from there and an end marker (seq -1).
The framing of replay replies follows the release being imitated (``layout``).

Test hooks: ``lose(n)`` makes the next ``n`` batches miss the PUB socket (they still
enter the replay buffer — a subscriber's lost batches), ``forget(n)`` also keeps them
out of the buffer (lost for good).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from kvwatch.daemon.engines.wire import END_SEQ, SEQ_BYTES
from kvwatch.daemon.lab.wire_encode import Layout, encode_batch


@dataclass(frozen=True, slots=True)
class _Batch:
    ts: float
    events: list[Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class _Drop:
    n: int
    forget: bool


class WirePublisher:
    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        layout: Layout = Layout.V0_33,
        topic: str = "",
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        self.layout = layout
        self.topic = topic.encode()
        self.rank = data_parallel_rank
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # XPUB sends as PUB does and also hands up each subscription, so a caller can wait
        # until a subscriber will receive what is sent next instead of guessing how long
        # the subscription takes to arrive.
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(hwm)
        self._pub.bind(_offset(endpoint, data_parallel_rank))
        self._replay: zmq.Socket[bytes] | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
            self._replay.bind(_offset(replay_endpoint, data_parallel_rank))
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[_Batch | _Drop | bytes | None] = queue.Queue()
        self._seq = 0
        self._lose = 0
        self._forget = 0
        self.sent = 0
        self._idle = threading.Event()
        self._idle.set()
        self.subscriptions = 0  # subscribe messages received (a subscriber reconnecting sends another)
        self._subscribed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="vllm-wire-publisher", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, events: Iterable[Mapping[str, Any]], ts: float | None = None) -> None:
        self._idle.clear()
        self._queue.put(_Batch(time.time() if ts is None else ts, list(events)))

    def publish_raw(self, payload: bytes) -> None:
        """Send a payload as it is (garbage tests): it still takes a sequence number."""
        self._idle.clear()
        self._queue.put(payload)

    def lose(self, n: int) -> None:
        """The next ``n`` batches published after this call (in order with publish())."""
        self._idle.clear()
        self._queue.put(_Drop(n, forget=False))

    def forget(self, n: int) -> None:
        self._idle.clear()
        self._queue.put(_Drop(n, forget=True))

    def wait_subscribed(self, count: int = 1, timeout: float = 10.0) -> bool:
        """Wait until ``count`` subscriptions in all have reached this publisher: from then on a
        subscriber receives every batch published (ZMQ drops what a PUB sends before that)."""
        with self._subscribed:
            return self._subscribed.wait_for(lambda: self.subscriptions >= count, timeout)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued went out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.empty() and self._idle.wait(0.05):
                return True
        return False

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()

    def _run(self) -> None:
        enc = msgspec.msgpack.Encoder()
        while True:
            self._take_subscriptions()
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.02)
            except queue.Empty:
                self._idle.set()
                continue
            if item is None:
                return
            if isinstance(item, _Drop):  # applies to the batches queued after it
                self._lose += item.n
                self._forget += item.n if item.forget else 0
                continue
            if isinstance(item, bytes):
                payload = item
            else:
                payload = encode_batch(self.layout, item.ts, item.events, self.rank, enc)
            seq = self._seq
            self._seq += 1
            lose, self._lose = self._lose > 0, max(self._lose - 1, 0)
            forget, self._forget = self._forget > 0, max(self._forget - 1, 0)
            if not lose:
                self._pub.send_multipart((self.topic, seq.to_bytes(SEQ_BYTES, "big"), payload))
                self.sent += 1
            if not forget:
                self._buffer.append((seq, payload))
            if self._queue.empty():
                self._idle.set()

    def _take_subscriptions(self) -> None:
        # Only this thread touches the socket (ZMQ sockets are not thread-safe).
        while self._pub.poll(0):
            if self._pub.recv()[:1] == b"\x01":
                with self._subscribed:
                    self.subscriptions += 1
                    self._subscribed.notify_all()

    def _serve_replay(self) -> None:
        if self._replay is None:
            return
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        head = [client, b""] + ([self.topic] if self.layout in (Layout.V0_26, Layout.V0_33) else [])
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart([*head, seq.to_bytes(SEQ_BYTES, "big"), payload])
        self._replay.send_multipart([*head, END_SEQ.to_bytes(SEQ_BYTES, "big", signed=True), b""])


def _offset(endpoint: str, rank: int) -> str:
    """Data-parallel rank N binds port + N (as vLLM's publisher does)."""
    if rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    base, port = endpoint.rsplit(":", 1)
    return f"{base}:{int(port) + rank}"
