"""vLLM's KV event wire format, decoded (the encoder that test publishers use is
``daemon/lab/wire_encode.py``).

Read off ``vllm/distributed/kv_events.py`` of vLLM 0.9.2, 0.11.0, 0.26.0 and 0.33.0 and checked
against bytes produced by vLLM's own publisher (``tests/fixtures/kv_events``):

* PUB multipart message: ``[topic, sequence (8-byte big-endian, unsigned), payload]``.
* Replay (ROUTER): the request is ``start_seq`` as 8 bytes big-endian; a DEALER sends
  ``[b"", start]``. Replies are ``[b"", seq, payload]`` (0.9, 0.11) or
  ``[b"", topic, seq, payload]`` (0.26, 0.33), then an end marker whose seq is ``-1``
  (signed) and whose payload is empty.
* payload: msgpack, by ``msgspec.msgpack.Encoder`` of ``KVEventBatch(ts, events,
  data_parallel_rank)`` — an array (``array_like=True``). Events are a tagged union
  tagged by class name (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``):
  arrays with the tag first up to 0.11, maps with a ``"type"`` key from (at least)
  0.26. Fields only ever get appended, so one decoder per shape reads every release
  seen: unknown trailing array items and unknown map keys are skipped, missing
  trailing ones take their defaults.

Decoding never trusts the input: any malformed message raises ``WireError`` with a
kind the caller counts; an event of an unknown type is skipped and counted while
the rest of its batch is kept. A batch is checked whole before anything counts it, so that a
bad one changes no counter (``Decoder.decode``):

* ``nesting``: nested deeper than the decoder follows (Python's recursion limit);
* ``timestamp``: ``ts`` not finite, negative or past MAX_TS: it feeds the regret histogram's
  sum and every store and removal time;
* ``block_size``: negative or past MAX_BLOCK_SIZE: it multiplies the regret and announce tokens;
* ``size``: more events, hashes in an event or in the batch, or a longer hash, than a real
  engine sends (below): refused at the array's header, before its items exist.

What one message can cost is bounded by those caps, not by its length: a payload up to
FAST_PAYLOAD_BYTES is decoded in one call (a few tens of bytes of Python objects per byte at most);
a longer one event by event, the batch's hashes summed as they come, so that at most
MAX_BATCH_HASHES hashes and MAX_BATCH_EVENTS events exist at once. An event's ``token_ids`` are
never decoded, its ``extra_keys`` are read within their own bound (``block_keys.py``).

The caps (``wire_structs.py``, MAX_BATCH_HASHES here) are far past what vLLM sends: a batch is
one engine step's events; a BlockStored names one request's new blocks in one KV cache group (a
1M-token prompt at block size 16 is 65,536 blocks: MAX_EVENT_HASHES is twice that); a
BlockRemoved names one evicted block (vLLM 0.9 to 0.33), so a step that allocates N blocks sends
at most N of them; MAX_BATCH_HASHES is 16M tokens of blocks of 16 in one step. vLLM's hashes are
64-bit ints or 32-byte digests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvwatch.daemon.engines.block_keys import (
    ARRAY_HEADS,
    MAP_HEADS,
    NIL,
    NO_EXTRA_KEYS,
    BlockKeys,
    ExtraKeys,
    Unreadable,
    block_keys,
    extra_keys,
)
from kvwatch.daemon.engines.wire_structs import (
    CLEARED,
    MAX_BATCH_EVENTS,
    MAX_EVENT_HASHES,
    MAX_HASH_BYTES,
    REMOVED,
    ABatchA,
    ABatchM,
    ABatchRaw,
    ACleared,
    AEvent,
    ARemoved,
    AStored,
    LEvent,
    LRemoved,
    LStored,
    MBatchA,
    MBatchM,
    MBatchRaw,
    MCleared,
    MEvent,
    MRemoved,
    MStored,
    WireHash,
)

__all__ = [
    "CLEARED",
    "MAX_BATCH_EVENTS",
    "MAX_EVENT_HASHES",
    "MAX_HASH_BYTES",
    "NO_EXTRA_KEYS",
    "REMOVED",
    "BlockKeys",
    "ExtraKeys",
    "extra_keys",
]

END_SEQ = -1
SEQ_BYTES = 8

MAX_BATCH_HASHES = 1 << 20
MAX_BLOCK_SIZE = 1 << 24  # tokens: a Mamba group's block can span a whole context
MAX_TS = float(1 << 32)  # seconds since the epoch (year 2106); tests and simulators count from 0
FAST_PAYLOAD_BYTES = 1 << 20  # at most MAX_BATCH_HASHES: a payload this short cannot carry more hashes

Hash = int | bytes
_PARENT = msgspec.msgpack.Decoder(WireHash | None)


class WireError(ValueError):
    """A message that is not a vLLM KV event batch, or one that would corrupt a counter.
    ``kind``: frames, sequence, payload, nesting, timestamp, block_size, size."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


