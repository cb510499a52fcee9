"""vLLM's KV event wire format, encoded exactly as each vLLM release does: for the simulated engine,
the test publishers and the benchmarks (``kvwatch run`` only decodes: ``engines/wire.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Any

import msgspec

from kvwatch.daemon.engines.wire import Hash


class Layout(StrEnum):
    V0_9 = "0.9"  # array events; no medium (0.9.2)
    V0_11 = "0.11"  # array events with medium (0.11.0)
    V0_26 = "0.26"  # array batch, map events (0.26.0: what the H200 validation ran)
    V0_33 = "0.33"  # array batch, map events, more optional fields (0.33.0)


def _structs(layout: Layout) -> dict[str, type[msgspec.Struct]]:
    """The event classes as that vLLM release declares them (names are the tags)."""
    arr = layout in (Layout.V0_9, Layout.V0_11)

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=arr, omit_defaults=True, gc=False, tag=True):
        pass

    if layout is Layout.V0_9:

        class BlockStored(KVCacheEvent):
            block_hashes: list[Any]
            parent_block_hash: Any
            token_ids: list[int]
            block_size: int
            lora_id: int | None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[Any]

    elif layout is Layout.V0_11:

        class BlockStored(KVCacheEvent):  # type: ignore[no-redef]
            block_hashes: list[Any]
            parent_block_hash: Any
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None

        class BlockRemoved(KVCacheEvent):  # type: ignore[no-redef]
            block_hashes: list[Any]
            medium: str | None

    else:  # map events; a map's header counts the fields a struct could have: the exact set per release

        class BlockStored(KVCacheEvent):  # type: ignore[no-redef]
            block_hashes: list[Any]
            parent_block_hash: Any
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None
            extra_keys: list[Any] | None = None
            group_idx: int | None = None
            kv_cache_spec_kind: str | None = None
            kv_cache_spec_sliding_window: int | None = None
            locality: str | None = None

        class BlockRemoved(KVCacheEvent):  # type: ignore[no-redef]
            block_hashes: list[Any]
            medium: str | None
            group_idx: int | None = None
            locality: str | None = None

        if layout is Layout.V0_33:  # 0.26's fields, then those 0.33 appended
            stored_026, removed_026 = BlockStored, BlockRemoved

            class BlockStored(stored_026):  # type: ignore[no-redef, valid-type, misc]
                ownership: str | None = None
                session_id: str | None = None
                lookahead_token_ids: list[list[int]] | None = None

            class BlockRemoved(removed_026):  # type: ignore[no-redef, valid-type, misc]
                ownership: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return {
        "EventBatch": EventBatch,
        "BlockStored": BlockStored,
        "BlockRemoved": BlockRemoved,
        "AllBlocksCleared": AllBlocksCleared,
    }


_STRUCTS: dict[Layout, dict[str, type[msgspec.Struct]]] = {}


def encode_batch(
    layout: Layout,
    ts: float,
    events: Iterable[Mapping[str, Any]],
    data_parallel_rank: int | None = None,
    encoder: msgspec.msgpack.Encoder | None = None,
) -> bytes:
    """Encode events given as ``{"type": "BlockStored", field: value, ...}`` exactly as that
    vLLM release does (fields it does not have are dropped)."""
    classes = _STRUCTS.get(layout)
    if classes is None:
        classes = _STRUCTS[layout] = _structs(layout)
    built = []
    for ev in events:
        cls = classes[ev["type"]]
        fields = cls.__struct_fields__
        built.append(cls(**{k: v for k, v in ev.items() if k in fields}))
    batch = classes["EventBatch"](ts=ts, events=built, data_parallel_rank=data_parallel_rank)
    return (encoder or msgspec.msgpack.Encoder()).encode(batch)


def stored(
    hashes: Sequence[Hash],
    token_ids: Sequence[int],
    *,
    medium: str | None = "GPU",
    parent: Hash | None = None,
    block_size: int | None = None,
    **more: Any,
) -> dict[str, Any]:
    """A ``BlockStored``; vLLM's offloading connector announces CPU blocks as placeholders:
    one hash, no tokens, ``block_size`` 0. ``more``: the fields of newer releases
    (``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``, ``locality``,
    ``lora_name``, ``extra_keys``), kept where the layout has them."""
    if block_size is None:
        block_size = len(token_ids) // max(len(hashes), 1)
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        **more,
    }


def removed(hashes: Sequence[Hash], *, medium: str | None = "GPU", **more: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium, **more}


def cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}
