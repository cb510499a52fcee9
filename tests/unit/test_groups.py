"""KV cache groups: a hybrid model's blocks counted per (stream, medium, group), the medium's
logical counts following its reference group, prefix-hit announcements, and the whole vLLM 0.26
event schema decoded (group kinds, locality, LoRA, extra keys) without a salt ever leaving.

Scripted streams shaped as vLLM 0.26 announces a Gemma-3-style model (one full-attention group,
sliding-window groups of 256 tokens): every block range once per group, the group's kind and
window on each store, removals with the group only.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvwatch.daemon.engines import wire as w
from kvwatch.daemon.engines.blocks import MediumBlocks
from kvwatch.daemon.engines.groups import MAX_GROUPS, MediumGroups
from kvwatch.daemon.lab import wire_encode as we
from kvwatch.daemon.model.engines import OTHER_GROUP, GroupTotals, StreamStats
from tests.support.kv_scripts import script_stats

BS = 16
SW = ("sliding_window", 256)
FULL = ("full_attention", None)
GEMMA3 = (FULL, SW, SW, SW, SW, SW)  # group 0 full attention, five sliding-window groups


def per_group(
    hashes: list[int], groups: tuple[tuple[str, int | None], ...], parent: int | None = None, **more: Any
) -> list[dict[str, Any]]:
    """One block range announced once per group, as vLLM's coordinator caches it."""
    return [
        we.stored(
            hashes,
            list(range(len(hashes) * BS)),
            parent=parent,
            group_idx=i,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
            **more,
        )
        for i, (kind, window) in enumerate(groups)
    ]


def gone(hashes: list[int], groups: range) -> list[dict[str, Any]]:
    return [we.removed(hashes, group_idx=i) for i in groups]


def group(s: StreamStats, medium: str, idx: int) -> GroupTotals:
    return next(g for g in s.groups if g.medium == medium and g.group == idx)


def test_one_range_in_six_groups_is_six_blocks_not_five_restored() -> None:
    """The false page: the same hash in six groups counted as stored again while held (5 of 6)."""
    script = [
        (100.0, per_group(list(range(23)), GEMMA3)),
        (101.0, per_group(list(range(23, 23 + 23)), GEMMA3, parent=22)),
        (102.0, gone(list(range(10)), range(1, 6))),  # the sliding groups free what left their window
        (103.0, gone(list(range(5)), range(1))),
    ]
    s = script_stats(script)
    gpu = s.media["GPU"]
    assert (gpu.stored, gpu.removed, gpu.restored, gpu.resident) == (46, 5, 0, 41)  # group 0, logical
    for i in range(1, 6):
        g = group(s, "GPU", i)
        assert (g.kind, g.sliding_window, g.reference) == ("sliding_window", 256, False)
        assert (g.totals.stored, g.totals.removed, g.totals.restored, g.totals.resident) == (46, 10, 0, 36)
    ref = group(s, "GPU", 0)
    assert (ref.kind, ref.reference, ref.full) == ("full_attention", True, True)
    assert sum(g.totals.stored for g in s.groups) == 6 * 46  # physical: every group's blocks


def test_stored_again_while_held_is_counted_within_its_group() -> None:
    script = [
        (100.0, per_group(list(range(10)), (FULL, SW))),
        (101.0, per_group(list(range(4, 10)), (FULL, SW), parent=3)),  # recomputed while held: 6 per group
        (102.0, gone(list(range(10)), range(2))),
        (103.0, per_group(list(range(3)), (FULL, SW))),  # back after removal: 3 regretted per group
    ]
    s = script_stats(script)
    for i in range(2):
        t = group(s, "GPU", i).totals
        assert (t.stored, t.restored, t.removed, t.regretted, t.regret_tokens) == (19, 6, 10, 3, 3 * BS)
    assert s.media["GPU"].restored == 6 and s.media["GPU"].regretted == 3


