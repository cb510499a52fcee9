"""One KV event stream's sockets and what it has counted (``kv_events.py``'s hub serves them):
a SUB on the engine's endpoint, its socket monitor, a DEALER on the replay endpoint once a gap
asks for one, the stream's accounting (``stream_counts.py``) and sequence (``kv_sequence.py``).

ZMQ queues a stream's messages in kvwatch's process up to QUEUE_MESSAGES (the SUB's and the replay
DEALER's receive high-water mark), each frame up to MAX_MESSAGE_BYTES (a larger one disconnects
its peer; the batch shows as a gap). A full queue makes libzmq stop reading the connection: the
publisher keeps what follows (vLLM's PUB up to its own high-water mark, then it drops: gaps,
replayed or counted lost). libzmq bounds neither the frames of one message nor its parts before
the last arrives: the hub's memory guard does (``memory_guard.py``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import zmq

from kvwatch.daemon.engines.kv_sequence import Ranges, StreamSequence
from kvwatch.daemon.engines.memory_budget import MemoryBudget
from kvwatch.daemon.engines.stream_counts import StreamCounts
from kvwatch.daemon.engines.tenants import TenantNamer
from kvwatch.daemon.engines.wire import Frame
from kvwatch.daemon.model.engines import StreamSpec, StreamStats

MAX_MESSAGE_BYTES = 16 << 20  # a frame; vLLM's largest batch carries a step's token ids: ~3M tokens' worth
QUEUE_MESSAGES = 4  # per socket: RCVHWM x MAX_MESSAGE_BYTES is what ZMQ may hold of one stream's 1-frame messages

Payload = Frame


@dataclass(slots=True)
class Replay:
    start: int
    covers: Ranges
    sent_at: float


class Stream:
    def __init__(
        self,
        spec: StreamSpec,
        ctx: zmq.Context[zmq.Socket[bytes]],
        now: float,
        bounds: tuple[int, int],
        thrash_seconds: float,
        *,
        namer: TenantNamer | None = None,
        seq: StreamSequence[Payload],
        budget: MemoryBudget | None = None,
    ) -> None:
        self.spec = spec
        self.sub, self.monitor = self._open(ctx)
        self.dealer: zmq.Socket[bytes] | None = None
        self.counts = StreamCounts(bounds, thrash_seconds, namer, budget)
        self.connected = False
        self.seq = seq
        self.replay_requests = 0
        self.pending: Replay | None = None
        self.last_at = now

    def _open(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, QUEUE_MESSAGES)
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
            sub.setsockopt(zmq.SUBSCRIBE, self.spec.topic.encode())
            monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        except zmq.ZMQError:
            sub.close(0)
            raise
        try:
            sub.connect(self.spec.endpoint)
        except zmq.ZMQError:
            self._close(sub, monitor)
            raise
        return sub, monitor

    def reopen(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        """New sockets in place of these (whatever libzmq held for them goes with them); a replay
        asked on the old DEALER will not be answered: what it covered is lost."""
        self.close()
        self.dealer = None
        self.pending = None
        self.seq.lose_missing()
        self.connected = False
        self.sub, self.monitor = self._open(ctx)

    def close(self) -> None:
        self._close(self.sub, self.monitor, self.dealer)

    def retire(self) -> None:
        """The stream is no longer wanted: its sockets closed, its part of the node's memory
        budget back to the other streams (``reopen`` keeps both the counts and the part)."""
        self.counts.close()
        self.close()

    @staticmethod
    def _close(sub: zmq.Socket[bytes], *others: zmq.Socket[bytes] | None) -> None:
        with contextlib.suppress(zmq.ZMQError):
            sub.disable_monitor()
        for s in (*others, sub):
            if s is not None:
                s.close(0)

    def stats(self) -> StreamStats:
        q = self.seq
        return self.counts.stats(
            spec=self.spec,
            connected=self.connected,
            gaps=q.gaps,
            missed=q.missed,
            replayed=q.replayed,
            lost=q.lost,
            abandoned=q.abandoned,
            restarts=q.restarts,
            replay_requests=self.replay_requests,
            last_seq=None if q.expected is None else q.expected - 1,
            last_message_at=self.last_at,
        )