def _rejected(err: msgspec.ValidationError | msgspec.DecodeError) -> WireError:
    """A constraint's error is ``size`` (an array or a hash longer than its cap), else ``payload``."""
    text = str(err)
    return WireError("size" if "length <=" in text else "payload", text)


class Stored(msgspec.Struct, gc=False):
    """A BlockStored as the accounting reads it, every field checked (built here, never decoded)."""

    block_hashes: list[Hash]
    parent: Hash | None  # the parent block's hash, where there is one kvwatch can read
    has_parent: bool  # a parent was named (readable or not): the blocks continue a request
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    keys: BlockKeys | None = None  # what the blocks' extra keys say; None: none
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    described: bool = True  # False: its parent or extra keys could not be read (counted as field)


STORED = (Stored,)
Event = Stored | ARemoved | MRemoved | ACleared | MCleared
_WireEvent = AStored | MStored | ARemoved | MRemoved | ACleared | MCleared


@dataclass(slots=True)
class Batch:
    ts: float
    events: Sequence[Event]
    data_parallel_rank: int | None
    skipped: int = 0  # events of an unknown type or shape, left out
    undescribed: int = 0  # events kept with a descriptive field dropped (of a type kvwatch does not read)


@dataclass(slots=True)
class _Decoded:
    """A batch as decoded, before its check."""

    ts: float
    events: Sequence[_WireEvent]
    data_parallel_rank: int | None
    skipped: int = 0
    undescribed: int = 0


class Decoder:
    """Decodes payloads of any layout seen; remembers which event shape the stream uses."""

    def __init__(self) -> None:
        d = msgspec.msgpack.Decoder
        self._typed: dict[tuple[bool, bool], msgspec.msgpack.Decoder[Any]] = {
            (True, True): d(ABatchA),
            (True, False): d(ABatchM),
            (False, True): d(MBatchA),
            (False, False): d(MBatchM),
        }
        self._raw: dict[bool, msgspec.msgpack.Decoder[Any]] = {True: d(ABatchRaw), False: d(MBatchRaw)}
        self._event: dict[bool, msgspec.msgpack.Decoder[Any]] = {True: d(AEvent), False: d(MEvent)}
        self._lenient = d(LEvent)
        self._array_events = True  # the shape of the last batch that decoded

    def decode(self, payload: bytes | memoryview) -> Batch:
        """The batch, checked whole; ``WireError`` for one that nothing of may count."""
        if not payload:
            raise WireError("payload", "empty payload")
        head = payload[0]
        if head in ARRAY_HEADS:
            array_batch = True
        elif head in MAP_HEADS:
            array_batch = False
        else:
            raise WireError("payload", f"not a msgpack array or map (first byte 0x{head:02x})")
        try:
            if len(payload) <= FAST_PAYLOAD_BYTES:
                batch = self._typed_batch(payload, array_batch)
                if batch is not None:
                    return self._checked(batch)
            return self._checked(self._salvage(payload, array_batch))
        except RecursionError:
            raise WireError("nesting", "nested deeper than the decoder follows") from None

    def _typed_batch(self, payload: bytes | memoryview, array_batch: bool) -> _Decoded | None:
        """The fast path: the whole batch in one call, in either event shape."""
        first = self._array_events
        for array_events in (first, not first):
            try:
                b = self._typed[array_batch, array_events].decode(payload)
            except (msgspec.ValidationError, msgspec.DecodeError):
                continue
            self._array_events = array_events
            return _Decoded(b.ts, b.events, b.data_parallel_rank)
        return None

    def _salvage(self, payload: bytes | memoryview, array_batch: bool) -> _Decoded:
        """Event by event: a long payload (its hashes summed as they come), or one whose envelope
        decodes but some events do not (a type added by a newer vLLM, or garbage): keep the
        events that decode, count the rest."""
        try:
            raw = self._raw[array_batch].decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError) as err:
            raise _rejected(err) from None
        events: list[_WireEvent] = []
        skipped = undescribed = hashes = 0
        for r in raw.events:
            ev, lenient = self._one_event(r)
            if ev is None:
                skipped += 1
                continue
            undescribed += lenient
            events.append(ev)
            if not isinstance(ev, CLEARED):
                hashes += len(ev.block_hashes)
                if hashes > MAX_BATCH_HASHES:
                    raise WireError("size", f"more than {MAX_BATCH_HASHES} block hashes in one batch")
        return _Decoded(raw.ts, events, raw.data_parallel_rank, skipped, undescribed)

    def _one_event(self, r: msgspec.Raw) -> tuple[_WireEvent | None, bool]:
        """One event, and whether it lost its description; ``size`` raised for one past a cap."""
        data = memoryview(r)
        if not data:
            return None, False
        array_event = data[0] in ARRAY_HEADS
        try:
            return self._event[array_event].decode(data), False
        except msgspec.ValidationError as err:
            if "length <=" in str(err):
                raise _rejected(err) from None
        except msgspec.DecodeError:
            pass
        ev = None if array_event else self._lenient_event(data)
        return ev, ev is not None

    def _lenient_event(self, data: memoryview) -> _WireEvent | None:
        try:
            ev = self._lenient.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None
        if isinstance(ev, LStored):
            return MStored(ev.block_hashes, ev.parent_block_hash, medium=ev.medium)
        if isinstance(ev, LRemoved):
            return MRemoved(ev.block_hashes, ev.medium)
        return None

    def _checked(self, b: _Decoded) -> Batch:
        """Refuse a batch any of whose values would corrupt a counter; read every stored event's
        parent and extra keys (an unreadable one loses that description, counted). The batch's
        hashes are within their cap already: a payload decoded whole is too short to hold more
        (each takes a byte at least), a longer one was summed event by event."""
        if not 0.0 <= b.ts <= MAX_TS:  # NaN too
            raise WireError("timestamp", "batch timestamp not finite, negative or past 2106")
        events: list[Event] = [_stored(ev) if isinstance(ev, _WIRE_STORED) else ev for ev in b.events]
        undescribed = sum(1 for ev in events if isinstance(ev, Stored) and not ev.described)
        return Batch(b.ts, events, b.data_parallel_rank, b.skipped, b.undescribed + undescribed)


