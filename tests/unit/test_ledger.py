"""The KV loss ledger: blocks and bytes each tier lost, by cause, counted exactly.

Scripted streams over the wire for what the stream itself shows (evictions, offloads the engine
dropped, resets), the ledger for what the loop joins to it (preemption, OOM kills, disk tiers,
the block size), and the real vLLM run's stream against a set computation.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from pathlib import Path
from typing import Any

from kvwatch.daemon.engines.blocks import OFFLOAD_SETTLE_SECONDS, MediumBlocks
from kvwatch.daemon.engines.ledger import FALLBACK_SCRAPES, STABLE_SCRAPES, EngineLedger, LossLedger
from kvwatch.daemon.lab import wire_encode as we
from kvwatch.daemon.model.engines import (
    EngineSample,
    GroupTotals,
    LossTotal,
    MediumTotals,
    StreamSpec,
    StreamStats,
)
from tests.support.kv_scripts import REAL_BLOCK_BYTES, publish_script
from tests.tools.vllm_run_fixtures import uncompact

BS = 16
REAL_RUN = Path(__file__).parents[1] / "fixtures" / "vllm_run" / "pressure.json.gz"


def ledger_script() -> list[tuple[float, list[dict[str, Any]]]]:
    """GPU blocks 100..104 evicted before any offload (not judged); then 53 GPU blocks of which
    29 reach the CPU tier and 7 of those leave it, and 3 blocks generated after them (stored one
    at a time after a parent: an engine offloads prompts only); 42 + 3 GPU blocks evicted, 13
    of them prompt blocks never offloaded; then a reset with 11 GPU and 22 CPU blocks resident."""
    generated = [
        (1002.5 + i / 10, [we.stored([200 + i], [], parent=199 + i if i else 52, block_size=BS)]) for i in range(3)
    ]
    return [
        (1000.0, [we.stored(list(range(100, 105)), [], block_size=BS)]),
        (1001.0, [we.removed(list(range(100, 105)))]),
        (1002.0, [we.stored(list(range(53)), [], block_size=BS)]),
        *generated,
        (1003.0, [we.stored(list(range(29)), [], medium="CPU", block_size=0)]),
        (1004.0, [we.removed(list(range(7)), medium="CPU")]),
        (1005.0, [we.removed([*range(42), 200, 201, 202])]),
        (1006.0, [we.cleared()]),
    ]


def test_stream_counts_evicted_dropped_and_cleared() -> None:
    media = publish_script(ledger_script())
    gpu, cpu = media["GPU"], media["CPU"]
    assert (gpu.removed, gpu.dropped, gpu.cleared, gpu.resident) == (5 + 42 + 3, 13, 11, 0)
    assert (cpu.removed, cpu.dropped, cpu.cleared, cpu.resident) == (7, 0, 22, 0)


def test_blocks_resident_and_known_below() -> None:
    gpu, cpu = MediumBlocks(1000, 1000), MediumBlocks(1000, 1000)
    gpu.store(list(range(23)), 0.0, BS)
    cpu.store(list(range(0, 23, 2)), 0.5, 0)  # 12 of the 23 offloaded
    gpu.remove(list(range(23)), 1.0, 0.0, [cpu])
    gpu.remove([999], 1.0, 0.0, [cpu])  # never seen stored: not judged
    gpu.store([500], 0.0, BS, alone=True)  # a generated block: not offloaded, not judged
    gpu.remove([500], 1.0, 0.0, [cpu])
    gpu.settle(1.0 + OFFLOAD_SETTLE_SECONDS - 0.1, [cpu])
    assert gpu.totals().dropped == 0  # judged only once the offload had time to be announced
    gpu.settle(1.0 + OFFLOAD_SETTLE_SECONDS, [cpu])
    t = gpu.totals()
    assert (t.removed, t.dropped, t.resident) == (25, 11, 0)
    assert cpu.totals().resident == 12


def one_group(media: dict[str, MediumTotals]) -> tuple[GroupTotals, ...]:
    """A single-group engine's streams: each medium's group 0, the kind unsaid (vLLM < 0.26)."""
    return tuple(GroupTotals(m, 0, "", None, True, t) for m, t in media.items())


def stream(gpu: MediumTotals, cpu: MediumTotals | None = None) -> StreamStats:
    media = {"GPU": gpu} if cpu is None else {"GPU": gpu, "CPU": cpu}
    return StreamStats(
        StreamSpec("tcp://127.0.0.1:5557"),
        True,
        1,
        1,
        media,
        0,
        0,
        0,
        0,
        0,
        {},
        0,
        0,
        None,
        0.0,
        0.0,
        0,
        groups=one_group(media),
    )


def test_ledger_splits_preemption_prices_late_and_keeps_disk_bytes() -> None:
    led = EngineLedger()
    led.streams([stream(MediumTotals(100, 23))], None, preempting=False)
    led.streams([stream(MediumTotals(150, 23 + 7))], None, preempting=True)  # 7 while preempting
    led.streams([stream(MediumTotals(150, 30, dropped=3), MediumTotals(40, 2, cleared=5))], None, preempting=False)
    led.tier(1, reclaim_bytes=3 * 4096, policy_bytes=0)
    led.tier(1, reclaim_bytes=5 * 4096, policy_bytes=4096)
    t = led.totals()
    assert t[("gpu", "evicted")] == LossTotal(23, None)  # no block size yet
    assert t[("gpu", "preempted")] == LossTotal(7, None)
    assert t[("cpu", "offload_dropped")] == LossTotal(3, None)
    assert t[("cpu", "evicted")] == LossTotal(2, None) and t[("cpu", "cleared")] == LossTotal(5, None)
    assert t[("disk", "reclaim")] == LossTotal(0, 5 * 4096) and t[("disk", "evicted")] == LossTotal(0, 4096)
    # the engine's offload counter, read every scrape while the stream's CPU blocks run ahead
    # of the copies (by 10 to 45 blocks), always a multiple of 512 KiB: 2931 and 2950 blocks
    # are coprime, and five more changes leave the divisor alone
    gpu = MediumTotals(150, 30, dropped=3)
    copied = (2931, 2950, 2972, 2972, 2997, 3101, 3150, 3198)
    for i, blocks_copied in enumerate(copied):
        assert led.block_bytes.value is None
        more = stream(gpu, MediumTotals(40 + blocks_copied - 2931 + 10 + 5 * i, 2, cleared=5))
        led.streams([more], sample(blocks_copied * 524_288.0, at=float(i)), False)
    t = led.totals()
    assert (led.block_bytes.value, led.block_bytes.source) == (524_288, "offload")
    assert t[("gpu", "evicted")] == LossTotal(23, 23 * 524_288)  # priced once known
    assert t[("gpu", "preempted")] == LossTotal(7, 7 * 524_288)
    assert t[("disk", "reclaim")] == LossTotal(0, 5 * 4096)


def test_transfers_all_of_k_blocks_learn_the_block_not_k() -> None:
    """A fixed-length benchmark: every request offloads 56 blocks, so every count of the offload
    counter is a multiple of 56 blocks. The stream's CPU blocks say how many blocks a divisor
    spans; while one request's copy is still in flight the ratio is no whole number."""
    led = EngineLedger()
    for i in range(1, 80):
        done = 56 * i  # blocks copied; the stream announced the next request's already
        cpu = MediumTotals(56 * (i + 1), 0)
        led.streams([stream(MediumTotals(0, 0), cpu)], sample(done * 524_288.0, at=float(i)), False)
        if led.block_bytes.value is not None:
            break
    assert (led.block_bytes.value, led.block_bytes.source) == (524_288, "offload")
    assert i < STABLE_SCRAPES + 4  # the stream said 56 from its first full request


