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
the rest of its batch is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

END_SEQ = -1
SEQ_BYTES = 8

# msgpack type bytes: fixarray, array16, array32 / fixmap, map16, map32
_ARRAY = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}
_MAP = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}

Hash = int | bytes


class WireError(ValueError):
    """A message that is not a vLLM KV event batch. ``kind``: frames, sequence, payload."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


# --- decoding structs (ours): only what kvwatch uses is materialised ----------------------------
NIL = msgspec.Raw(b"\xc0")  # msgpack nil: a BlockStored without a parent block

# Fields that describe a block rather than count it (its KV cache group, the group's attention
# kind, LoRA and extra keys, where the tier lives) are typed leniently at a second try: a newer
# release that changes one of their types loses that description, never the blocks (counted).


class _AStored(msgspec.Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[Hash]
    parent_block_hash: msgspec.Raw  # only whether there is one (and which) matters; any value decodes
    token_ids: msgspec.Raw
    block_size: int
    lora_id: msgspec.Raw
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class _ARemoved(msgspec.Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None


class _ACleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


class _MStored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[Hash]
    parent_block_hash: msgspec.Raw = NIL
    block_size: int = 0
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None  # per block: None, or that block's keys (``ExtraKeys``)
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class _MRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None


class _MCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


class _LStored(msgspec.Struct, tag="BlockStored", gc=False):
    """The lenient second try of a map event: what counts it, nothing that describes it."""

    block_hashes: list[Hash]
    parent_block_hash: msgspec.Raw = NIL
    medium: str | None = None


class _LRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[Hash]
    medium: str | None = None


_AEvent = _AStored | _ARemoved | _ACleared
_MEvent = _MStored | _MRemoved | _MCleared
_LEvent = _LStored | _LRemoved | _MCleared

StoredEvent = _AStored | _MStored
STORED = (_AStored, _MStored)
REMOVED = (_ARemoved, _MRemoved)
CLEARED = (_ACleared, _MCleared)


class _ABatchA(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_AEvent]
    data_parallel_rank: int | None = None


class _ABatchM(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MEvent]
    data_parallel_rank: int | None = None


class _MBatchA(msgspec.Struct, gc=False):
    ts: float
    events: list[_AEvent]
    data_parallel_rank: int | None = None


class _MBatchM(msgspec.Struct, gc=False):
    ts: float
    events: list[_MEvent]
    data_parallel_rank: int | None = None


class _ABatchRaw(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _MBatchRaw(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


Event = _AStored | _ARemoved | _ACleared | _MStored | _MRemoved | _MCleared


@dataclass(slots=True)
class Batch:
    ts: float
    events: Sequence[Event]
    data_parallel_rank: int | None
    skipped: int = 0  # events of an unknown type or shape, left out
    undescribed: int = 0  # events kept with their descriptive fields dropped (a type kvwatch does not know)


class Decoder:
    """Decodes payloads of any layout seen; remembers which event shape the stream uses."""

    def __init__(self) -> None:
        d = msgspec.msgpack.Decoder
        self._typed: dict[tuple[bool, bool], msgspec.msgpack.Decoder[Any]] = {
            (True, True): d(_ABatchA),
            (True, False): d(_ABatchM),
            (False, True): d(_MBatchA),
            (False, False): d(_MBatchM),
        }
        self._raw: dict[bool, msgspec.msgpack.Decoder[Any]] = {True: d(_ABatchRaw), False: d(_MBatchRaw)}
        self._event: dict[bool, msgspec.msgpack.Decoder[Any]] = {True: d(_AEvent), False: d(_MEvent)}
        self._lenient = d(_LEvent)
        self._array_events = True  # the shape of the last batch that decoded

    def decode(self, payload: bytes) -> Batch:
        if not payload:
            raise WireError("payload", "empty payload")
        head = payload[0]
        if head in _ARRAY:
            array_batch = True
        elif head in _MAP:
            array_batch = False
        else:
            raise WireError("payload", f"not a msgpack array or map (first byte 0x{head:02x})")
        first = self._array_events
        for array_events in (first, not first):
            try:
                b = self._typed[array_batch, array_events].decode(payload)
            except (msgspec.ValidationError, msgspec.DecodeError):
                continue
            self._array_events = array_events
            return Batch(b.ts, b.events, b.data_parallel_rank)
        return self._salvage(payload, array_batch)

    def _salvage(self, payload: bytes, array_batch: bool) -> Batch:
        """Slow path: the envelope decodes but some events do not (a type added by a newer
        vLLM, or garbage): keep the events that decode, count the rest."""
        try:
            raw = self._raw[array_batch].decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError) as err:
            raise WireError("payload", str(err)) from None
        events: list[Event] = []
        skipped = undescribed = 0
        for r in raw.events:
            data = bytes(r)
            if not data:
                skipped += 1
                continue
            array_event = data[0] in _ARRAY
            try:
                events.append(self._event[array_event].decode(data))
                continue
            except (msgspec.ValidationError, msgspec.DecodeError):
                pass
            ev = None if array_event else self._lenient_event(data)
            if ev is None:
                skipped += 1
            else:
                undescribed += 1
                events.append(ev)
        return Batch(raw.ts, events, raw.data_parallel_rank, skipped, undescribed)

    def _lenient_event(self, data: bytes) -> Event | None:
        try:
            ev = self._lenient.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None
        if isinstance(ev, _LStored):
            return _MStored(ev.block_hashes, ev.parent_block_hash, medium=ev.medium)
        if isinstance(ev, _LRemoved):
            return _MRemoved(ev.block_hashes, ev.medium)
        return None


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """What one block's ``extra_keys`` entry says: vLLM 0.26 builds it as the LoRA name, then one
    ``(mm_hash, offset)`` pair per multimodal input in the block, then the request's
    ``cache_salt`` (first block only), then a digest per prompt-embeddings span
    (``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys``).

    The salt is a tenant's secret (it isolates its prefix cache): it is kept out of ``repr``
    and must never reach a metric, a log line or a trace."""

    lora: str | None = None
    multimodal: int = 0
    embeds: int = 0
    salt: str | None = field(default=None, repr=False)


NO_EXTRA_KEYS = ExtraKeys()


def extra_keys(entry: object, lora_name: str | None) -> ExtraKeys:
    """One block's entry, read in vLLM's order; anything else in it is ignored."""
    if not isinstance(entry, list | tuple) or not entry:
        return NO_EXTRA_KEYS
    items = list(entry)
    lora = None
    if lora_name is not None and isinstance(items[0], str) and items[0] == lora_name:
        lora = items.pop(0)
    mm = embeds = 0
    salt = None
    for x in items:
        if isinstance(x, list | tuple):
            mm += 1
        elif isinstance(x, str) and salt is None:
            salt = x
        elif isinstance(x, bytes | bytearray):
            embeds += 1
    return ExtraKeys(lora, mm, embeds, salt)


def parse_frames(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """``[topic, seq, payload]`` → (topic, seq, payload)."""
    if len(frames) != 3:
        raise WireError("frames", f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != SEQ_BYTES:
        raise WireError("sequence", f"sequence frame of {len(seq)} bytes, expected 8")
    return topic, int.from_bytes(seq, "big"), payload


def parse_replay(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """A replay reply on a DEALER socket → (seq, payload); seq is -1 at the end marker."""
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise WireError("frames", f"replay reply of {len(frames)} frames, expected [b'', (topic,) seq, payload]")
    seq, payload = frames[-2], frames[-1]
    if len(seq) != SEQ_BYTES:
        raise WireError("sequence", f"sequence frame of {len(seq)} bytes, expected 8")
    return int.from_bytes(seq, "big", signed=True), payload


def replay_request(start_seq: int) -> list[bytes]:
    return [b"", start_seq.to_bytes(SEQ_BYTES, "big")]
