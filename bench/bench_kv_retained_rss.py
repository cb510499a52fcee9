"""Peak and steady RSS of what the KV event accounting keeps, under the worst a publisher and API
clients can send it: does it stay within the chart's memory limit?

Two cases, each in a fresh process (its own VmHWM), every batch encoded as vLLM 0.33 sends it
(``wire_encode``) and fed through a stream's real decoding and counting (``StreamCounts``):

* ``worst``: a publisher that names every medium (8 and "other") and KV cache group (16 and
  "other") it can, all of a whole-prefix kind, and fills every memory: each group stores its
  store-time memory's capacity and its removal memory's worth of fresh blocks, removes the
  newest removal memory's worth (held blocks: the GPU groups' removals wait for their offload,
  up to their bound), stores that many fresh again, and stores again a sixteenth of what it
  holds (hashes held twice); every store names one of 256 LoRA adapters in turn (every group
  counts every tenant). ``--streams N``: N such streams on one node, sharing its budget. The
  streams' stats (what the daemon keeps for its snapshot) are held at the end.
* ``salts``: API clients sending ``--salts`` distinct cache salts of 1 MiB each, each a request's
  first block in its own batch.

Reported per case: RSS after the imports and the streams' set-up (base), at the end after a
collection (steady: what is kept), and VmHWM (peak: the seals' transient copies and the largest
batch included), against a stated bound. The numbers of a daemon are its idle RSS (~92 MiB,
docs/performance.md) plus the growth here.

    .venv/bin/python bench/bench_kv_retained_rss.py [--case worst|salts|both] [--streams 1]
        [--salts 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from kvwatch.daemon.config import EnginesConfig
from kvwatch.daemon.engines import stream_counts as sc
from kvwatch.daemon.engines.groups import MAX_GROUPS
from kvwatch.daemon.engines.stream_counts import StreamCounts
from kvwatch.daemon.engines.tenants import TenantNamer
from kvwatch.daemon.lab import wire_encode as we
from kvwatch.daemon.model.engines import OTHER_GROUP, StreamSpec

try:  # absent before the budget: each stream then has its bounds to itself
    from kvwatch.daemon.engines.memory_budget import MemoryBudget
except ImportError:  # pragma: no cover - the bench run on the code before the fix
    MemoryBudget = None  # type: ignore[assignment,misc]

CHART_LIMIT_MIB = 768  # deploy/helm/kvwatch/values.yaml resources.limits.memory
DAEMON_IDLE_MIB = 92  # docs/performance.md: the daemon's idle RSS
TENANTS = 256
EVENTS_PER_BATCH = 64
SPEC = StreamSpec("tcp://127.0.0.1:5557")
LAYOUT = we.Layout.V0_33


def status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def settled_rss() -> float:
    gc.collect()
    return status_mib("VmRSS")


class Feed:
    """Batches for one stream, sent when EVENTS_PER_BATCH events are queued (and at the end)."""

    def __init__(self, counts: StreamCounts) -> None:
        self.counts = counts
        self.enc = msgspec.msgpack.Encoder()
        self.events: list[dict[str, Any]] = []
        self.ts = 1.0  # engine time stays put: removals wait for their offload's judgement

    def add(self, ev: dict[str, Any]) -> None:
        self.events.append(ev)
        if len(self.events) >= EVENTS_PER_BATCH:
            self.flush()

    def flush(self) -> None:
        if self.events:
            self.counts.ingest(we.encode_batch(LAYOUT, self.ts, self.events, 0, self.enc))
            self.events = []


def capacities(counts: StreamCounts) -> list[tuple[str, int, int, int]]:
    """(medium, group, store-time capacity, removal capacity) of every group."""
    out = []
    for name, m in counts.media.items():
        for idx, g in m.groups.items():
            out.append((name, idx, g._stored_at.capacity, g._removed_at.capacity))
    return out


def worst_stream(counts: StreamCounts, first: int) -> int:
    """Name every medium and group, then fill each group's memories; returns the next hash."""
    feed = Feed(counts)
    media = ["GPU", *(f"tier{i}" for i in range(sc.MAX_MEDIA + 1))]  # the last two: "other"
    for medium in media:
        for g in range(MAX_GROUPS + 1):
            feed.add(stored(medium, g, [first], 0))
            first += 1
    feed.flush()
    names = {**{m: m for m in media[: sc.MAX_MEDIA]}, **dict.fromkeys(media[sc.MAX_MEDIA :], "other")}
    caps = {(m, g): (s, r) for m, g, s, r in capacities(counts)}
    filled = set()
    for medium in media:
        for g in range(MAX_GROUPS + 1):
            key = (names[medium], g if g < MAX_GROUPS else OTHER_GROUP)
            key = key if key in caps else (key[0], OTHER_GROUP)  # past the stream's cap
            if key not in filled:
                filled.add(key)
                first = fill_group(feed, (medium, g), caps[key], first)
    feed.flush()
    return first