def test_block_size_from_the_ratio_when_no_divisor_fits() -> None:
    """An engine whose bytes are not whole blocks: the ratio over everything, after
    FALLBACK_SCRAPES scrapes; a scrape read twice is one."""
    led = EngineLedger()
    for i in range(FALLBACK_SCRAPES):
        assert led.block_bytes.value is None
        cpu = MediumTotals(100 * i, 0)
        for _ in range(2):
            led.streams([stream(MediumTotals(0, 0), cpu)], sample(1e9 + i * 100 * 524_300 + i, at=i), False)
    assert (led.block_bytes.value, led.block_bytes.source) == (524_300, "offload_ratio")


def sample(store_bytes: float, at: float = 0.0) -> EngineSample:
    return EngineSample(at=at, offload_store_bytes=store_bytes)


def test_ledger_oom_takes_what_was_resident_and_config_prices() -> None:
    led = EngineLedger(configured_block_bytes=1 << 20)
    led.oom(one_group({"GPU": MediumTotals(resident=23), "CPU": MediumTotals(resident=11)}))
    led.streams([stream(MediumTotals(0, 0), MediumTotals(1000, 0))], sample(5e9), False)
    assert led.block_bytes.source == "config"  # the engine's counter does not override config
    assert led.totals() == {("cpu", "oom"): LossTotal(11, 11 << 20), ("gpu", "oom"): LossTotal(23, 23 << 20)}