_WIRE_STORED = (AStored, MStored)


def _stored(ev: AStored | MStored) -> Stored:
    """The checked record of a BlockStored."""
    if not 0 <= ev.block_size <= MAX_BLOCK_SIZE:
        raise WireError("block_size", f"block_size outside 0..{MAX_BLOCK_SIZE}")
    described = True
    has_parent = ev.parent_block_hash != NIL
    parent: Hash | None = None
    if has_parent:
        try:
            parent = _PARENT.decode(ev.parent_block_hash)
        except (msgspec.ValidationError, msgspec.DecodeError):
            described = False
    keys = None
    if ev.extra_keys != NIL:
        try:
            keys = block_keys(ev.extra_keys, ev.lora_name, len(ev.block_hashes))
        except Unreadable:
            described = False
    return Stored(
        ev.block_hashes,
        parent,
        has_parent,
        ev.block_size,
        ev.medium,
        ev.lora_name,
        keys,
        ev.group_idx,
        ev.kv_cache_spec_kind,
        ev.kv_cache_spec_sliding_window,
        ev.locality,
        described,
    )


Frame = bytes | memoryview


def parse_frames(frames: Sequence[Frame]) -> tuple[Frame, int, Frame]:
    """``[topic, seq, payload]`` → (topic, seq, payload)."""
    if len(frames) != 3:
        raise WireError("frames", f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != SEQ_BYTES:
        raise WireError("sequence", f"sequence frame of {len(seq)} bytes, expected 8")
    return topic, int.from_bytes(seq, "big"), payload


def parse_replay(frames: Sequence[Frame]) -> tuple[int, Frame]:
    """A replay reply on a DEALER socket → (seq, payload); seq is -1 at the end marker."""
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise WireError("frames", f"replay reply of {len(frames)} frames, expected [b'', (topic,) seq, payload]")
    seq, payload = frames[-2], frames[-1]
    if len(seq) != SEQ_BYTES:
        raise WireError("sequence", f"sequence frame of {len(seq)} bytes, expected 8")
    return int.from_bytes(seq, "big", signed=True), payload


def replay_request(start_seq: int) -> list[bytes]:
    """``start_seq`` is a sequence number the publisher sent: 0 <= start_seq < 2**64."""
    return [b"", start_seq.to_bytes(SEQ_BYTES, "big")]
