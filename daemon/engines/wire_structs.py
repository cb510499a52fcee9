"""The msgspec shapes kvwatch decodes vLLM's KV event batches with (``wire.py`` decodes and checks):
only what kvwatch uses is materialised, and every array an engine fills has a cap, checked at
the array's header before its items exist.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvwatch.daemon.engines.block_keys import NIL

MAX_EVENT_HASHES = 1 << 17
MAX_BATCH_EVENTS = 1 << 18
MAX_HASH_BYTES = 64

WireHash = int | Annotated[bytes, msgspec.Meta(max_length=MAX_HASH_BYTES)]
Hashes = Annotated[list[WireHash], msgspec.Meta(max_length=MAX_EVENT_HASHES)]


# Fields that describe a block rather than count it (its KV cache group, the group's attention
# kind, LoRA and extra keys, where the tier lives) are typed leniently at a second try: a newer
# release that changes one of their types loses that description, never the blocks (counted).
# ``parent_block_hash`` and ``extra_keys`` stay raw msgpack here and are read once the batch has
# decoded (``Decoder._stored``); ``token_ids`` and ``lora_id`` are never read.


class AStored(msgspec.Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: Hashes
    parent_block_hash: msgspec.Raw
    token_ids: msgspec.Raw
    block_size: int
    lora_id: msgspec.Raw
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: msgspec.Raw = NIL
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class ARemoved(msgspec.Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: Hashes
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None


class ACleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


class MStored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: Hashes
    parent_block_hash: msgspec.Raw = NIL
    block_size: int = 0
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: msgspec.Raw = NIL  # per block: None, or that block's keys (``block_keys.py``)
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class MRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: Hashes
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None


class MCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


class LStored(msgspec.Struct, tag="BlockStored", gc=False):
    """The lenient second try of a map event: what counts it, nothing that describes it."""

    block_hashes: Hashes
    parent_block_hash: msgspec.Raw = NIL
    medium: str | None = None


class LRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: Hashes
    medium: str | None = None


AEvent = AStored | ARemoved | ACleared
MEvent = MStored | MRemoved | MCleared
LEvent = LStored | LRemoved | MCleared
AEvents = Annotated[list[AEvent], msgspec.Meta(max_length=MAX_BATCH_EVENTS)]
MEvents = Annotated[list[MEvent], msgspec.Meta(max_length=MAX_BATCH_EVENTS)]
RawEvents = Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_BATCH_EVENTS)]

REMOVED = (ARemoved, MRemoved)
CLEARED = (ACleared, MCleared)


class ABatchA(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: AEvents
    data_parallel_rank: int | None = None


class ABatchM(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: MEvents
    data_parallel_rank: int | None = None


class MBatchA(msgspec.Struct, gc=False):
    ts: float
    events: AEvents
    data_parallel_rank: int | None = None


class MBatchM(msgspec.Struct, gc=False):
    ts: float
    events: MEvents
    data_parallel_rank: int | None = None


class ABatchRaw(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: RawEvents
    data_parallel_rank: int | None = None


class MBatchRaw(msgspec.Struct, gc=False):
    ts: float
    events: RawEvents
    data_parallel_rank: int | None = None