def test_real_run_ledger_against_a_set_computation() -> None:
    """vLLM 0.26.0's stream (hot, pressure, hot again; OffloadingConnector): every GPU block the
    window saw stored reached the CPU tier, so none was dropped; the engine's offload bytes over
    its CPU blocks announced are the model's block size."""
    with gzip.open(REAL_RUN, "rt") as f:
        run = json.load(f)
    gpu, cpu = MediumBlocks(1_000_000, 524_288), MediumBlocks(1_000_000, 524_288)
    on_cpu: set[int] = set()
    stored_gpu: set[int] = set()
    expected_dropped = 0
    for _at, _seq, ts, _rank, groups in run["batches"]:
        for kind, medium, bs, ids in uncompact(groups):
            if kind == "S":
                (cpu if medium == "CPU" else gpu).store(ids, ts, bs or 0)
                (on_cpu if medium == "CPU" else stored_gpu).update(ids)
            elif kind == "R" and medium == "CPU":
                cpu.remove(ids, ts, ts - 10)
            elif kind == "R":
                expected_dropped += sum(1 for h in ids if h in stored_gpu and on_cpu and h not in on_cpu)
                gpu.remove(ids, ts, ts - 10, [cpu] if cpu.stored else [])
    assert gpu.totals().removed == run["totals"]["removed"]["GPU"]
    assert gpu.totals().dropped == expected_dropped == 0
    # the block size, learnt from the /metrics pages and the CPU blocks announced between them
    led = EngineLedger()
    cpu_stored, batches = 0, iter(run["batches"])
    pending = next(batches)
    for at, page in run["pages"]:
        while pending is not None and pending[0] <= at:
            cpu_stored += sum(len(ids) for k, m, _bs, ids in uncompact(pending[4]) if k == "S" and m == "CPU")
            pending = next(batches, None)
        m = re.search(r"^vllm:kv_offload_store_bytes_total\{[^}]*\} (\S+)$", page, re.M)
        led.block_bytes.observe(at, float(m.group(1)) if m else None, cpu_stored)
    assert (led.block_bytes.value, led.block_bytes.source) == (REAL_BLOCK_BYTES, "offload")


def test_a_generated_block_stays_unjudged_when_computed_again() -> None:
    """A preempted request computes its prompt and generated blocks again in one event: the
    generated ones keep their mark (never offloaded by design), a new prompt block does not."""
    gpu, cpu = MediumBlocks(1000, 1000), MediumBlocks(1000, 1000)
    gpu.store([1, 2, 3], 0.0, BS)
    cpu.store([1, 2, 3], 0.1, 0)
    for i, h in enumerate((7, 8)):
        gpu.store([h], 1.0 + i, BS, alone=True)
    gpu.remove([1, 2, 3, 7, 8], 5.0, 0.0, [cpu])  # preempted, evicted
    gpu.store([1, 2, 3, 7, 8, 9], 6.0, BS)  # computed again; 9 a prompt block never offloaded
    gpu.remove([1, 2, 3, 7, 8, 9], 9.0, 0.0, [cpu])
    gpu.settle(100.0, [cpu])
    t = gpu.totals()
    assert (t.regretted, t.dropped, t.removed_young) == (5, 1, 2 + 6)  # young: stored after 0.0, abs() of a mark


