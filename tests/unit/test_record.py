"""`kvwatch record`'s trace building, from hand-built snapshots: format, counts, spans, the bound."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from kvwatch.daemon.model.engines import (
    EnginePlan,
    EngineView,
    LatencyReading,
    LossTotal,
    MediumTotals,
    StreamSpec,
    StreamStats,
    TenantRow,
    TenantsView,
)
from kvwatch.daemon.model.snapshot import (
    Alert,
    Snapshot,
)
from kvwatch.exporters.record import LANE_NAMES, MIB, Lane, TraceRecorder, write_trace
from kvwatch.probes.records import TransferDone
from tests.support.snapshots import T0_NS, T0_WALL, snap
from tests.support.trace_format import problems


def alert(start_wall: float) -> Alert:
    return Alert(
        "KVCacheReuseCollapse", "7@1", {"pid": "7"}, "empty_cache", "warning", start_wall, {"ratio": 37.0}, "s"
    )


def test_counters_slices_and_spans() -> None:
    rec = TraceRecorder(t0_ns=T0_NS, t0_wall=T0_WALL, host="h")
    rec.on_snapshot(snap(5.0, 100, 0))  # baseline: what came before is not the recording's
    rec.on_snapshot(snap(6.0, 123, 50, (alert(T0_WALL + 0.5),)))
    rec.on_transfers(
        [
            TransferDone(7, "nixl", "write", 8 << 20, T0_NS + 1_000_000, T0_NS + 3_000_000, 0),
            TransferDone(7, "nixl", "write", 8 << 20, T0_NS - 1, T0_NS + 10, 0),  # posted before: left out
        ]
    )
    rec.on_snapshot(snap(7.0, 130, 80))  # the alert cleared
    trace = rec.finish(7.5, 1.0)
    assert problems(trace) == []
    ev = trace["traceEvents"]
    cuda = [e for e in ev if e["ph"] == "C" and e["name"] == "CUDA segments"]
    assert [(e["ts"], e["args"]["allocs"]) for e in cuda] == [(0.0, 23), (1e6, 7)]  # at the start of each tick
    assert sum(e["args"]["allocs"] for e in cuda) == 30 and cuda[0]["args"]["alloc_mib"] == 46.0
    tier = [e for e in ev if e["ph"] == "C" and e["pid"] == 0]
    assert [e["args"]["evicted (reclaim)"] for e in tier] == [50, 30]
    (x,) = [e for e in ev if e["ph"] == "X" and e["cat"] == "transfer"]
    assert (x["pid"], x["tid"], x["ts"], x["dur"], x["args"]["bytes"]) == (7, Lane.TRANSFERS, 1000.0, 2000.0, 8 << 20)
    assert x["args"]["MiB/s"] == 4000.0
    (a,) = [e for e in ev if e["ph"] == "X" and e["cat"] == "alert"]
    assert (a["pid"], a["tid"], a["ts"], a["dur"]) == (7, Lane.ALERTS, 500_000.0, 1_500_000.0)
    assert a["args"]["cause"] == "empty_cache" and a["args"]["active at the end of the recording"] is False
    names = {(e["pid"], e["args"]["name"]) for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert (7, "vllm decode pid 7 (ns/p)") in names and (0, "node h: KV tiers, node alerts") in names
    lanes = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 7}
    assert lanes == {*LANE_NAMES.values()} >= {"CUDA allocations", "KV transfers", "page cache", "reclaim stalls"}
    assert trace["otherData"]["dropped"] == {}


def test_alert_still_active_at_the_end() -> None:
    rec = TraceRecorder(t0_ns=T0_NS, t0_wall=T0_WALL, host="h")
    rec.on_snapshot(snap(5.0, 0, 0, (alert(T0_WALL - 30),)))  # began before the recording
    trace = rec.finish(6.0, 1.0)
    (a,) = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert (a["ts"], a["dur"], a["args"]["active at the end of the recording"]) == (0.0, 1e6, True)


def test_bound_drops_and_says_so(tmp_path: Path) -> None:
    rec = TraceRecorder(t0_ns=T0_NS, t0_wall=T0_WALL, host="h", max_events=50)
    rec.on_snapshot(snap(5.0, 0, 0))
    kept_before = len(rec.events)
    rec.on_transfers([TransferDone(7, "nixl", "write", 1, T0_NS + i, T0_NS + i + 5, 0) for i in range(100)])
    trace = rec.finish(6.0, 1.0)
    assert problems(trace) == []
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert 0 < len(slices) == 50 - kept_before
    assert trace["otherData"]["dropped"] == {"transfers": 100 - len(slices)}
    (note,) = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert note["name"] == f"kvwatch dropped {100 - len(slices)} events (limit 50)"
    out = tmp_path / "t.json"
    write_trace(trace, out)
    assert json.loads(out.read_text()) == trace and not (tmp_path / "t.json.tmp").exists()


def test_checker_catches_bad_traces() -> None:
    assert problems({"nope": 1}) == ["not the JSON object form: no traceEvents list"]
    bad = {
        "traceEvents": [
            {"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0},
            {"ph": "C", "name": "c", "pid": 1, "ts": 0, "args": {"v": "x"}},
            {"ph": "Q", "name": "q", "pid": 1},
            {"ph": "B", "name": "b", "pid": 1, "tid": 2, "ts": 1},
        ]
    }
    assert len(problems(bad)) == 4


def test_an_instant_where_regret_begins() -> None:
    """The KV blocks lane counts regretted blocks per tick; one instant marks each burst's start."""

    def with_regret(t: float, regretted: int) -> Snapshot:
        s = snap(t, 100, 0)
        stats = StreamStats(
            StreamSpec("tcp://127.0.0.1:5557"), True, 1, 1, {"GPU": MediumTotals(500, 300, 0, regretted)},
            0, 0, 0, 0, 0, {}, 0, 0, None, 0.0, 0.0, 0,
        )  # fmt: skip
        view = EngineView(EnginePlan("7@1", 7), (stats,), None, None, None)
        return replace(s, processes=(replace(s.processes[0], engine=view),))

    rec = TraceRecorder(t0_ns=T0_NS, t0_wall=T0_WALL, host="h")
    for t, regretted in ((5.0, 4), (6.0, 4), (7.0, 11), (8.0, 23), (9.0, 23), (10.0, 29)):
        rec.on_snapshot(with_regret(t, regretted))
    trace = rec.finish(10.5, 1.0)
    assert problems(trace) == []
    ev = trace["traceEvents"]
    lane = [e["args"]["regretted GPU"] for e in ev if e["ph"] == "C" and e["name"] == "KV blocks"]
    assert lane == [0, 7, 12, 0, 6] and sum(lane) == 29 - 4
    instants = [(e["ts"], e["args"]) for e in ev if e["ph"] == "i" and e["name"] == "KV eviction regret"]
    assert instants == [(1e6, {"regretted GPU": 7}), (4e6, {"regretted GPU": 6})]  # two bursts


