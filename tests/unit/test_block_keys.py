"""A BlockStored's ``extra_keys`` read from the raw msgpack (``engines/block_keys.py``): what
vLLM puts there, read as before; what a hostile engine could put there, refused or read within
its bound."""

from __future__ import annotations

import tracemalloc
from typing import Any

import msgspec
import pytest

from kvwatch.daemon.engines.block_keys import BlockKeys, ExtraKeys, Unreadable, block_keys


def raw(value: Any) -> msgspec.Raw:
    return msgspec.Raw(msgspec.msgpack.encode(value))


def test_vllms_entries_read_as_vllm_builds_them() -> None:
    """0.26's order: the LoRA name, (mm_hash, offset) pairs, the salt (first block), digests."""
    keys = [["adapter", ["mm-1", 0], "salt-a", b"\x01" * 32], ["adapter", ["mm-1", 16]], ["adapter"], None]
    got = block_keys(raw(keys), "adapter", 4)
    assert got == BlockKeys(ExtraKeys("adapter", 1, 1, "salt-a"), salted=1, multimodal=2, embeds=1)
    assert block_keys(raw([None, None, None]), None, 3) is None  # vLLM's common case
    assert block_keys(msgspec.Raw(b"\xc0"), None, 3) is None


@pytest.mark.parametrize(
    "value",
    [
        [["a"]] * 3,  # more entries than blocks
        "not a list",
        [["x"] * 65],  # more items than a block has keys
        [[msgspec.Raw(b"\xa2\xff\xfe")]],  # a salt of invalid UTF-8
    ],
    ids=["entries", "not-a-list", "items", "utf8"],
)
def test_a_field_kvwatch_cannot_read_is_refused(value: Any) -> None:
    with pytest.raises(Unreadable):
        block_keys(raw(value), None, 2 if value != [["x"] * 65] else 1)


def test_entries_are_read_one_at_a_time_within_the_blocks_bound() -> None:
    """131,072 entries of 8 empty lists each: 9 bytes each on the wire, ~570 bytes each as Python
    lists (75 MiB); read one at a time, never all at once."""
    n = 1 << 17
    entry = b"\x98" + b"\x90" * 8
    field = msgspec.Raw(b"\xdd" + n.to_bytes(4, "big") + entry * n)
    tracemalloc.start()
    try:
        got = block_keys(field, None, n)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == BlockKeys(ExtraKeys(multimodal=8), multimodal=n)  # lists read as multimodal pairs
    assert peak < 12 << 20, peak  # the entries' raw views (56 bytes each), not their values