def test_an_offload_announced_after_the_removal_is_no_drop() -> None:
    """A preempted request's blocks leave the GPU while their copy to the CPU tier is in flight:
    the tier announces them a moment later. Judged after OFFLOAD_SETTLE_SECONDS, none dropped;
    a block whose copy never comes is."""
    gpu, cpu = MediumBlocks(1000, 1000), MediumBlocks(1000, 1000)
    gpu.store([1, 2, 3, 4, 5, 6, 7], 0.0, BS)
    cpu.store([9], 0.0, 0)
    gpu.remove([1, 2, 3, 4, 5, 6, 7], 1.0, 0.0, [cpu])
    cpu.store([1, 2, 3, 4, 5, 6], 1.5, 0)  # 7 never comes
    gpu.settle(1.0 + OFFLOAD_SETTLE_SECONDS, [cpu])
    assert gpu.totals().dropped == 1


def test_a_usable_divisor_is_waited_for() -> None:
    """A steady engine offloads seldom: its counter changes every few scrapes. The ratio is not
    used meanwhile (it would price the first blocks wrong): the divisor settles first."""
    led = EngineLedger()
    copied = [2931, 2950, 2972, 2997, 3101, 3150]  # 2931 and 2950 coprime; then 4 more changes
    for i in range(5 * len(copied)):
        assert led.block_bytes.value is None, i
        cpu = MediumTotals(40 + 7 * i, 0)  # announcements run ahead: the ratio is far off
        led.streams([stream(MediumTotals(0, 0), cpu)], sample(copied[i // 5] * 524_288.0, at=i), False)
    last = stream(MediumTotals(0, 0), MediumTotals(300, 0))
    led.streams([last], sample(3198 * 524_288.0, at=30), False)  # the fifth change that keeps it
    assert (led.block_bytes.value, led.block_bytes.source) == (524_288, "offload")


def test_a_non_finite_or_negative_engine_counter_never_stops_the_ledger() -> None:
    """The parse boundary drops such samples (engines/metrics.py); the ledger holds on its own:
    an engine's +Inf offload counter (int() of it raised OverflowError every tick) or a
    non-finite disk-tier byte count is skipped, that engine's losses go on counting, and so do
    every other engine's, whose ledgers the loop fills after it."""
    bad, good = LossLedger(), EngineLedger()
    gpu = stream(MediumTotals(100, 23), MediumTotals(40, 2))
    for i, hostile in enumerate((math.inf, -math.inf, math.nan, -5e9, 1e300)):
        bad.of("a").streams([gpu], sample(hostile, at=float(i)), preempting=False)
        bad.of("a").tier(1, reclaim_bytes=-hostile if hostile > 0 else hostile, policy_bytes=math.nan)
        good.streams([gpu], sample(1e9, at=float(i)), preempting=False)
    assert bad.rows("a")[("gpu", "evicted")] == LossTotal(23, None)
    assert bad.block_bytes("a") is None and ("disk", "reclaim") not in bad.rows("a")
    bad.of("a").streams([stream(MediumTotals(130, 30), MediumTotals(40, 2))], sample(2e9, at=9.0), False)
    bad.of("a").tier(1, reclaim_bytes=4096.0, policy_bytes=0.0)
    assert bad.rows("a")[("gpu", "evicted")] == LossTotal(30, None)
    assert bad.rows("a")[("disk", "reclaim")] == LossTotal(0, 4096.0)
    assert good.totals()[("gpu", "evicted")] == LossTotal(23, None)