def test_kv_lost_lane_per_tier_and_cause() -> None:
    """The ledger's lane: MiB lost per tick by tier and cause, blocks while the size is unknown."""

    def with_losses(t: float, evicted_mib: int, dropped_blocks: int) -> Snapshot:
        s = snap(t, 100, 0)
        losses = {
            ("gpu", "evicted"): LossTotal(evicted_mib * 2, evicted_mib * float(MIB)),
            ("cpu", "offload_dropped"): LossTotal(dropped_blocks, None),
        }
        return replace(s, processes=(replace(s.processes[0], kv_losses=losses),))

    rec = TraceRecorder(t0_ns=T0_NS, t0_wall=T0_WALL, host="h")
    for t, mib, dropped in ((5.0, 3, 0), (6.0, 10, 5), (7.0, 33, 5), (8.0, 33, 23)):
        rec.on_snapshot(with_losses(t, mib, dropped))
    trace = rec.finish(8.5, 1.0)
    assert problems(trace) == []
    lane = [e for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == "KV lost"]
    assert {e["tid"] for e in lane} == {Lane.KV_LOST}
    assert [e["args"]["gpu evicted MiB"] for e in lane] == [7, 23, 0]
    assert [e["args"]["cpu offload_dropped blocks"] for e in lane] == [5, 0, 18]


