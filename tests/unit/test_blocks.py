"""One medium's blocks (``engines/blocks.py``, on ``engines/hashmem.py``): removals young by the
engine's own timestamps, and eviction regret (a block hash stored again after the engine removed
it), counted exactly.

Scripted streams with a known answer: per medium, the regretted blocks, the tokens they
imply (block_size each), the time from removal to store again (histogram), what a reset
forgets, and what a full memory drops (counted).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from kvwatch.daemon.config import EnginesConfig
from kvwatch.daemon.engines.blocks import OFFLOAD_SETTLE_SECONDS, MediumBlocks
from kvwatch.daemon.engines.hashmem import HashMemory
from kvwatch.daemon.lab import wire_encode as we
from kvwatch.daemon.model.engines import REGRET_BUCKETS
from tests.support.kv_scripts import publish_script, script_stats
from tests.tools.vllm_run_fixtures import uncompact

BS = 16  # tokens per block
REAL_RUN = Path(__file__).parents[1] / "fixtures" / "vllm_run" / "pressure.json.gz"  # see test_daemon_vllm_replay.py


def bucket(seconds: float) -> int:
    return next((i for i, le in enumerate(REGRET_BUCKETS) if seconds <= le), len(REGRET_BUCKETS))


def test_young_removals_from_engine_timestamps() -> None:
    t0 = 1_000_000.0
    s = script_stats(
        [
            (t0, [we.stored(list(range(10)), list(range(160)))]),
            (t0 + 1.0, [we.removed([0, 1, 2])]),  # 1 s old: young (thrash_seconds 5)
            (t0 + 60.0, [we.removed([3, 4])]),  # a minute old: not young
            (t0 + 61.0, [we.removed([999])]),  # never seen stored: not young
            (t0 + 62.0, [we.cleared()]),
            (t0 + 62.5, [we.removed([5])]),  # the reset forgot its store time
        ],
        thrash_seconds=5.0,
    )
    m = s.media["GPU"]
    assert (s.batches, m.stored, m.removed, m.removed_young) == (6, 10, 7, 3)
    assert s.cleared == 1


def test_regret_counted_with_tokens_and_time_to_store_again() -> None:
    m = MediumBlocks(max_stored=1000, max_removed=1000)
    m.store(list(range(40)), 0.0, BS)
    m.remove(list(range(30)), 10.0, young_before=0.0)
    m.store(list(range(7)), 10.5, BS)  # 7 back after 0.5 s
    m.store(list(range(7, 18)), 100.0, BS)  # 11 back after 90 s
    m.store(list(range(40, 45)), 100.0, BS)  # new hashes: no regret
    m.store(list(range(7)), 101.0, BS)  # stored again while resident: not a second regret
    m.clear()  # a reset forgets: 18..29 stored after it are not regrets
    m.store(list(range(18, 30)), 102.0, BS)
    m.remove([18, 19, 20, 21, 22], 103.0, young_before=0.0)
    m.store([18, 19, 20, 21, 22], 113.0, 32)  # 5 back after 10 s, bigger blocks
    t = m.totals()
    assert t.regretted == 7 + 11 + 5 == 23
    assert t.regret_tokens == 18 * BS + 5 * 32
    assert t.regret_seconds == 7 * 0.5 + 11 * 90.0 + 5 * 10.0
    expected = [0] * (len(REGRET_BUCKETS) + 1)
    for seconds, n in ((0.5, 7), (90.0, 11), (10.0, 5)):
        expected[bucket(seconds)] += n
    assert t.regret_buckets == tuple(expected)
    assert (t.stored, t.removed) == (40 + 7 + 11 + 5 + 7 + 12 + 5, 30 + 5)
    assert (t.stores_forgotten, t.removals_forgotten) == (0, 0)


def test_a_full_memory_forgets_the_oldest_removals_and_counts_them() -> None:
    m = MediumBlocks(max_stored=10_000, max_removed=100)
    m.store(list(range(131)), 0.0, BS)
    m.remove(list(range(131)), 1.0, young_before=0.0)  # over 100: the oldest tenth goes, then more
    forgotten = m.totals().removals_forgotten
    assert forgotten > 0 and m.remembered == 131 - forgotten <= 100
    m.store(list(range(131)), 2.0, BS)
    t = m.totals()
    assert t.regretted == 131 - forgotten  # each remembered removal, none of the forgotten
    assert t.removals_forgotten == forgotten


def test_no_regret_memory_no_regret() -> None:
    m = MediumBlocks(max_stored=100, max_removed=0)
    m.store([1, 2, 3], 0.0, BS)
    m.remove([1, 2, 3], 1.0, young_before=0.0)
    m.store([1, 2, 3], 2.0, BS)
    assert (m.totals().regretted, m.totals().removals_forgotten, m.remembered) == (0, 0, 3)


def regret_script() -> list[tuple[float, list[dict[str, Any]]]]:
    """(engine ts, events): 23 regretted GPU blocks, 11 CPU ones, and stores that are not regrets."""
    return [
        (1000.0, [we.stored(list(range(50)), [], block_size=BS)]),
        (1001.0, [we.stored(list(range(50)), [], medium="CPU", block_size=BS)]),
        (1002.0, [we.removed(list(range(40)))]),
        (1003.0, [we.stored(list(range(23)), [], block_size=BS)]),  # 23 GPU regrets after 1 s
        (1004.0, [we.removed(list(range(11)), medium="CPU")]),
        (1064.0, [we.stored(list(range(11)), [], medium="CPU", block_size=BS)]),  # 11 CPU regrets after 60 s
        (1065.0, [we.cleared()]),
        (1066.0, [we.stored(list(range(23, 40)), [], block_size=BS)]),  # after a reset: none
    ]


def test_regret_over_the_wire_per_medium() -> None:
    media = publish_script(regret_script())
    gpu, cpu = media["GPU"], media["CPU"]
    assert (gpu.regretted, gpu.regret_tokens, gpu.regret_seconds) == (23, 23 * BS, 23.0)
    assert (cpu.regretted, cpu.regret_tokens, cpu.regret_seconds) == (11, 11 * BS, 11 * 60.0)
    assert gpu.regret_buckets[bucket(1.0)] == 23 and cpu.regret_buckets[bucket(60.0)] == 11


def test_hash_memory_across_generations_and_its_bound() -> None:
    """Entries move from the dict into the sorted numpy arrays a generation (a seal) at a time;
    lookups find them there; past the capacity the oldest generations go, live entries counted."""
    mem = HashMemory(1600)  # the dict seals every 100 entries
    for g in range(10):
        mem.put([g * 100 + i for i in range(100)], float(g))
    assert len(mem) == 1000 and mem.forgotten == 0
    assert sorted(mem.take([5, 250, 999, 12_345])) == [0.0, 2.0, 9.0]  # generations 0, 2, 9; one never put
    assert mem.take([5]) == [] and len(mem) == 997  # taken once
    for g in range(10, 23):
        mem.put([g * 100 + i for i in range(100)], float(g))
    # 23 generations, at most 1,500 entries sealed: 0..7 went, 798 of them live (5 and 250 taken);
    # 8..22 hold 1,500, 999 taken
    assert (len(mem), mem.forgotten) == (1499, 798)
    assert sorted(mem.take([250, 799, 800, 2299])) == [8.0, 22.0]
    mem.clear()
    assert len(mem) == 0 and mem.take([2299]) == []


def test_hash_memory_bytes_hashes_and_puts_again() -> None:
    mem = HashMemory(64)  # seals every 32
    blocks = [bytes([i]) * 32 for i in range(23)]
    mem.put(blocks, 1.0)
    mem.put(blocks[:3], 2.0)  # put again: the newest time answers
    assert sorted(mem.take(blocks[:3])) == [2.0, 2.0, 2.0]
    assert sorted(mem.take(blocks[3:])) == [1.0] * 20
    assert HashMemory(0).take(blocks) == []


def test_real_run_regrets_need_the_default_memory() -> None:
    """The real vLLM run's hot prefixes came back after ~385,000 removals: the default memory
    holds them (480 regrets), a memory of 100,000 removals forgets them all (and says how many it
    forgot)."""
    with gzip.open(REAL_RUN, "rt") as f:
        batches = json.load(f)["batches"]
    default = EnginesConfig()

    def regretted(removals: int) -> tuple[int, int]:
        m = MediumBlocks(default.max_tracked_blocks, removals)
        for _at, _seq, ts, _rank, groups in batches:
            for kind, medium, bs, ids in uncompact(groups):
                if medium in (None, "GPU"):
                    if kind == "S":
                        m.store(ids, ts, bs or 0)
                    elif kind == "R":
                        m.remove(ids, ts, ts - 10)
        return m.totals().regretted, m.totals().removals_forgotten

    assert regretted(default.regret_blocks) == (480, 0)
    small, forgotten = regretted(100_000)
    assert small < 480 and forgotten > 0


def test_removals_waiting_for_their_offload_are_bounded_by_the_groups_memory() -> None:
    """A GPU group keeps at most a sixteenth of its store-time memory of removals waiting for the
    tier below (each ~50 bytes): past it they are judged at once, not kept."""
    cpu = MediumBlocks(1000, 1000)
    cpu.store([1 << 50], 0.0, 16)  # the tier below has stored something: removals are judged
    small, large = MediumBlocks(32_768, 0), MediumBlocks(1_000_000, 0)
    blocks = list(range(1, 10_001))
    for m in (small, large):
        m.store(blocks, 1.0, 16)
        m.remove(blocks, 1.0, 0.0, [cpu])  # none reached the tier below; the judgement waits 5 s
    assert (small.dropped, large.dropped) == (10_000, 0)  # 10,000 > 32,768 / 16: judged at once
    large.settle(1.0 + OFFLOAD_SETTLE_SECONDS, [cpu])
    assert large.dropped == 10_000
