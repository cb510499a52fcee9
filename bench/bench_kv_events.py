"""KV event subscriber throughput: how many vLLM KV events kvwatch decodes and counts per
second, with what share of one core, and whether it loses any.

A publisher process sends pre-encoded batches in vLLM 0.33's wire format (multipart
[topic, seq, payload], msgspec msgpack) as vLLM's engine would, one batch per
scheduler step: 8 ``BlockStored`` of 4 blocks (64 token ids each) and 16
``BlockRemoved`` of one block (0.33 emits one per evicted block) — 24 events, 48
blocks a batch. The subscriber is kvwatch's own ``KVEventHub`` (one thread) in this
process; CPU is this process's user+system time over the run (the hub is all it does).

Paced runs at increasing batch rates, then one unpaced (as fast as the publisher goes).

    .venv/bin/python bench/bench_kv_events.py --out bench/results/kv_events.md
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import resource
import socket
import time
from pathlib import Path

import zmq

from kvwatch.daemon.engines.kv_events import KVEventHub
from kvwatch.daemon.lab.wire_encode import Layout, encode_batch, removed, stored
from kvwatch.daemon.model.engines import StreamSpec

STORED_PER_BATCH, BLOCKS_PER_STORE, REMOVED_PER_BATCH = 8, 4, 16
EVENTS = STORED_PER_BATCH + REMOVED_PER_BATCH
BLOCKS = STORED_PER_BATCH * BLOCKS_PER_STORE + REMOVED_PER_BATCH


def group_fields(g: int, groups: int) -> dict[str, object]:
    """vLLM 0.26+ tags every event with its KV cache group, and a store with the group's kind:
    a Gemma-3-style layout, the last group full attention, the others sliding-window."""
    if groups <= 1:
        return {}
    full = g == groups - 1
    return {
        "group_idx": g,
        "kv_cache_spec_kind": "full_attention" if full else "sliding_window",
        "kv_cache_spec_sliding_window": None if full else 256,
    }


def tenant_fields(s: int, tenants: int, last: dict[int, int]) -> dict[str, object]:
    """With tenants, store ``s`` is tenant ``s % tenants``'s: the first of a tenant's chain names
    it by its cache salt (a request's first block), the next ones follow its last block."""
    if tenants <= 0:
        return {}
    t = s % tenants
    if t in last:
        return {"parent": last[t]}
    return {"parent": None, "extra_keys": [[f"bench-salt-{t}"]] + [None] * (BLOCKS_PER_STORE - 1)}


def payloads(n: int = 64, groups: int = 1, tenants: int = 0) -> list[bytes]:
    """Every store and removal announced once per group (as vLLM's coordinator does)."""
    out = []
    h = 1 << 40
    last: dict[int, int] = {}  # tenant -> its chain's last block
    for i in range(n):
        evs = []
        for s in range(STORED_PER_BATCH):
            hashes = [h + k for k in range(BLOCKS_PER_STORE)]
            more = tenant_fields(s, tenants, last) or {"parent": h - 1}
            if tenants:
                last[s % tenants] = hashes[-1]
            evs += [stored(hashes, list(range(64)), **more, **group_fields(g, groups)) for g in range(groups)]
            h += BLOCKS_PER_STORE
        for k in range(REMOVED_PER_BATCH):
            evs += [removed([h - 1000 - k], **group_fields(g, groups)) for g in range(groups)]
        out.append(encode_batch(Layout.V0_33, 1.7e9 + i, evs, 0))
    return out


def publisher(
    port: int, rate: float, seconds: float, sync: tuple[mp.Event, mp.Event, mp.Value], shape: tuple[int, int]
) -> None:  # type: ignore[valid-type]
    ready, go, sent = sync
    if os.cpu_count() and os.cpu_count() > 1:  # type: ignore[operator]
        os.sched_setaffinity(0, {1})  # the subscriber has core 0 to itself
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    pub.bind(f"tcp://127.0.0.1:{port}")
    bodies = payloads(groups=shape[0], tenants=shape[1])
    ready.set()
    go.wait()
    seq = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while True:
        now = time.perf_counter()
        if now >= end:
            break
        if rate > 0:
            due = int((now - t0) * rate)
            if seq >= due:
                time.sleep(min(0.0005, (seq + 1) / rate - (now - t0)))
                continue
        pub.send_multipart((b"", seq.to_bytes(8, "big"), bodies[seq % len(bodies)]))
        seq += 1
    sent.value = seq
    time.sleep(0.5)
    pub.close(linger=2000)
    ctx.term()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(rate: float, seconds: float, groups: int = 1, tenants: int = 0) -> dict[str, float]:
    port = free_port()
    ready, go = mp.Event(), mp.Event()
    sent = mp.Value("q", 0)
    proc = mp.get_context("fork").Process(
        target=publisher, args=(port, rate, seconds, (ready, go, sent), (groups, tenants))
    )
    proc.start()
    ready.wait(10)
    hub = KVEventHub()
    spec = StreamSpec(f"tcp://127.0.0.1:{port}")
    hub.set_streams([spec])
    hub.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        st = hub.stats().get(spec)
        if st is not None and st.connected:
            break
        time.sleep(0.05)
    time.sleep(0.5)
    c0, t0 = cpu(), time.monotonic()
    go.set()
    proc.join()
    # drain: until nothing new for 0.5 s
    last, quiet_since = -1, time.monotonic()
    while time.monotonic() - quiet_since < 0.5:
        n = hub.stats()[spec].batches
        if n != last:
            last, quiet_since = n, time.monotonic()
        time.sleep(0.05)
    used = cpu() - c0
    s = hub.stats()[spec]
    wall = s.last_message_at - t0  # to the last batch drained
    hub.close()
    # a repeated body's first store of a tenant (no parent, its last block still held) is announced
    blocks = sum(g.totals.stored + g.totals.removed + g.totals.announced for g in s.groups)
    named = sum(m.stored for by in s.tenants.values() for n, m in by.items() if n != "default")
    return {
        "tenant_blocks": float(named),
        "rate": rate,
        "sent": float(sent.value),
        "received": float(s.batches),
        "lost": float(sent.value - s.batches),
        "gaps": float(s.gaps),
        "wall": wall,
        "cpu": used,
        "batches_per_s": s.batches / wall,
        "events_per_s": s.events / wall,
        "blocks_per_s": blocks / wall,
        "blocks_exact": float(blocks == s.batches * BLOCKS * groups),
    }


def main() -> None:
    os.sched_setaffinity(0, {0})  # the subscriber (this process: hub thread and ZMQ's I/O thread) on one core
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rates", default="2500,5000,10000,20000,0", help="batches/s; 0: unpaced")
    ap.add_argument("--groups", default="1", help="KV cache groups, comma-separated for runs side by side (1,6)")
    ap.add_argument("--tenants", default="0", help="tenants by cache salt, comma-separated for runs side by side (0,3)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = [
        {**run(float(r), args.seconds, int(g), int(t)), "groups": float(g), "tenants": float(t)}
        for r in args.rates.split(",")
        for g in args.groups.split(",")
        for t in args.tenants.split(",")
    ]
    lines = [
        "# KV event subscriber throughput",
        "",
        f"Host: {platform.node()}, {os.cpu_count()} CPUs, kernel {platform.release()}, Python {platform.python_version()}.",
        f"Batch: {EVENTS} events ({STORED_PER_BATCH} BlockStored x {BLOCKS_PER_STORE} blocks, {REMOVED_PER_BATCH} "
        f"BlockRemoved x 1), {BLOCKS} blocks, vLLM 0.33 layout; {args.seconds:g} s per run; publisher in another process.",
        "With G KV cache groups (a hybrid model: the last full attention, the others sliding-window) every event is",
        "announced once per group: G x the events and blocks per batch, each tagged with its group (and a store with",
        "its kind): the same batch rates, G times the blocks.",
        "With T tenants every store is one of T cache-salted tenants' (the first of each names it by its salt, the",
        "next follow their parent): each block's tenant is read at its store and its removal charged to it.",
        "The subscriber process is pinned to one core (taskset-style affinity), the publisher to another.",
        "CPU: the subscriber process's user+system seconds over the run's wall time (1.00 = all of its core).",
        "",
        "| offered batches/s | groups | tenants | received / sent | lost | gaps | batches/s | events/s | blocks/s "
        "| CPU (cores) | blocks/s per core | counts exact | blocks charged to a named tenant |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: | ---: |",
    ]
    for r in rows:
        offered = f"{r['rate']:.0f}" if r["rate"] else "unpaced"
        cores = r["cpu"] / r["wall"]
        lines.append(
            f"| {offered} | {r['groups']:.0f} | {r['tenants']:.0f} | {r['received']:.0f} / {r['sent']:.0f} | "
            f"{r['lost']:.0f} | {r['gaps']:.0f} | {r['batches_per_s']:,.0f} | {r['events_per_s']:,.0f} | "
            f"{r['blocks_per_s']:,.0f} | {cores:.2f} | {r['blocks_per_s'] / cores:,.0f} | "
            f"{'yes' if r['blocks_exact'] else 'NO'} | {r['tenant_blocks']:,.0f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
