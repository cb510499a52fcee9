"""What a BlockStored's ``extra_keys`` say of its blocks, read from the wire within a bound.

vLLM 0.26 builds each block's entry as the LoRA name, then one ``(mm_hash, offset)`` pair per
multimodal input in the block, then the request's ``cache_salt`` (first block only), then a
digest per prompt-embeddings span (``vllm/v1/core/kv_cache_utils.py``,
``generate_block_hash_extra_keys``); a block without any is ``None``.

The field is kept as the raw msgpack it came as and read here, never decoded into Python
objects as a whole: an entry's items may be any msgpack value, and a list of a million empty
lists is a byte on the wire each but 64 bytes in memory each. So: at most one entry per block
(the array's header is read first), at most MAX_ITEMS items an entry, each item looked at only
for its kind (a string is decoded, a pair or a digest only counted), the entries one at a time.

The salt is a tenant's secret (it isolates its prefix cache): it is kept out of ``repr`` and
must never reach a metric, a log line or a trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

import msgspec

NIL = msgspec.Raw(b"\xc0")  # msgpack nil
MAX_ENTRIES = 1 << 17  # one per block: as many as an event's hashes (wire_structs.MAX_EVENT_HASHES)
MAX_ITEMS = 64  # an entry: LoRA name, salt, and the multimodal inputs and embedding spans of one block

# msgpack type bytes: fixarray, array16, array32 / fixstr, str8, str16, str32 / bin8, bin16, bin32
ARRAY_HEADS = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}
MAP_HEADS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}
_STR_HEADS = frozenset(range(0xA0, 0xC0)) | {0xD9, 0xDA, 0xDB}
_BIN_HEADS = frozenset({0xC4, 0xC5, 0xC6})


class Unreadable(ValueError):
    """The field is not a list of entries kvwatch can read: its blocks count, undescribed."""


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """What one block's entry says."""

    lora: str | None = None
    multimodal: int = 0
    embeds: int = 0
    salt: str | None = field(default=None, repr=False)


NO_EXTRA_KEYS = ExtraKeys()


@dataclass(frozen=True, slots=True)
class BlockKeys:
    """An event's entries, summed: the first block's (a request's first block names its salt)
    and how many blocks have a salt, multimodal inputs, prompt embeddings."""

    first: ExtraKeys
    salted: int = 0
    multimodal: int = 0
    embeds: int = 0


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


_NONE = msgspec.msgpack.Decoder(Annotated[list[None], msgspec.Meta(max_length=MAX_ENTRIES)])
_ENTRIES = msgspec.msgpack.Decoder(Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_ENTRIES)])
_ITEMS = msgspec.msgpack.Decoder(Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_ITEMS)])
_STR = msgspec.msgpack.Decoder(str)


def _entries(raw: msgspec.Raw) -> int | None:
    """How many items the msgpack array ``raw`` says it holds (its header); None: not an array."""
    data = memoryview(raw)
    head = data[0] if data else 0
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    if head in (0xDC, 0xDD) and len(data) >= (3 if head == 0xDC else 5):
        return int.from_bytes(data[1 : 3 if head == 0xDC else 5], "big")
    return None


def block_keys(raw: msgspec.Raw, lora_name: str | None, blocks: int) -> BlockKeys | None:
    """The event's ``extra_keys`` (raw msgpack) for its ``blocks`` blocks; None where no block has
    any. Raises ``Unreadable`` for a field that is not a list of at most one entry per block, an
    entry of more than MAX_ITEMS items or one with a string of invalid UTF-8: so that reading a
    batch's keys costs at most one entry per hash it carries (the hashes are capped)."""
    if raw == NIL:
        return None
    n = _entries(raw)
    if n is None or n > blocks:
        raise Unreadable(f"extra_keys of {n} entries for {blocks} blocks")
    try:
        _NONE.decode(raw)  # vLLM's common case: a list of None, one per block
    except msgspec.ValidationError:
        try:
            entries = _ENTRIES.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError) as err:
            raise Unreadable(str(err)) from None
    except msgspec.DecodeError as err:
        raise Unreadable(str(err)) from None
    else:
        return None
    first = None
    salted = mm = embeds = 0
    last: bytes | None = None
    k = NO_EXTRA_KEYS
    for r in entries:
        data = bytes(r)
        if data != last:  # a LoRA request's blocks all carry the same entry: read once
            k, last = _entry(data, lora_name), data
        if first is None:
            first = k
        salted += k.salt is not None
        mm += k.multimodal > 0
        embeds += k.embeds > 0
    if first is None:
        return None
    return BlockKeys(first, salted, mm, embeds)


def _entry(data: bytes, lora_name: str | None) -> ExtraKeys:
    if not data or data[0] not in ARRAY_HEADS:
        return NO_EXTRA_KEYS  # None, or not a list: says nothing
    try:
        items = _ITEMS.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as err:  # more items than a block has keys
        raise Unreadable(str(err)) from None
    values: list[object] = []
    for it in items:
        head = memoryview(it)[0]
        if head in _STR_HEADS:
            try:
                values.append(_STR.decode(it))
            except msgspec.DecodeError as err:  # invalid UTF-8
                raise Unreadable(str(err)) from None
        elif head in ARRAY_HEADS:
            values.append(())  # a multimodal input: counted, not read
        elif head in _BIN_HEADS:
            values.append(b"")  # a prompt-embeddings digest: counted, not read
        else:
            values.append(None)
    return extra_keys(values, lora_name)
