"""Subscriber to vLLM's KV event streams: one ZMQ SUB per endpoint (one per data-parallel rank).

One thread (the hub) owns every socket: SUBs for the streams, their socket monitors
(connected or not), and DEALERs for the replay endpoints. It decodes each batch
(``kv_wire``), counts stored / removed blocks per medium, measures how long a removed
block had been stored (the engine's own timestamps: "young" removals are hot blocks
evicted) and which removed blocks the engine stored again (regretted evictions; both in
``blocks.py``), and keeps the sequence honest:

* a sequence number jumping ahead is a gap: those batches are asked for again on the
  replay endpoint when there is one; what the replay cannot serve is counted lost;
* a sequence number going backwards is a publisher that restarted (its counter began
  again): counted, and counting goes on — ZMQ reconnects a SUB by itself.

The agent's loop reads immutable ``StreamStats`` copies; nothing here raises into it.
Every malformed message is counted by kind and dropped.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog
import zmq
from kvwatch.daemon.engines.blocks import MediumBlocks
from kvwatch.daemon.engines.groups import MediumGroups
from kvwatch.daemon.engines.records import StreamSpec, StreamStats
from kvwatch.daemon.engines.wire import (
    CLEARED,
    NIL,
    REMOVED,
    STORED,
    Decoder,
    StoredEvent,
    WireError,
    extra_keys,
    parse_frames,
    parse_replay,
    replay_request,
)
from zmq.utils.monitor import recv_monitor_message

log = structlog.get_logger("kvwatch.kv_events")

DEFAULT_MEDIUM = "GPU"  # events without a medium (vLLM ≤ 0.10) came from the GPU block pool
MAX_MEDIA = 8
MAX_MESSAGE_BYTES = 64 << 20
DRAIN_PER_WAKEUP = 2000


@dataclass(slots=True)
class _Replay:
    start: int
    covers: frozenset[int]
    sent_at: float


class _Stream:
    def __init__(
        self, spec: StreamSpec, ctx: zmq.Context[zmq.Socket[bytes]], now: float, bounds: tuple[int, int]
    ) -> None:
        self.spec = spec
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 100_000)
        self.sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.sub.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        self.sub.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sub.connect(spec.endpoint)
        self.dealer: zmq.Socket[bytes] | None = None
        self.decoder = Decoder()
        self.connected = False
        self.expected: int | None = None
        self.bounds = bounds  # per medium and group: store times, removals remembered
        self.media: dict[str, MediumGroups] = {}
        self.extras: dict[str, int] = {}  # blocks stored with extra keys, by key: lora, cache_salt, ...
        self.batches = self.events = self.cleared = 0
        self.gaps = self.missed = self.replayed = self.lost = self.restarts = self.replay_requests = 0
        self.errors: dict[str, int] = {}
        self.missing: set[int] = set()
        self.pending: _Replay | None = None
        self.last_ts = 0.0
        self.last_at = now

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sub.disable_monitor()
        for s in (self.monitor, self.sub, self.dealer):
            if s is not None:
                s.close(0)

    def stats(self) -> StreamStats:
        return StreamStats(
            spec=self.spec,
            connected=self.connected,
            batches=self.batches,
            events=self.events,
            media={k: m.logical() for k, m in self.media.items()},
            groups=tuple(g for k, m in self.media.items() for g in m.totals(k)),
            localities={k: m.locality for k, m in self.media.items() if m.locality},
            cleared=self.cleared,
            gaps=self.gaps,
            missed=self.missed,
            replayed=self.replayed,
            lost=self.lost,
            decode_errors=dict(self.errors),
            restarts=self.restarts,
            replay_requests=self.replay_requests,
            last_seq=None if self.expected is None else self.expected - 1,
            last_batch_ts=self.last_ts,
            last_message_at=self.last_at,
            tracked_blocks=sum(m.remembered for m in self.media.values()),
            extras=dict(self.extras),
        )


class KVEventHub:
    """Owns the streams and the thread that serves them."""

    def __init__(
        self,
        *,
        thrash_seconds: float = 10.0,
        max_tracked_blocks: int = 1_000_000,
        regret_memory_blocks: int = 524_288,
        replay_timeout_seconds: float = 2.0,
        max_replay_batches: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.thrash_seconds = thrash_seconds
        self.bounds = (max_tracked_blocks, regret_memory_blocks)
        self.replay_timeout = replay_timeout_seconds
        self.max_replay = max_replay_batches
        self.clock = clock
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._lock = threading.Lock()
        self._wanted: frozenset[StreamSpec] = frozenset()
        self._dirty = False
        self._streams: dict[StreamSpec, _Stream] = {}
        self._by_socket: dict[zmq.Socket[bytes], _Stream] = {}
        self._poller = zmq.Poller()
        self._stop = threading.Event()
        self._wake = threading.Event()  # set_streams / close: the idle hub looks again
        self._thread: threading.Thread | None = None
        self.failures: dict[str, int] = {}  # stream set-up failures by reason

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
            s.close()
        self._streams.clear()
        self._ctx.term()

    # --- the hub thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once(100)
            except Exception as err:  # the thread must outlive anything a peer sends
                self._fail("hub_error", err)
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

    def _fail(self, reason: str, err: BaseException) -> None:
        n = self.failures.get(reason, 0)
        self.failures[reason] = n + 1
        if n == 0:
            log.warning("kv event subscriber problem", reason=reason, error=str(err))

    def _apply(self) -> None:
        with self._lock:
            wanted, self._dirty = self._wanted, False
            for spec in [s for s in self._streams if s not in wanted]:
                st = self._streams.pop(spec)
                for sock in (st.sub, st.monitor, st.dealer):
                    if sock is not None:
                        self._poller.unregister(sock)
                        self._by_socket.pop(sock, None)
                st.close()
            for spec in wanted - self._streams.keys():
                try:
                    st = _Stream(spec, self._ctx, self.clock(), self.bounds)
                except zmq.ZMQError as err:
                    self._fail("connect", err)
                    continue
                self._streams[spec] = st
                for sock in (st.sub, st.monitor):
                    self._poller.register(sock, zmq.POLLIN)
                    self._by_socket[sock] = st
                log.info("subscribed to KV events", endpoint=spec.endpoint, replay=spec.replay, dp_rank=spec.dp_rank)

    def _on_monitor(self, st: _Stream) -> None:
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

    def _drain(self, st: _Stream, now: float) -> None:
        msgs: list[list[bytes]] = []
        for _ in range(DRAIN_PER_WAKEUP):
            try:
                msgs.append(st.sub.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        with self._lock:
            st.last_at = now
            for frames in msgs:
                try:
                    _topic, seq, payload = parse_frames(frames)
                except WireError as err:
                    self._error(st, err.kind)
                    continue
                self._sequence(st, seq, now)
                self._ingest(st, payload)

    def _error(self, st: _Stream, kind: str, n: int = 1) -> None:
        st.errors[kind] = st.errors.get(kind, 0) + n

    def _sequence(self, st: _Stream, seq: int, now: float) -> None:
        exp = st.expected
        if exp is not None and seq != exp:
            if seq > exp:
                st.gaps += 1
                st.missed += seq - exp
                self._ask_replay(st, exp, seq, now)
            else:  # the counter began again: a new publisher (engine restart)
                st.restarts += 1
                st.missing.clear()
                st.pending = None
                for m in st.media.values():
                    m.clear()
        st.expected = seq + 1

    def _ingest(self, st: _Stream, payload: bytes) -> None:
        try:
            batch = st.decoder.decode(payload)
        except WireError as err:
            self._error(st, err.kind)
            return
        if batch.skipped:
            self._error(st, "event", batch.skipped)
        if batch.undescribed:
            self._error(st, "field", batch.undescribed)
        st.batches += 1
        st.events += len(batch.events)
        ts = batch.ts
        st.last_ts = max(st.last_ts, ts)
        young_before = ts - self.thrash_seconds
        for ev in batch.events:  # the groups a batch describes, known before any of its blocks count
            if isinstance(ev, STORED) and ev.kv_cache_spec_kind is not None:
                mg = self._medium(st, ev.medium)
                mg.group(ev.group_idx)
                mg.learn(ev.group_idx, ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window, ev.locality)
        for ev in batch.events:
            if isinstance(ev, STORED):
                self._store(st, ev, ts)
            elif isinstance(ev, REMOVED):
                mg = self._medium(st, ev.medium)
                idx = ev.group_idx
                mg.group(idx).remove(ev.block_hashes, ts, young_before, self._lower(st, ev.medium, mg, idx))
            elif isinstance(ev, CLEARED):
                st.cleared += 1
                self._settle(st, float("inf"))  # what waits is judged before the memories go
                for m in st.media.values():
                    m.drop_all()
        self._settle(st, ts)

    def _store(self, st: _Stream, ev: StoredEvent, ts: float) -> None:
        mg = self._medium(st, ev.medium)
        blocks = mg.group(ev.group_idx)
        if ev.locality is not None:
            mg.learn(ev.group_idx, None, None, ev.locality)
        hashes = ev.block_hashes
        nil = ev.parent_block_hash == NIL
        if nil and (ev.medium or DEFAULT_MEDIUM) == DEFAULT_MEDIUM and mg.announces(hashes, blocks):
            blocks.announce(len(hashes))
            return
        blocks.store(hashes, ts, ev.block_size, len(hashes) == 1 and not nil)
        if (ev.lora_name is not None or ev.extra_keys) and blocks is mg.groups.get(mg.reference):
            self._extras(st, ev)

    @staticmethod
    def _extras(st: _Stream, ev: StoredEvent) -> None:
        """Blocks stored with a LoRA adapter, a cache salt (a request's first block), multimodal
        inputs or prompt embeddings, on the medium's reference group (once per block range)."""
        n = st.extras
        if ev.lora_name is not None:
            n["lora"] = n.get("lora", 0) + len(ev.block_hashes)
        for entry in ev.extra_keys or ():
            k = extra_keys(entry, ev.lora_name)
            if k.salt is not None:
                n["cache_salt"] = n.get("cache_salt", 0) + 1
            if k.multimodal:
                n["multimodal"] = n.get("multimodal", 0) + 1
            if k.embeds:
                n["prompt_embeds"] = n.get("prompt_embeds", 0) + 1

    def _settle(self, st: _Stream, ts: float) -> None:
        gpu = st.media.get(DEFAULT_MEDIUM)
        if gpu is not None:
            for idx, g in gpu.groups.items():
                g.settle(ts, self._lower(st, DEFAULT_MEDIUM, gpu, idx))

    def _lower(self, st: _Stream, name: str | None, mg: MediumGroups, idx: int | None) -> list[MediumBlocks]:
        """For a GPU removal in a group that holds whole prefixes: the same group of the stream's
        other tiers, where they have stored blocks (the offload targets the block should have
        reached). A window-bounded group's blocks are offloaded by window, if at all: not judged."""
        key = idx if isinstance(idx, int) and idx >= 0 else 0
        if (name or DEFAULT_MEDIUM) != DEFAULT_MEDIUM or not mg.is_full(key):
            return []
        out = []
        for k, m in st.media.items():
            g = m.groups.get(key) if k != DEFAULT_MEDIUM else None
            if g is not None and g.stored:
                out.append(g)
        return out

    def _medium(self, st: _Stream, name: str | None) -> MediumGroups:
        key = name or DEFAULT_MEDIUM
        m = st.media.get(key)
        if m is None:
            if len(st.media) >= MAX_MEDIA or len(key) > 32 or not key.isprintable():
                key = "other"
            m = st.media.setdefault(key, MediumGroups(st.bounds))
        return m

    # --- replay -----------------------------------------------------------------------------------
    def _ask_replay(self, st: _Stream, lo: int, hi: int, now: float) -> None:
        if st.spec.replay is None or hi - lo > self.max_replay:
            st.lost += hi - lo
            return
        st.missing.update(range(lo, hi))
        if st.pending is None:
            self._send_replay(st, now)

    def _send_replay(self, st: _Stream, now: float) -> None:
        if st.dealer is None:
            try:
                d = self._ctx.socket(zmq.DEALER)
                d.setsockopt(zmq.LINGER, 0)
                d.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
                d.connect(st.spec.replay or "")
            except zmq.ZMQError as err:
                self._fail("replay_connect", err)
                st.lost += len(st.missing)
                st.missing.clear()
                return
            st.dealer = d
            self._poller.register(d, zmq.POLLIN)
            self._by_socket[d] = st
        start = min(st.missing)
        try:
            st.dealer.send_multipart(replay_request(start), zmq.NOBLOCK)
        except zmq.ZMQError as err:
            self._fail("replay_send", err)
            st.lost += len(st.missing)
            st.missing.clear()
            return
        st.replay_requests += 1
        st.pending = _Replay(start, frozenset(st.missing), now)

    def _drain_replay(self, st: _Stream, now: float) -> None:
        dealer = st.dealer
        if dealer is None:
            return
        with self._lock:
            for _ in range(DRAIN_PER_WAKEUP):
                try:
                    frames = dealer.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    seq, payload = parse_replay(frames)
                except WireError as err:
                    self._error(st, err.kind)
                    continue
                if seq < 0:
                    self._finish_replay(st, now)
                    continue
                if seq in st.missing:
                    st.missing.discard(seq)
                    st.replayed += 1
                    self._ingest(st, payload)

    def _finish_replay(self, st: _Stream, now: float) -> None:
        """End marker (or timeout): what the request covered and did not bring is lost."""
        p = st.pending
        st.pending = None
        if p is None:
            return
        gone = p.covers & st.missing
        st.lost += len(gone)
        st.missing -= gone
        if st.missing:
            self._send_replay(st, now)