def stored(medium: str, group: int, hashes: list[int], tenant: int) -> dict[str, Any]:
    return we.stored(
        hashes,
        [],
        medium=medium,
        parent=1,  # after a parent: a GPU store of held blocks is a store again, not a prefix hit
        block_size=16,
        group_idx=group,
        kv_cache_spec_kind="full_attention",
        lora_name=f"adapter-{tenant % TENANTS}",
    )


def fill_group(feed: Feed, where: tuple[str, int], caps: tuple[int, int], first: int) -> int:
    """Fill one group's memories (its store-time and removal capacities ``caps``)."""
    medium, g = where
    cap_s, cap_r = caps

    def store(hashes: list[int]) -> None:
        step = max(len(hashes) // TENANTS, 1)
        for t, i in enumerate(range(0, len(hashes), step)):
            feed.add(stored(medium, g, hashes[i : i + step], t))

    def remove(hashes: list[int]) -> None:
        for i in range(0, len(hashes), 4096):
            feed.add(we.removed(hashes[i : i + 4096], medium=medium, group_idx=g))

    held = list(range(first, first + cap_s + cap_r))
    first += len(held)
    store(held)
    remove(held[-cap_r:] if cap_r else [])  # held blocks removed: judged, waiting for their offload
    fresh = list(range(first, first + cap_r))
    first += len(fresh)
    store(fresh)
    store(held[cap_r : cap_r + cap_s // 16])  # stored again while held: a copy each
    return first


def stream_fields() -> dict[str, Any]:
    return {
        "connected": True,
        "gaps": 0,
        "missed": 0,
        "replayed": 0,
        "lost": 0,
        "restarts": 0,
        "replay_requests": 0,
        "last_seq": 0,
        "last_message_at": 0.0,
    }


def run_worst(streams: int, scale: int) -> dict[str, Any]:
    cfg = EnginesConfig()
    if scale > 1:  # a quick run: every bound and the budget divided by ``scale``
        keys = ("max_tracked_blocks", "regret_memory_rate", "kv_memory_bytes")
        smaller = {k: getattr(cfg, k) // scale for k in keys if hasattr(cfg, k)}
        # a commit before the configuration was msgspec's had pydantic's model_copy
        copy = getattr(cfg, "model_copy", None)
        cfg = copy(update=smaller) if copy is not None else msgspec.structs.replace(cfg, **smaller)
    bounds = (cfg.max_tracked_blocks, cfg.regret_blocks)
    budget_bytes = getattr(cfg, "kv_memory_bytes", None)
    budget = MemoryBudget(budget_bytes) if MemoryBudget is not None and budget_bytes else None
    import kvwatch.daemon.engines.hashmem_sealed  # noqa: F401 - numpy in the base, as in a daemon that sealed

    all_counts = [
        StreamCounts(bounds, 5.0, TenantNamer((), b"k" * 32), *([budget] if budget else [])) for _ in range(streams)
    ]
    base = settled_rss()
    cpu0 = time.process_time()
    first = 1 << 40
    for counts in all_counts:
        first = worst_stream(counts, first)
    kept = [c.stats(SPEC, **stream_fields()) for c in all_counts]  # the snapshot's copies
    steady = settled_rss()
    caps = [x for c in all_counts for x in capacities(c)]
    return {
        "case": "worst",
        "streams": streams,
        "budget_bytes": budget_bytes if budget else None,
        "bounds": bounds,
        "groups": len(caps),
        "capacity_entries": sum(s + r for _, _, s, r in caps),
        "remembered": sum(s.tracked_blocks for s in kept),
        "forgotten": sum(m.stores_forgotten + m.removals_forgotten for s in kept for m in s.media.values()),
        "tenants": max(len(c.book.names) for c in all_counts),
        "base_mib": base,
        "steady_mib": steady,
        "peak_mib": status_mib("VmHWM"),
        "cpu_s": time.process_time() - cpu0,
    }


def run_salts(n: int) -> dict[str, Any]:
    counts = StreamCounts((1_000_000, 524_288), 5.0, TenantNamer((), b"k" * 32))
    enc = msgspec.msgpack.Encoder()

    def batch(i: int, salt: str) -> bytes:
        ev = we.stored([i], list(range(16)), extra_keys=[[salt]])
        return we.encode_batch(LAYOUT, float(i), [ev], 0, enc)

    counts.ingest(batch(0, "warm-up"))
    base = settled_rss()
    cpu0 = time.process_time()
    for i in range(1, n + 1):
        counts.ingest(batch(i, f"{i:08d}" + "x" * ((1 << 20) - 8)))
    steady = settled_rss()
    return {
        "case": "salts",
        "salts": n,
        "salt_bytes": 1 << 20,
        "tenants": len(counts.book.names),
        "base_mib": base,
        "steady_mib": steady,
        "peak_mib": status_mib("VmHWM"),
        "cpu_s": time.process_time() - cpu0,
    }


def in_child(args: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--child", *args], check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def describe(r: dict[str, Any], label: str) -> list[str]:
    growth, peak = r["steady_mib"] - r["base_mib"], r["peak_mib"] - r["base_mib"]
    daemon_peak = DAEMON_IDLE_MIB + peak
    if r["case"] == "worst":
        budget = r["budget_bytes"]
        bound = f"{budget / 2**20:.0f} MiB (engines.kv_memory_bytes)" if budget else "none"
        what = (
            f"{r['streams']} stream(s), {r['groups']} groups in all, bounds {r['bounds'][0]:,} / {r['bounds'][1]:,}; "
            f"budget {bound}; capacity {r['capacity_entries']:,} entries, {r['remembered']:,} remembered at the end, "
            f"{r['forgotten']:,} forgotten; {r['tenants']} tenant names a stream"
        )
    else:
        what = f"{r['salts']} distinct salts of {r['salt_bytes'] // 1024} KiB, {r['tenants']} tenant names"
    return [
        f"| {label} | {r['case']} | {what} | {r['base_mib']:.1f} | {r['steady_mib']:.1f} (+{growth:.1f}) | "
        f"{r['peak_mib']:.1f} (+{peak:.1f}) | {daemon_peak:.0f} of {CHART_LIMIT_MIB} | {r['cpu_s']:.1f} |"
    ]


def report(results: list[dict[str, Any]], label: str) -> str:
    lines = [
        f"# KV event accounting: retained RSS under the worst publisher and salt flood ({label})",
        "",
        f"Host: {platform.node()}, {os.cpu_count()} CPUs, kernel {platform.release()}, Python "
        f"{platform.python_version()}. Each case in a fresh process; RSS from /proc/self/status.",
        "",
        "| code | case | what | base RSS (MiB) | steady RSS (MiB, growth) | peak VmHWM (MiB, growth) | "
        "daemon peak: idle + growth (MiB) | CPU (s) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines += describe(r, label)
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=("worst", "salts", "both"), default="both")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--salts", type=int, default=300)
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--scale", type=int, default=1, help="divide the bounds and the budget by this (a quick run)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        r = run_worst(a.streams, a.scale) if a.case == "worst" else run_salts(a.salts)
        print(json.dumps(r))
        return
    results = []
    if a.case in ("worst", "both"):
        results.append(in_child(["--case", "worst", "--streams", str(a.streams), "--scale", str(a.scale)]))
    if a.case in ("salts", "both"):
        results.append(in_child(["--case", "salts", "--salts", str(a.salts)]))
    text = report(results, a.label)
    print(text)
    print(json.dumps(results))
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
