"""Eviction regret: a block hash stored again after the engine removed it, counted exactly.

Scripted streams with a known answer: per medium, the regretted blocks, the tokens they
imply (block_size each), the time from removal to store again (histogram), what a reset
forgets, and what a full memory drops (counted).
"""

from __future__ import annotations

from typing import Any

from kvwatch.daemon.engines import wire as w
from kvwatch.daemon.engines.blocks import MediumBlocks
from kvwatch.daemon.engines.kv_events import KVEventHub
from kvwatch.daemon.engines.records import REGRET_BUCKETS, StreamSpec
from kvwatch.daemon.lab.vllm_publisher import WirePublisher

from tests.privileged.helpers import free_port, wait_until
from tests.unit.test_kv_events import connected, stats_of

BS = 16  # tokens per block


def bucket(seconds: float) -> int:
    return next((i for i, le in enumerate(REGRET_BUCKETS) if seconds <= le), len(REGRET_BUCKETS))


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
        (1000.0, [w.stored(list(range(50)), [], block_size=BS)]),
        (1001.0, [w.stored(list(range(50)), [], medium="CPU", block_size=BS)]),
        (1002.0, [w.removed(list(range(40)))]),
        (1003.0, [w.stored(list(range(23)), [], block_size=BS)]),  # 23 GPU regrets after 1 s
        (1004.0, [w.removed(list(range(11)), medium="CPU")]),
        (1064.0, [w.stored(list(range(11)), [], medium="CPU", block_size=BS)]),  # 11 CPU regrets after 60 s
        (1065.0, [w.cleared()]),
        (1066.0, [w.stored(list(range(23, 40)), [], block_size=BS)]),  # after a reset: none
    ]


def test_regret_over_the_wire_per_medium() -> None:
    hub = KVEventHub(thrash_seconds=5.0, replay_timeout_seconds=1.0)
    hub.start()
    port = free_port()
    spec = StreamSpec(f"tcp://127.0.0.1:{port}")
    pub = WirePublisher(f"tcp://*:{port}")
    try:
        hub.set_streams([spec])
        connected(hub, spec, pub)
        script = regret_script()
        for ts, events in script:
            pub.publish(events, ts=ts)
        assert pub.flush()
        wait_until(lambda: stats_of(hub, spec).batches == len(script), 10, "every batch")
        media = stats_of(hub, spec).media
        gpu, cpu = media["GPU"], media["CPU"]
        assert (gpu.regretted, gpu.regret_tokens, gpu.regret_seconds) == (23, 23 * BS, 23.0)
        assert (cpu.regretted, cpu.regret_tokens, cpu.regret_seconds) == (11, 11 * BS, 11 * 60.0)
        assert gpu.regret_buckets[bucket(1.0)] == 23 and cpu.regret_buckets[bucket(60.0)] == 11
    finally:
        pub.close()
        hub.close()
