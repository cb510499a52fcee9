"""``kvwatch record``: a timeline in the Chrome trace-event JSON format (Perfetto, chrome://tracing).

One process track per watched process (and one for the node), with lanes:

* ``CUDA allocations`` — counters: segment allocations and frees per tick, MiB allocated;
* ``KV transfers`` — one duration slice per completed transfer (NIXL post → done), bytes in args;
* ``page cache`` — (node track, per KV tier) pages evicted by reclaim, deleted (policy), refaulted;
* ``reclaim stalls`` — milliseconds stalled in direct and memcg reclaim per tick, pages freed;
* ``KV blocks`` — blocks stored and removed per medium (engine KV event streams);
* ``KV tenants`` — per tenant of the engine's GPU pool: blocks stored, evicted and recomputed
  (regretted), where the KV event stream names tenants (cache salts, LoRA adapters);
* ``KV lost`` — the loss ledger per tier and cause, MiB (blocks while the block size is unknown);
* ``engine latency`` — the engine's own latency histograms from its /metrics, per tick: the
  mean in milliseconds of the observations new in the tick (``ttft ms``, ``e2e ms``,
  ``lmcache retrieve ms``, ``lmcache store ms``, vLLM's NIXL ``nixl xfer ms`` and ``nixl post ms``;
  no sample in a tick without any) and their
  number (``ttft count``, ...), beside the alerts: a reclaimed KV tier shows as slower
  retrieves and first tokens. The engine is scraped every ``engines.scrape_interval_seconds``,
  so a tick holds what the scrapes it saw counted (ticks between scrapes have none);
* ``alerts`` — one slice per alert, onset to clear (or to the end of the recording); a
  KVTenantThrash slice is named for its victim and aggressor.

Counters are counts per tick (the agent's tick, in ``otherData.tick_seconds``), placed at
the start of the tick they describe, so a counter track summed over the trace is the
total for the recording (the engine latency lane's means excepted). Memory is bounded:
past ``max_events`` new events are dropped, counted per kind, and the trace says so (an
instant event on the node track and ``otherData.dropped``), as does the command.

Runs its own probes (root): timestamps of transfer slices come straight from the kernel's
monotonic clock, which the daemon's HTTP view cannot carry. Alerts come from the running
daemon when one answers (``record_daemon.py``: its detectors are warm, the recorder's are not),
else from the recorder's own detectors; ``otherData.alerts_from`` says which.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvwatch.daemon.model.snapshot import Alert, ProcessView, Snapshot
from kvwatch.exporters.record_lanes import (
    LANE_NAMES,
    Lane,
    cuda_totals,
    deltas,
    kv_totals,
    latency_args,
    latency_totals,
    lost_totals,
    reclaim_totals,
    tenant_totals,
)
from kvwatch.probes.records import TransferDone

if TYPE_CHECKING:
    from kvwatch.exporters.loop import Loop
    from kvwatch.exporters.record_daemon import DaemonAlerts

NODE_PID = 0
MIB = 1024 * 1024


@dataclass
class _Alert:
    name: str
    pid: int
    start_us: float
    args: dict[str, Any]


@dataclass
class TraceRecorder:
    """Turns snapshots and transfer completions into trace events, within a bound."""

    t0_ns: int  # CLOCK_MONOTONIC at the start (the kernel's bpf_ktime_get_ns clock)
    t0_wall: float
    max_events: int = 1_000_000
    host: str = field(default_factory=socket.gethostname)
    events: list[dict[str, Any]] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # events kept, by kind
    _named: set[int] = field(default_factory=set)
    _last: dict[tuple[int, str], tuple[float, dict[str, float]]] = field(default_factory=dict)
    _alerts: dict[tuple[str, str], _Alert] = field(default_factory=dict)
    _lost0: dict[str, int] | None = None
    # pid -> (when, regretted blocks per medium, regretting) at the last sample
    _regret: dict[int, tuple[float, dict[str, int], bool]] = field(default_factory=dict)
    lost: dict[str, int] = field(default_factory=dict)
    ended_at: float | None = None  # monotonic seconds of the last sample
    alert_source: str = "own detectors"

    def us(self, monotonic_s: float) -> float:
        return max(0.0, (monotonic_s * 1e9 - self.t0_ns) / 1000.0)

    def _add(self, kind: str, ev: dict[str, Any], *, meta: bool = False) -> bool:
        if not meta and len(self.events) >= self.max_events:
            self.dropped[kind] = self.dropped.get(kind, 0) + 1
            return False
        self.events.append(ev)
        self.counts[kind] = self.counts.get(kind, 0) + 1
        return True

    def _name_process(self, pid: int, name: str) -> None:
        if pid in self._named:
            return
        self._named.add(pid)
        self._add(
            "metadata", {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}, meta=True
        )
        self._add(
            "metadata",
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
            meta=True,
        )
        for tid, lane in LANE_NAMES.items():
            self._add(
                "metadata",
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}},
                meta=True,
            )
            self._add(
                "metadata",
                {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}},
                meta=True,
            )

    def _counter(
        self,
        kind: str,
        *,
        pid: int,
        tid: int,
        name: str,
        now_us: float,
        totals: Mapping[str, float],
        derive: Callable[[Mapping[str, float], Mapping[str, float]], dict[str, float]] = deltas,
    ) -> None:
        """Emit what the totals came to over the tick (by default what each grew by), at the
        last sample's time."""
        key = (pid, name)
        prev = self._last.get(key)
        self._last[key] = (now_us, dict(totals))
        if prev is None:
            return  # the first sample is the baseline (counts before the recording are not its)
        at, before = prev
        args = derive(before, totals)
        self._add(kind, {"ph": "C", "name": name, "pid": pid, "tid": tid, "ts": at, "args": args})

    # --- inputs -----------------------------------------------------------------------------
    def on_snapshot(self, snap: Snapshot, alerts: Sequence[Alert] | None = None) -> None:
        """``alerts``: the running daemon's, when it answers (``record_daemon.py``); else the snapshot's."""
        now_us = self.us(snap.monotonic)
        self._name_process(NODE_PID, f"node {self.host}: KV tiers, node alerts")
        for p in snap.processes:
            lab = p.labels
            who = " ".join(x for x in (lab.get("engine"), lab.get("role"), lab.get("component")) if x)
            where = lab.get("pod") or lab.get("container") or ""
            self._name_process(p.pid, f"{who} pid {p.pid}" + (f" ({where})" if where else ""))
            if p.alive:
                self._process_lanes(p, now_us)
        for tier in snap.tiers:
            t = tier.totals
            self._counter(
                "page_cache",
                pid=NODE_PID,
                tid=Lane.PAGE_CACHE,
                name=f"KV tier {tier.name} pages",
                now_us=now_us,
                totals={
                    "evicted (reclaim)": t.reclaim_pages,
                    "deleted (policy)": t.policy_pages,
                    "refaulted": t.refault_pages,
                },
            )
        self._track_alerts(snap.alerts if alerts is None else alerts, now_us)
        lost = {k: int(v) for k, v in snap.lost.items()}
        if self._lost0 is None:
            self._lost0 = lost
        self.lost = {k: v - self._lost0.get(k, 0) for k, v in lost.items() if v - self._lost0.get(k, 0)}

    def _process_lanes(self, p: ProcessView, now_us: float) -> None:
        cuda = cuda_totals(p)
        if cuda:
            self._counter("cuda", pid=p.pid, tid=Lane.CUDA, name="CUDA segments", now_us=now_us, totals=cuda)
        self._counter("reclaim", pid=p.pid, tid=Lane.RECLAIM, name="reclaim", now_us=now_us, totals=reclaim_totals(p))
        kv = kv_totals(p)
        if kv:
            self._counter("kv_blocks", pid=p.pid, tid=Lane.KV_BLOCKS, name="KV blocks", now_us=now_us, totals=kv)
            self._regret_burst(p, now_us)
        tenants = tenant_totals(p)
        if tenants:
            self._counter(
                "kv_tenants", pid=p.pid, tid=Lane.KV_TENANTS, name="KV tenants", now_us=now_us, totals=tenants
            )
        if p.kv_losses:
            ledger = lost_totals(p)
            self._counter("kv_lost", pid=p.pid, tid=Lane.KV_LOST, name="KV lost", now_us=now_us, totals=ledger)
        latency = latency_totals(p)
        if latency:
            self._counter(
                "engine_latency",
                pid=p.pid,
                tid=Lane.ENGINE_LATENCY,
                name="engine latency",
                now_us=now_us,
                totals=latency,
                derive=latency_args,
            )

    def _regret_burst(self, p: ProcessView, now_us: float) -> None:
        """An instant where an engine begins storing blocks it removed (a tick with regrets after
        one without), at the start of that tick like the counters; the KV blocks lane counts them."""
        totals = {m: t.regretted for m, t in p.engine.media.items()} if p.engine else {}
        prev = self._regret.get(p.pid)
        grew = {m: n - prev[1].get(m, 0) for m, n in totals.items() if prev and n > prev[1].get(m, 0)}
        self._regret[p.pid] = (now_us, totals, bool(grew))
        if prev is not None and grew and not prev[2]:
            args = {f"regretted {m}": n for m, n in sorted(grew.items())}
            event = {"ph": "i", "s": "t", "name": "KV eviction regret", "pid": p.pid, "tid": Lane.KV_BLOCKS}
            self._add("kv_regret", {**event, "ts": prev[0], "args": args})

    def _track_alerts(self, alerts: Sequence[Alert], now_us: float) -> None:
        active = set()
        for a in alerts:
            key = (a.alert, a.subject_key)
            active.add(key)
            if key not in self._alerts:
                pid = int(a.labels["pid"]) if a.labels.get("pid", "").isdigit() else NODE_PID
                start = max(0.0, (a.started_at - self.t0_wall) * 1e6)
                args = {"severity": a.severity, "cause": a.cause, "summary": a.summary, **dict(a.values)}
                name = a.alert
                if a.labels.get("tenant"):  # who hurt whom, on the slice itself
                    name += f" {a.labels.get('aggressor') or '?'} -> {a.labels['tenant']}"
                self._alerts[key] = _Alert(name, pid, min(start, now_us), args)
        for key in [k for k in self._alerts if k not in active]:
            self._close_alert(self._alerts.pop(key), now_us, still_active=False)

    def _close_alert(self, a: _Alert, end_us: float, *, still_active: bool) -> None:
        args = {**a.args, "active at the end of the recording": still_active}
        self._add(
            "alerts",
            {
                "ph": "X",
                "name": a.name,
                "cat": "alert",
                "pid": a.pid,
                "tid": Lane.ALERTS,
                "ts": a.start_us,
                "dur": max(0.0, end_us - a.start_us),
                "args": args,
            },
        )

    def on_transfers(self, done: list[TransferDone]) -> None:
        for d in done:
            start = (d.start_ns - self.t0_ns) / 1000.0
            if start < 0:
                continue  # posted before the recording began
            dur_us = max(0.0, (d.end_ns - d.start_ns) / 1000.0)
            args: dict[str, Any] = {"bytes": d.bytes, "status": d.status}
            if dur_us > 0:
                args["MiB/s"] = round(d.bytes / MIB / (dur_us / 1e6), 1)
            self._name_process(d.tgid, f"pid {d.tgid}")
            self._add(
                "transfers",
                {
                    "ph": "X",
                    "name": f"{d.lib} {d.op}",
                    "cat": "transfer",
                    "pid": d.tgid,
                    "tid": Lane.TRANSFERS,
                    "ts": start,
                    "dur": dur_us,
                    "args": args,
                },
            )

    # --- output -----------------------------------------------------------------------------
    def finish(self, end_monotonic: float, tick_seconds: float) -> dict[str, Any]:
        end_us = self.us(end_monotonic)
        for a in self._alerts.values():
            self._close_alert(a, end_us, still_active=True)
        self._alerts.clear()
        dropped_total = sum(self.dropped.values())
        if dropped_total:
            self._add(
                "note",
                {
                    "ph": "i",
                    "s": "g",
                    "name": f"kvwatch dropped {dropped_total} events (limit {self.max_events})",
                    "pid": NODE_PID,
                    "tid": Lane.ALERTS,
                    "ts": end_us,
                    "args": dict(self.dropped),
                },
                meta=True,
            )
        return {
            "traceEvents": self.events,
            "displayTimeUnit": "ms",
            "otherData": {
                "tool": "kvwatch record",
                "alerts_from": self.alert_source,
                "host": self.host,
                "start_wall_time": self.t0_wall,
                "start_monotonic_ns": self.t0_ns,
                "duration_seconds": round(end_us / 1e6, 3),
                "tick_seconds": tick_seconds,
                "counters": "counts per tick, placed at the start of the tick they describe",
                "events": dict(self.counts),
                "dropped": dict(self.dropped),
                "max_events": self.max_events,
                "kernel_lost": dict(self.lost),
            },
        }