def test_tenant_lane_and_the_noisy_neighbour_slice() -> None:
    """Per tenant of the GPU pool, blocks stored, evicted and recomputed per tick; a KVTenantThrash
    slice named for aggressor and victim."""

    def with_tenants(t: float, a_regretted: int, b_stored: int, alerts: tuple[Alert, ...] = ()) -> Snapshot:
        s = snap(t, 100, 0, alerts)
        rows = (
            TenantRow("tenant-a", "GPU", 10, a_regretted, 0, a_regretted, 16 * a_regretted, 5),
            TenantRow("tenant-b", "GPU", b_stored, 0, 0, 0, 0, 50),
            TenantRow("tenant-b", "CPU", 3, 0, 0, 0, 0, 3),  # a lower tier: not on the pool's lane
        )
        view = TenantsView(rows, {}, labelled=2, folded=0, overflow=0)
        return replace(s, processes=(replace(s.processes[0], kv_tenants=view),))

    thrash = Alert(
        "KVTenantThrash", "7@1/tenant:tenant-a", {"pid": "7", "tenant": "tenant-a", "aggressor": "tenant-b"},
        "noisy_neighbour", "warning", T0_WALL + 6.5, {}, "s",
    )  # fmt: skip
    rec = TraceRecorder(t0_ns=T0_NS, t0_wall=T0_WALL, host="h")
    for t, regretted, stored, alerts in ((5.0, 0, 100, ()), (6.0, 0, 400, ()), (7.0, 23, 900, (thrash,))):
        rec.on_snapshot(with_tenants(t, regretted, stored, alerts))
    trace = rec.finish(8.0, 1.0)
    assert problems(trace) == []
    lane = [e for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == "KV tenants"]
    assert {e["tid"] for e in lane} == {Lane.KV_TENANTS} and LANE_NAMES[Lane.KV_TENANTS] == "KV tenants"
    assert [e["args"]["stored tenant-b"] for e in lane] == [300, 500]
    assert [e["args"]["recomputed tenant-a"] for e in lane] == [0, 23]
    assert all("stored tenant-b CPU" not in e["args"] for e in lane)
    (slice_,) = [e for e in trace["traceEvents"] if e.get("cat") == "alert"]
    assert slice_["name"] == "KVTenantThrash tenant-b -> tenant-a"


def test_engine_latency_lane_means_per_tick() -> None:
    """The engine's latency histograms per tick: the mean in ms of the tick's new observations and
    their count; no mean in a tick without any; a histogram the engine does not export is absent."""

    def with_latency(t: float, ttft: tuple[float, float], retrieve: tuple[float, float]) -> Snapshot:
        s = snap(t, 100, 0)
        readings = (LatencyReading("ttft", *ttft), LatencyReading("lmcache_retrieve", *retrieve))
        view = EngineView(EnginePlan("7@1", 7), (), None, None, None, latencies=readings)
        return replace(s, processes=(replace(s.processes[0], engine=view),))

    rec = TraceRecorder(t0_ns=T0_NS, t0_wall=T0_WALL, host="h")
    ticks = (
        (5.0, (1.5, 12.0), (0.1, 16.0)),  # the baseline
        (6.0, (1.9, 16.0), (0.1, 16.0)),  # 4 first tokens in 0.4 s; no retrieve
        (7.0, (1.9, 16.0), (0.7, 20.0)),  # no request; 4 retrieves in 0.6 s (a reclaimed tier)
        (8.0, (0.3, 2.0), (0.7, 20.0)),  # the engine restarted: its 2 since are the tick's
    )
    for t, ttft, retrieve in ticks:
        rec.on_snapshot(with_latency(t, ttft, retrieve))
    trace = rec.finish(8.5, 1.0)
    assert problems(trace) == []
    lane = [e for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == "engine latency"]
    assert {e["tid"] for e in lane} == {Lane.ENGINE_LATENCY} and LANE_NAMES[Lane.ENGINE_LATENCY] == "engine latency"
    assert [e["ts"] for e in lane] == [0.0, 1e6, 2e6]
    assert [e["args"] for e in lane] == [
        {"ttft count": 4, "ttft ms": 100.0, "lmcache retrieve count": 0},
        {"ttft count": 0, "lmcache retrieve count": 4, "lmcache retrieve ms": 150.0},
        {"ttft count": 2, "ttft ms": 150.0, "lmcache retrieve count": 0},
    ]


def test_no_engine_latency_lane_without_histograms() -> None:
    rec = TraceRecorder(t0_ns=T0_NS, t0_wall=T0_WALL, host="h")
    for t in (5.0, 6.0):
        s = snap(t, 100, 0)
        view = EngineView(EnginePlan("7@1", 7), (), None, None, None)
        rec.on_snapshot(replace(s, processes=(replace(s.processes[0], engine=view),)))
    trace = rec.finish(6.5, 1.0)
    assert not [e for e in trace["traceEvents"] if e["ph"] == "C" and e["tid"] == Lane.ENGINE_LATENCY]