def test_prefix_hits_announced_again_are_not_stores() -> None:
    """kv_cache_report_mode "full": the hit's blocks re-announced from the first, no parent, per group
    (a sliding-window group's include blocks it no longer holds): counted announced, nothing else."""
    script = [
        (100.0, per_group(list(range(20)), (FULL, SW))),
        (101.0, gone(list(range(4)), range(1, 2))),  # the window group freed the prefix's head
        (102.0, per_group(list(range(20)), (FULL, SW))),  # a 20-block hit, announced
        (102.0, per_group(list(range(20, 26)), (FULL, SW), parent=19)),  # the rest, computed
        (103.0, per_group([0, 1, 2], (FULL, SW))),  # the sliding group lost 0..3: a real store there
    ]
    s = script_stats(script)
    full, sliding = group(s, "GPU", 0).totals, group(s, "GPU", 1).totals
    assert (full.stored, full.announced, full.restored, full.regretted) == (26, 20 + 3, 0, 0)
    assert (sliding.stored, sliding.announced, sliding.restored, sliding.regretted) == (29, 20, 0, 3)
    assert s.media["GPU"].announced == 23 and s.media["GPU"].stored == 26


def test_sliding_window_only_model_follows_its_only_group() -> None:
    s = script_stats([(100.0, per_group(list(range(8)), (SW,))), (101.0, gone([0, 1], range(1)))])
    g = group(s, "GPU", 0)
    assert g.reference and not g.full and s.media["GPU"].removed == 2


def test_logical_counts_stay_monotonic_when_the_full_group_shows_up_late() -> None:
    """Removals of groups whose kind is not said yet, then stores saying group 0 is a window."""
    script = [
        (100.0, [we.removed([1, 2, 3], group_idx=0)]),  # kind unknown: group 0 is the reference
        (101.0, per_group(list(range(10, 15)), (SW, FULL))),  # group 0 slides, group 1 is full
        (102.0, [we.removed([10, 11], group_idx=0), we.removed([10], group_idx=1)]),
    ]
    s = script_stats(script)
    gpu = s.media["GPU"]
    assert (gpu.removed, gpu.stored, gpu.resident) == (3 + 1, 5, 4)  # 3 while group 0 led, then group 1's
    assert [g.group for g in s.groups if g.reference] == [1]


def test_other_media_keep_their_groups_and_locality() -> None:
    cpu = [
        we.stored([h], [], medium="CPU", block_size=0, group_idx=0, locality="LOCAL") for h in range(5)
    ]  # the offloading connector's placeholders
    fs = [we.stored([7], [], medium="FS", block_size=0, group_idx=0, locality="REMOTE")]
    s = script_stats([(100.0, per_group(list(range(5)), (FULL, SW))), (101.0, cpu + fs)])
    assert s.localities == {"CPU": "LOCAL", "FS": "REMOTE"}
    assert s.media["CPU"].stored == 5 and group(s, "CPU", 0).totals.stored == 5


def test_a_tier_below_takes_the_pools_group_kinds() -> None:
    """The offloading connector's placeholders name their group only: a hybrid model's CPU tier
    follows the GPU pool's full-attention group, whichever index the groups came in."""
    groups = (SW, SW, FULL)
    cpu = [we.stored([h], [], medium="CPU", block_size=0, group_idx=g) for g in (1, 0, 2) for h in range(4)]
    s = script_stats([(100.0, per_group(list(range(4)), groups)), (100.5, cpu)])
    ref = [g for g in s.groups if g.medium == "CPU" and g.reference]
    assert [(g.group, g.kind) for g in ref] == [(2, "full_attention")]
    assert group(s, "CPU", 0).kind == "sliding_window" and s.media["CPU"].stored == 4