def write_trace(trace: dict[str, Any], output: Path) -> None:
    tmp = output.with_name(output.name + ".tmp")
    with tmp.open("w") as f:
        json.dump(trace, f, separators=(",", ":"))
    tmp.replace(output)


def record(
    loop: Loop,
    duration: float,
    *,
    max_events: int = 1_000_000,
    stop: threading.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
    daemon: DaemonAlerts | None = None,
) -> TraceRecorder:
    """Run the loop for ``duration`` seconds, recording every tick and every completed
    transfer (the loop started); alerts from ``daemon`` when it answers."""
    stop = stop or threading.Event()
    rec = TraceRecorder(t0_ns=time.monotonic_ns(), t0_wall=time.time(), max_events=max_events)
    if daemon is not None:
        rec.alert_source = daemon.description

    def on_tick(snap: Snapshot) -> None:
        rec.on_snapshot(snap, daemon.poll() if daemon is not None else None)
        if clock() * 1e9 - rec.t0_ns >= duration * 1e9:
            stop.set()

    unsubscribe = loop.subscribe(on_tick, rec.on_transfers)
    on_tick(loop.snapshot if loop.snapshot.tick else loop.tick())
    try:
        loop.run(stop)
    finally:
        loop.tick()  # the last partial tick: counts up to the end
        unsubscribe()
        rec.ended_at = clock()
    return rec
