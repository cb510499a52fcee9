"""Memory of the KV event accounting under a fast stream: does the daemon's RSS stay bounded?

The hub keeps, per stream and medium, two memories of block hashes (store times for young
removals, recent removals for regrets: daemon/engines/blocks.py, hashmem.py), bounded by
``engines.max_tracked_blocks`` and ``engines.regret_memory_seconds`` x ``_rate``. This drives that
accounting with the defaults at a stream rate of 1M blocks/s of engine time: each step
stores 32 new blocks and removes the 32 oldest of a resident pool (vLLM's GPU pool turning
over), and every 50th store brings back a block removed a while ago (a regret). RSS is read
from /proc/self/statm as the stream goes; the memories fill and then stay put, so the
growth after they are full is the number that matters.

    .venv/bin/python bench/bench_kv_memory.py [--seconds 600] [--offload] [--out FILE]

``--offload`` models vLLM with its OffloadingConnector: the same rate of blocks announced,
half of them GPU stores and half the CPU tier's stores of the same blocks (a CPU pool four
times the GPU's, evicting its oldest), each GPU removal checked against the CPU tier (the
loss ledger's offload drops): two media's memories in one stream.

``--groups N`` models a hybrid model (vLLM announces every block range once per KV cache group):
N groups in each medium, the last full attention, the others sliding-window, at the same 1M
blocks/s announced in all (so each group's share of the blocks is 1/N).

``--step N`` stores and removes N blocks an event (32 by default; 1 is the worst case for the
per-call costs: vLLM announces each block that fills during decoding in an event of its own).

``--seconds`` is stream time at 1M blocks/s; the run takes as long as this process needs to
account that many blocks (it reports its own blocks/s of CPU, too).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import time
from pathlib import Path

from kvwatch.daemon.config import EnginesConfig
from kvwatch.daemon.engines.groups import MediumGroups
from kvwatch.daemon.model.engines import MediumTotals

RATE = 1_000_000  # blocks per second of stream
STEP = 32  # blocks stored (and removed) per event
POOL = 65_536  # resident blocks (a GPU pool's worth)
BACK_AFTER = 100_000  # removals before a regretted block comes back


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _slots(lo: int, back_at: dict[int, int], *, last: bool, step: int) -> list[int]:
    """The hashes of a step's slots, a block that came back in the first: each leaves the pool
    it was stored in (a memory that never sees its removal would keep it as resident)."""
    hashes = list(range(lo, lo + step))
    if lo in back_at:
        hashes[0] = back_at.pop(lo) if last else back_at[lo]
    return hashes


def kind(g: int, groups: int) -> tuple[str, int | None]:
    """A Gemma-3-style layout: the last group full attention, the others sliding-window."""
    return ("full_attention", None) if g == groups - 1 else ("sliding_window", 256)


def media(groups: int, offload: bool) -> tuple[MediumGroups, MediumGroups | None]:
    cfg = EnginesConfig()
    bounds = (cfg.max_tracked_blocks, cfg.regret_blocks)
    gpu = MediumGroups(bounds)
    cpu = MediumGroups(bounds, like=gpu) if offload else None
    for g in range(groups):
        gpu.group(g)
        gpu.learn(g, *kind(g, groups), None)
        if cpu is not None:
            cpu.group(g)
    return gpu, cpu


def run(
    seconds: float, samples: int, offload: bool = False, groups: int = 1, step: int = STEP
) -> tuple[list[tuple[float, float, float]], dict[str, int], float, float]:
    gpu, cpu = media(groups, offload)
    # hashes are consecutive integers: the resident pools are windows [nxt - pool, nxt), so the
    # benchmark itself holds nothing per block and the RSS growth is the accounting's alone
    nxt = 1 << 62
    first = nxt
    total = int(seconds * RATE)
    per_step = step * groups * (2 if offload else 1)  # every group announces the step's blocks
    steps = total // per_step
    every = max(steps // samples, 1)
    gc.collect()
    base = rss_mib()
    curve = []
    cpu0, t0 = time.process_time(), time.perf_counter()
    back_at: dict[int, int] = {}  # slot -> the old hash stored there (removed with its slot)
    for i in range(steps):
        ts = i * per_step / RATE
        new = list(range(nxt, nxt + step))
        back = nxt - POOL - BACK_AFTER
        if i % 50 == 0 and back > first:
            new[0] = back_at[nxt] = back  # a block removed ~100,000 removals ago comes back
        nxt += step
        cpu_out = nxt - first > 4 * POOL
        gpu_out = nxt - first > POOL
        for g in range(groups):
            last = g == groups - 1
            m = gpu.group(g)
            m.store(new, ts, 16)
            if cpu is not None:
                c = cpu.group(g)
                c.store(new, ts, 0)
                if cpu_out:
                    c.remove(_slots(nxt - 4 * POOL - step, back_at, last=last, step=step), ts, ts - 10.0)
            if gpu_out:
                lower = [cpu.group(g)] if cpu is not None and gpu.is_full(g) else []
                m.remove(_slots(nxt - POOL - step, back_at, last=last and cpu is None, step=step), ts, ts - 10.0, lower)
        if i % every == 0 or i == steps - 1:
            remembered = gpu.remembered + (cpu.remembered if cpu is not None else 0)
            curve.append((ts, rss_mib() - base, remembered))
    used, wall = time.process_time() - cpu0, time.perf_counter() - t0
    t = MediumTotals()
    for mg in (gpu, cpu):
        for g in mg.totals("") if mg is not None else []:
            t = t + g.totals
    totals = {
        "stored": t.stored,
        "removed": t.removed,
        "regretted": t.regretted,
        "dropped": t.dropped,
        "stores_forgotten": t.stores_forgotten,
        "removals_forgotten": t.removals_forgotten,
    }
    return curve, totals, used, wall


def report(
    seconds: float,
    curve: list[tuple[float, float, float]],
    totals: dict[str, int],
    cpu: float,
    offload: bool,
    *,
    groups: int = 1,
    step: int = STEP,
) -> str:
    cfg = EnginesConfig()
    media = (
        f"two media (GPU, and a CPU tier of {4 * POOL:,} blocks storing each GPU block; every GPU removal "
        "checked against it)"
        if offload
        else "one medium"
    )
    if groups > 1:
        media += (
            f", {groups} KV cache groups each (a Gemma-3-style hybrid: {groups - 1} sliding-window groups and a "
            "full-attention one, every block announced once per group; the full-attention group remembers as "
            "much as a single group would, the others share one more such bound)"
        )
    title = " (GPU + CPU tier)" if offload else ""
    title += f" ({groups} KV cache groups)" if groups > 1 else ""
    lines = [
        "# KV event accounting memory under a 1M blocks/s stream" + title,
        "",
        f"Host: {platform.node()}, {os.cpu_count()} CPUs, kernel {platform.release()}, "
        f"Python {platform.python_version()}.",
        f"Defaults: max_tracked_blocks {cfg.max_tracked_blocks:,}, regret memory "
        f"{cfg.regret_blocks:,}; one stream, {media}; {step} blocks stored and {step} removed per "
        f"event, a pool of {POOL:,} resident blocks, every 50th store a block removed ~100,000 removals ago.",
        f"Stream time {seconds:.0f} s at {RATE:,} blocks/s: {totals['stored']:,} blocks stored, "
        f"{totals['removed']:,} removed, {totals['regretted']:,} regretted, {totals['dropped']:,} offloads dropped; "
        f"forgotten: "
        f"{totals['stores_forgotten']:,} store times, {totals['removals_forgotten']:,} removals.",
        f"Accounting CPU: {cpu:.1f} s, {totals['stored'] / cpu / 1e6:.2f} M stored blocks per CPU second "
        "(each also removed once), this process alone (no decoding).",
        "",
        "| stream time (s) | RSS growth (MiB) | hashes remembered |",
        "| ---: | ---: | ---: |",
    ]
    lines += [f"| {ts:.0f} | {mib:.1f} | {n:,} |" for ts, mib, n in curve]
    peak = max(mib for _, mib, _ in curve)
    bound = "64 MiB" if groups == 1 else "128 MiB: twice one group's"
    lines += ["", f"Peak RSS growth: {peak:.1f} MiB (bound: {bound})."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--offload", action="store_true", help="a CPU tier beside the GPU pool")
    ap.add_argument("--groups", type=int, default=1, help="KV cache groups (6: a Gemma-3-style hybrid)")
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--step", type=int, default=STEP, help="blocks per event (1: a stream announcing one block an event)"
    )
    a = ap.parse_args()
    curve, totals, cpu, _wall = run(a.seconds, a.samples, a.offload, a.groups, a.step)
    text = report(a.seconds, curve, totals, cpu, a.offload, groups=a.groups, step=a.step)
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
