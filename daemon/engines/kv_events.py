"""Subscriber to vLLM's KV event streams: one ZMQ SUB per endpoint (one per data-parallel rank).

One thread (the hub) owns every socket: SUBs for the streams, their socket monitors
(connected or not), and DEALERs for the replay endpoints (``kv_stream.py``). It decodes each
batch (``wire.py``), counts stored / removed blocks per medium, measures how long a removed
block had been stored (the engine's own timestamps: "young" removals are hot blocks
evicted) and which removed blocks the engine stored again (regretted evictions; both in
``blocks.py``), and keeps the sequence honest:

* a sequence number jumping ahead is a gap: those batches are asked for again on the
  replay endpoint when there is one; what the replay cannot serve is counted lost;
* a sequence number going backwards, or implausibly far ahead, is a publisher that restarted
  (its counter began again) if the stream goes on from it, else one stray batch
  (``kv_sequence.py``); ZMQ reconnects a SUB by itself.

The agent's loop reads immutable ``StreamStats`` copies; nothing here raises into it.
Every malformed message is counted by kind and dropped, one message at a time: whatever one
message raises is counted (``internal``) and the next one counts. The hub's own failures
(a socket it cannot open, a replay it cannot send, a message it fails on) go to the agent's
``ErrorBook`` as ``kv_events_<reason>``: ``kvwatch_errors_total``.

Memory: the hub takes one message at a time, never copied out of ZMQ, at most
DRAIN_BYTES_PER_WAKEUP before it looks at its other sockets. What ZMQ queues for a stream is
bounded in ``kv_stream.py``, a message's decoding in ``wire.py``, and what libzmq does not bound
(a multipart message that never ends) by the memory guard (``memory_guard.py``: past a share of
kvwatch's cgroup limit, the sockets are reopened).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import structlog
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvwatch.daemon.engines.kv_sequence import MAX_JUMP, StreamSequence
from kvwatch.daemon.engines.kv_stream import MAX_MESSAGE_BYTES, QUEUE_MESSAGES, Payload, Replay, Stream
from kvwatch.daemon.engines.memory_budget import DEFAULT_BYTES, MemoryBudget
from kvwatch.daemon.engines.memory_guard import MemoryGuard, cgroup_limit
from kvwatch.daemon.engines.tenants import TenantNamer
from kvwatch.daemon.engines.wire import WireError, parse_frames, parse_replay, replay_request
from kvwatch.daemon.host.procfs import ProcFS
from kvwatch.daemon.logs import ErrorBook
from kvwatch.daemon.model.engines import StreamSpec, StreamStats

log = structlog.get_logger("kvwatch.kv_events")

DRAIN_PER_WAKEUP = 2000
DRAIN_BYTES_PER_WAKEUP = 64 << 20


class KVEventHub:
    """Owns the streams and the thread that serves them."""

    def __init__(
        self,
        *,
        thrash_seconds: float = 10.0,
        max_tracked_blocks: int = 1_000_000,
        regret_memory_blocks: int = 12_000_000,
        kv_memory_bytes: int = DEFAULT_BYTES,
        replay_timeout_seconds: float = 2.0,
        max_replay_batches: int = 10_000,
        max_sequence_jump: int = MAX_JUMP,
        clock: Callable[[], float] = time.monotonic,
        namer: TenantNamer | None = None,
        errors: ErrorBook | None = None,
        rss_limit: int | None = None,
    ) -> None:
        """``rss_limit``: the process's RSS past which the hub resets its sockets
        (``memory_guard.py``); None: from kvwatch's cgroup; 0: no guard."""
        self.thrash_seconds = thrash_seconds
        self.namer = namer
        self.bounds = (max_tracked_blocks, regret_memory_blocks)
        self.budget = MemoryBudget(kv_memory_bytes)  # the node's, shared by the streams
        self.replay_timeout = replay_timeout_seconds
        self.max_replay = max_replay_batches
        self.max_jump = max_sequence_jump
        self.clock = clock
        self.errors = errors  # where the hub's own failures are counted (and logged once)
        self.guard = MemoryGuard(cgroup_limit(ProcFS()) if rss_limit is None else (rss_limit or None))
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._lock = threading.Lock()
        self._wanted: frozenset[StreamSpec] = frozenset()
        self._dirty = False
        self._streams: dict[StreamSpec, Stream] = {}
        self._by_socket: dict[zmq.Socket[bytes], Stream] = {}
        self._poller = zmq.Poller()
        self._stop = threading.Event()
        self._wake = threading.Event()  # set_streams / close: the idle hub looks again
        self._thread: threading.Thread | None = None
        self.failures: dict[str, int] = {}  # the hub's own failures by reason (also in ``errors``)

    # --- the agent's side -----------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvwatch-kv-events", daemon=True)
            self._thread.start()

    def set_streams(self, specs: Iterable[StreamSpec]) -> None:
        wanted = frozenset(specs)
        with self._lock:
            if wanted != self._wanted:
                self._wanted, self._dirty = wanted, True
                self._wake.set()

    def stats(self) -> dict[StreamSpec, StreamStats]:
        with self._lock:
            return {spec: s.stats() for spec, s in self._streams.items()}

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        for s in list(self._streams.values()):
            s.retire()
        self._streams.clear()
        self._ctx.term()

    # --- the hub thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once(100)
            except Exception as err:  # the thread must outlive anything a peer sends
                self._fail("hub_error", err, detail=False)
                self._stop.wait(0.1)

    def run_once(self, timeout_ms: int) -> None:
        if self._dirty:
            self._apply()
        if not self._by_socket:
            # pyzmq returns at once from a poll with nothing registered, so with no stream the
            # thread must wait here or it spins holding the GIL. It waits ten polls' worth:
            # every timer wakeup costs CPU (docs/performance.md), and set_streams wakes it.
            self._wake.wait(10 * timeout_ms / 1000)
            self._wake.clear()
            return
        ready = dict(self._poller.poll(timeout_ms))
        now = self.clock()
        for sock in ready:
            st = self._by_socket.get(sock)
            if st is None:
                continue
            if sock is st.sub:
                self._drain(st, now)
            elif sock is st.monitor:
                self._on_monitor(st)
            elif sock is st.dealer:
                self._drain_replay(st, now)
        for st in self._streams.values():
            if st.pending is not None and now - st.pending.sent_at > self.replay_timeout:
                with self._lock:
                    self._finish_replay(st, now)
        if self.guard.check(now):
            self._reopen_all()

    def _reopen_all(self) -> None:
        """The memory guard's reset: every stream's sockets closed and opened again."""
        rss = self.guard.last_rss >> 20
        self._fail("memory", MemoryError(f"RSS {rss} MiB past the limit: the KV event sockets are reopened"))
        with self._lock:
            for spec, st in list(self._streams.items()):
                for sock in (st.sub, st.monitor, st.dealer):
                    if sock is not None:
                        self._poller.unregister(sock)
                        self._by_socket.pop(sock, None)
                try:
                    st.reopen(self._ctx)
                except zmq.ZMQError as err:  # set up afresh at the next look at the wanted streams
                    self._fail("connect", err)
                    del self._streams[spec]
                    self._dirty = True
                    continue
                for sock in (st.sub, st.monitor):
                    self._poller.register(sock, zmq.POLLIN)
                    self._by_socket[sock] = st

    def _fail(self, reason: str, err: BaseException, *, detail: bool = True) -> None:
        """Count (and log once) one of the hub's own failures. ``detail``: the error's text may
        be logged (a socket's); else only its type (an error raised on a peer's message may
        quote what it carried)."""
        n = self.failures.get(reason, 0)
        self.failures[reason] = n + 1
        error = f"{type(err).__name__}: {err}" if detail else type(err).__name__
        if self.errors is not None:
            self.errors.record(f"kv_events_{reason}", "kv event subscriber problem", level="warning", error=error)
        elif n == 0:
            log.warning("kv event subscriber problem", reason=reason, error=error)

    def _apply(self) -> None:
        with self._lock:
            wanted, self._dirty = self._wanted, False
            for spec in [s for s in self._streams if s not in wanted]:
                st = self._streams.pop(spec)
                for sock in (st.sub, st.monitor, st.dealer):
                    if sock is not None:
                        self._poller.unregister(sock)
                        self._by_socket.pop(sock, None)
                st.retire()
            for spec in wanted - self._streams.keys():
                seq: StreamSequence[Payload] = StreamSequence(spec.replay is not None, self.max_replay, self.max_jump)
                try:
                    st = Stream(
                        spec,
                        self._ctx,
                        self.clock(),
                        self.bounds,
                        self.thrash_seconds,
                        namer=self.namer,
                        seq=seq,
                        budget=self.budget,
                    )
                except zmq.ZMQError as err:
                    self._fail("connect", err)
                    continue
                self._streams[spec] = st
                for sock in (st.sub, st.monitor):
                    self._poller.register(sock, zmq.POLLIN)
                    self._by_socket[sock] = st
                log.info("subscribed to KV events", endpoint=spec.endpoint, replay=spec.replay, dp_rank=spec.dp_rank)

    def _on_monitor(self, st: Stream) -> None:
        while st.monitor.poll(0):
            try:
                msg = recv_monitor_message(st.monitor)
            except (zmq.ZMQError, ValueError) as err:
                self._fail("monitor", err)
                return
            ev = msg.get("event")
            with self._lock:
                if ev == zmq.EVENT_CONNECTED:
                    st.connected = True
                elif ev == zmq.EVENT_DISCONNECTED:
                    st.connected = False

    def _drain(self, st: Stream, now: float) -> None:
        """One message at a time (each one's failure is its own), within the wakeup's bounds."""
        taken = 0
        for _ in range(DRAIN_PER_WAKEUP):
            try:
                frames = st.sub.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            taken += sum(len(f) for f in frames)
            with self._lock:
                st.last_at = now
                try:
                    self._take(st, [f.buffer for f in frames], now)
                except Exception as err:  # the last line of defence: that message only
                    st.counts.error("internal")
                    self._fail("internal", err, detail=False)
            if taken >= DRAIN_BYTES_PER_WAKEUP:
                break

    def _take(self, st: Stream, frames: list[Payload], now: float) -> None:
        try:
            _topic, seq, payload = parse_frames(frames)
        except WireError as err:
            st.counts.error(err.kind)
            return
        v = st.seq.live(seq, payload)
        if v.restart:  # a new publisher: its hashes need not mean what they meant
            st.pending = None
            st.counts.restart()
        if v.strays:
            st.counts.error("sequence", v.strays)
        for p in v.payloads:
            st.counts.ingest(p)
        if v.ask and st.pending is None:
            self._send_replay(st, now)

    # --- replay -----------------------------------------------------------------------------------
    def _send_replay(self, st: Stream, now: float) -> None:
        if st.dealer is None:
            try:
                d = self._ctx.socket(zmq.DEALER)
                d.setsockopt(zmq.LINGER, 0)
                d.setsockopt(zmq.RCVHWM, QUEUE_MESSAGES)
                d.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
                d.connect(st.spec.replay or "")
            except zmq.ZMQError as err:
                self._fail("replay_connect", err)
                st.seq.lose_missing()
                return
            st.dealer = d
            self._poller.register(d, zmq.POLLIN)
            self._by_socket[d] = st
        start = st.seq.missing.first()
        try:
            st.dealer.send_multipart(replay_request(start), zmq.NOBLOCK)
        except zmq.ZMQError as err:
            self._fail("replay_send", err)
            st.seq.lose_missing()
            return
        st.replay_requests += 1
        st.pending = Replay(start, st.seq.missing.snapshot(), now)

    def _drain_replay(self, st: Stream, now: float) -> None:
        dealer = st.dealer
        if dealer is None:
            return
        taken = 0
        for _ in range(DRAIN_PER_WAKEUP):
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            taken += sum(len(f) for f in frames)
            with self._lock:
                try:
                    self._take_replayed(st, [f.buffer for f in frames], now)
                except Exception as err:  # the last line of defence: that message only
                    st.counts.error("internal")
                    self._fail("internal", err, detail=False)
            if taken >= DRAIN_BYTES_PER_WAKEUP:
                break

    def _take_replayed(self, st: Stream, frames: list[Payload], now: float) -> None:
        try:
            seq, payload = parse_replay(frames)
        except WireError as err:
            st.counts.error(err.kind)
            return
        if seq < 0:
            self._finish_replay(st, now)
        elif st.seq.replayed_one(seq):
            st.counts.ingest(payload, newest=False)

    def _finish_replay(self, st: Stream, now: float) -> None:
        """End marker (or timeout): what the request covered and did not bring is lost."""
        p = st.pending
        st.pending = None
        if p is None:
            return
        st.seq.settle(p.covers)
        if st.seq.missing:
            self._send_replay(st, now)