def test_offload_drop_is_judged_per_group_and_only_where_whole_prefixes_live() -> None:
    """A full-attention block removed from the GPU and never offloaded was dropped; a sliding
    group's block leaving without an offload is its window at work."""
    cpu = [we.stored([h], [], medium="CPU", block_size=0, group_idx=0) for h in range(6)]
    script = [
        (100.0, per_group(list(range(10)), (FULL, SW))),
        (100.5, cpu),  # 6 of the 10 offloaded, for group 0
        (101.0, gone(list(range(10)), range(2))),
        (120.0, []),  # later than the offload's settling time
    ]
    s = script_stats(script)
    assert group(s, "GPU", 0).totals.dropped == 4 and group(s, "GPU", 1).totals.dropped == 0


def test_a_group_past_the_cap_is_other() -> None:
    mg = MediumGroups((100, 100))
    for i in range(MAX_GROUPS + 3):
        mg.group(i).store([i], 0.0, BS)
    t = mg.totals("GPU")
    other = [g for g in t if g.group == OTHER_GROUP]
    assert len(t) == MAX_GROUPS + 1 and len(other) == 1 and other[0].totals.stored == 3


def test_extra_keys_counted_and_the_salt_never_shown() -> None:
    salt = "tenant-secret-8c1f"
    first = [["my-adapter", ["mm-hash-1", 0], salt], None, [b"\x01" * 32]]
    evs = per_group([1, 2, 3], (FULL, SW), lora_name="my-adapter", extra_keys=first)
    s = script_stats([(100.0, evs)])
    assert s.extras == {"lora": 3, "cache_salt": 1, "multimodal": 1, "prompt_embeds": 1}  # reference group only
    k = w.extra_keys(first[0], "my-adapter")
    assert (k.lora, k.multimodal, k.salt) == ("my-adapter", 1, salt)
    assert salt not in repr(k) and salt not in repr(s)


def test_newer_fields_and_types_never_break_a_batch() -> None:
    """A newer release: a field kvwatch does not know, a group_idx that is not an int, an event
    type it does not know. Blocks are counted; what could not be read is counted by kind."""
    enc = msgspec.msgpack.Encoder()
    events = [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [],
         "block_size": 16, "medium": "GPU", "group_idx": 0, "kv_cache_spec_kind": "full_attention",
         "pinned_until": 12.5},
        {"type": "BlockStored", "block_hashes": [3, 4], "parent_block_hash": 2, "token_ids": [],
         "block_size": 16, "medium": "GPU", "group_idx": "g0"},
        {"type": "BlockPinned", "block_hashes": [9]},
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": {"id": 0}},
    ]  # fmt: skip
    payload = enc.encode([100.0, events, None])
    dec = w.Decoder()
    b = dec.decode(payload)
    assert (len(b.events), b.skipped, b.undescribed) == (3, 1, 2)
    assert [len(e.block_hashes) for e in b.events] == [2, 2, 1]
    assert all(e.group_idx in (0, None) for e in b.events if not isinstance(e, w.CLEARED))


def test_a_hash_held_in_two_blocks_stays_held_until_both_go() -> None:
    """A hybrid model's full-attention group computes a prefix again while it holds it (the window
    group had lost its tail): vLLM keeps both blocks under one hash and removes them one by one."""
    m = MediumBlocks(1000, 1000)
    m.store([1, 2, 3], 0.0, BS)
    m.store([1, 2, 3], 1.0, BS)  # a second copy of each
    m.remove([1, 2], 2.0, young_before=0.0)  # one copy of 1 and 2 goes: still held
    m.store([1], 3.0, BS)  # stored while held again, not a regret
    t = m.totals()
    assert (t.restored, t.regretted, t.resident) == (4, 0, 5)  # 1 and 3 in two blocks each
    m.remove([1, 2, 3], 4.0, young_before=0.0)  # 2's last copy; 1 and 3 keep one
    m.remove([1, 3], 4.0, young_before=0.0)  # their last copies
    m.store([1, 2, 3], 5.0, BS)
    t = m.totals()
    assert (t.removed, t.regretted, t.resident) == (7, 3, 3)
