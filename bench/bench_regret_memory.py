"""The regret memory under a flood: how far back it remembers, what it costs, and whether a hot
set evicted at the flood's start is counted as regretted when it is stored again at its end.

One medium's accounting (daemon/engines/blocks.py, removals.py) at the defaults is driven with a
flood of new blocks at RATE blocks/s of engine time: each event stores STEP new blocks and removes
the STEP oldest of a resident pool (an engine's GPU pool turning over). At the flood's start the
pool holds a hot set of HOT blocks; the flood evicts them in its first seconds, and HOT_AGAIN
seconds before its end they are stored again. The truth is HOT regretted evictions, if the memory
still holds them; the horizon (seconds of removals remembered) says whether it should.

Then FP_LOOKUPS hashes never removed are looked up in the full memory: each hit is a false
positive (48-bit keys: expected live / 2^48 a lookup).

    .venv/bin/python bench/bench_regret_memory.py [--rates 1000,10000,50000] [--seconds 600] [--out FILE]

Per rate it reports the horizon, the removals remembered and forgotten, the memory's bytes (its
sealed arrays and filter; the open dict at ~100 bytes an entry), the process's RSS growth, the
CPU seconds per second of stream (the share of one core this stream would take), the hot set's
regrets against the truth, and the false positives.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import time
from pathlib import Path

from kvwatch.daemon.config import EnginesConfig
from kvwatch.daemon.engines.blocks import MediumBlocks

STEP = 32
POOL = 65_536
HOT = 23 * 1009  # a prime number of hot blocks, stored again at the flood's end
HOT_AGAIN = 10.0  # seconds before the end
FP_LOOKUPS = 20_000_000
OPEN_ENTRY_BYTES = 100


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(rate: int, seconds: float, rnd: random.Random) -> dict[str, float]:
    cfg = EnginesConfig()
    gc.collect()
    rss0 = rss_mib()
    m = MediumBlocks(cfg.max_tracked_blocks, cfg.regret_blocks)
    hot = [rnd.getrandbits(64) for _ in range(HOT)]
    pool: list[list[int]] = [hot[i : i + STEP] for i in range(0, HOT, STEP)]
    for blocks in pool:
        m.store(blocks, 0.0, 16)
    events = int(rate * seconds / STEP)
    back_at = int(events * (1 - HOT_AGAIN / seconds))
    cpu0 = time.process_time()
    resident = sum(len(b) for b in pool)
    hot_set, truth = set(hot), 0
    for i in range(events):
        ts = 1.0 + i * STEP / rate
        new = [rnd.getrandbits(64) for _ in range(STEP)]
        m.store(new, ts, 16)
        pool.append(new)
        resident += STEP
        while resident > POOL:
            old = pool.pop(0)
            m.remove(old, ts, young_before=ts - 2.0)
            resident -= len(old)
            if i < back_at:
                truth += sum(1 for h in old if h in hot_set)
        if i == back_at:
            m.store(hot, ts, 16)  # the hot blocks the flood evicted are regrets: the truth
    cpu = time.process_time() - cpu0
    t = m.totals()
    mem = m._removed_at
    end = 1.0 + events * STEP / rate
    fp = false_positives(mem, rnd)
    return {
        "rate": rate,
        "seconds": seconds,
        "horizon": mem.horizon(end),
        "remembered": len(mem),
        "forgotten": mem.forgotten,
        "sealed_mib": mem.nbytes / 2**20,
        "open_mib": len(mem._open) * OPEN_ENTRY_BYTES / 2**20,
        "bytes_per_entry": (mem.nbytes + len(mem._open) * OPEN_ENTRY_BYTES) / max(len(mem), 1),
        "rss_growth_mib": rss_mib() - rss0,
        "cpu_per_second": cpu / seconds,
        "regretted": t.regretted,
        "truth": truth,
        "false_positives": fp,
        "lookups": FP_LOOKUPS,
        "expected_fp": len(mem) * FP_LOOKUPS / 2**48,
    }


def false_positives(mem: object, rnd: random.Random) -> int:
    import numpy as np

    gen = np.random.default_rng(rnd.getrandbits(32))
    hits = 0
    for _ in range(FP_LOOKUPS // 100_000):
        fps = gen.integers(0, 2**64, size=100_000, dtype=np.uint64, endpoint=False).tolist()
        hits += mem.count(fps)  # type: ignore[attr-defined]
    return hits


def render(rows: list[dict[str, float]]) -> str:
    out = [
        "# Regret memory: horizon and cost under a flood",
        "",
        f"`bench/bench_regret_memory.py` on {platform.node()} ({os.cpu_count()} CPUs), "
        f"{time.strftime('%Y-%m-%d')}. One stream medium at the defaults (engines.regret_memory_seconds "
        f"{EnginesConfig().regret_memory_seconds:.0f} s x engines.regret_memory_rate "
        f"{EnginesConfig().regret_memory_rate:,} blocks/s = {EnginesConfig().regret_blocks:,} removals); "
        f"a flood of new blocks, {STEP} an event, through a {POOL:,}-block pool; a hot set of {HOT:,} blocks "
        f"evicted in its first seconds and stored again {HOT_AGAIN:.0f} s before its end.",
        "",
        "| blocks/s | stream s | horizon s | remembered | forgotten | memory MiB | bytes/removal | RSS growth MiB "
        "| CPU s per s | hot regrets / truth | false positives / lookups (expected) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['rate']:,} | {r['seconds']:.0f} | {r['horizon']:.0f} | {r['remembered']:,} | {r['forgotten']:,} "
            f"| {r['sealed_mib'] + r['open_mib']:.1f} | {r['bytes_per_entry']:.2f} | {r['rss_growth_mib']:.0f} "
            f"| {r['cpu_per_second']:.3f} | {r['regretted']:,} / {r['truth']:,} "
            f"| {r['false_positives']} / {r['lookups']:,} ({r['expected_fp']:.2f}) |"
        )
    out += [
        "",
        "The horizon is the stream time back to the newest removal forgotten (all of the stream's when",
        "none was): every removal within it is remembered, and a block stored again within it counts.",
        "Memory is the sealed segments (48-bit keys, 16-bit times) and their filter, plus the open dict",
        "at ~100 bytes an entry. CPU s per s: this process's CPU time per second of stream.",
        "",
    ]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="1000,10000,50000")
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rnd = random.Random(23)  # noqa: S311 - a bench's hashes, not secrets
    rows = [run(int(r), args.seconds, rnd) for r in args.rates.split(",")]
    text = render(rows)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
