"""`kvwatch top`'s model and plain rendering, from hand-built snapshots with known numbers."""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import msgspec
import pytest

from kvwatch.daemon.families.cuda import API_CLASSES as CUDA_API_CLASSES
from kvwatch.daemon.model.engines import EnginePlan, EngineView, TenantRow, TenantsView
from kvwatch.daemon.model.snapshot import (
    Alert,
    CudaView,
    MemoryCounters,
    ProbeView,
    ProcessRates,
    ProcessView,
    Snapshot,
    TierCounters,
    TierRates,
    TierView,
    TransferView,
)
from kvwatch.exporters.top import ViewState, print_once
from kvwatch.exporters.top_model import TopFrame, build_frame, decode, encode
from kvwatch.probes.records import ApiCounters

MIB = 1 << 20


def proc(pid: int, engine: str = "vllm", **kw: Any) -> ProcessView:
    labels = {
        "pid": str(pid),
        "engine": engine,
        "role": kw.pop("role", ""),
        "component": "",
        "container": "",
        "pod": "",
    }
    labels["pod"] = kw.pop("pod", "")
    return ProcessView(
        key=f"{pid}@1",
        pid=pid,
        labels=labels,
        source="rule",
        alive=kw.pop("alive", True),
        memory=MemoryCounters(),
        rates=kw.pop("rates", ProcessRates()),
        **kw,
    )


def cuda(device: int, host: int = 0) -> CudaView:
    return CudaView(
        api_classes=CUDA_API_CLASSES,
        apis={"cudaMalloc": ApiCounters(ok=23, bytes=23 * MIB)},
        outstanding={"device": device, "host": host, "vmm": 0},
        failures={},
        symbols_attached=19,
        libraries=(),
        ucx_hooks=False,
    )


def xfer(eff: float) -> TransferView:
    return TransferView(
        xfers={},
        registered_bytes=0,
        registrations=0,
        deregistrations=0,
        registration_errors=0,
        released_incomplete=0,
        symbols_attached=5,
        libraries=(),
        effective_bytes_per_second=eff,
    )


def alert(name: str, pid: int | None, cause: str = "x", **labels: str) -> Alert:
    lab = {"pid": str(pid)} if pid is not None else {}
    return Alert(name, f"{pid}@1", {**lab, **labels}, cause, "warning", 1000.0, {}, f"{name} summary")


def snapshot() -> Snapshot:
    a = proc(
        101,
        role="prefill",
        pod="ns/vllm-0",
        rates=ProcessRates(
            cuda_alloc_calls=37.0,
            cuda_alloc_bytes=37 * 2 * MIB,
            cuda_free_calls=36.0,
            page_free_pages=2311.0,
            direct_reclaim_seconds=0.010,
            memcg_reclaim_seconds=0.0025,
            xfer_bytes=512 * MIB,
            kv_removed_blocks={"GPU": 40.0, "CPU": 2.0},
            # the loss ledger: 21 MiB/s, most of it evicted from the GPU
            kv_lost_bytes={("gpu", "evicted"): 20 * MIB, ("cpu", "offload_dropped"): MIB},
        ),
        cuda=cuda(23 * 20 * MIB, 4 * MIB),
        transfers=xfer(1024 * MIB),
        gpu_used_bytes=8 * 1024 * MIB,
    )
    a = dataclasses.replace(
        a,
        engine=EngineView(
            plan=EnginePlan("101@1", 101),
            streams=(),
            scrape=None,
            scrape_age=None,
            hit_ratio=None,
            regret_ratio={"GPU": 0.125, "CPU": 0.5},  # the worst medium is shown
        ),
    )
    b = proc(202, engine="sglang", rates=ProcessRates(cuda_alloc_calls=1.0))
    gone = proc(303, alive=False, rates=ProcessRates(cuda_alloc_calls=999.0))
    tier = TierView(
        key="tier:3",
        tier_id=3,
        name="lmcache",
        path="/mnt/kv",
        source="config",
        owners=(101,),
        files=4,
        totals=TierCounters(),
        rates=TierRates(reclaim_bytes=3 * MIB, policy_bytes=MIB),
    )
    return Snapshot(
        wall_time=1_700_000_000.0,
        monotonic=10.0,
        tick=9,
        ready=True,
        not_ready_reasons=(),
        processes=(a, b, gone),
        tiers=(tier,),
        alerts=(
            alert("KVHostTierEvictionUnderPressure", 101),
            alert("KVWatchProbeDown", None, "silent", probe="page_free"),
        ),
        probes=(
            ProbeView("page_free", "memory", "kmem:mm_page_free", "attached", True, 5),
            ProbeView("oom_victim", "memory", "oom:mark_victim", "attached", True, 0),
            ProbeView("cudaMalloc", "cuda", "libcudart:cudaMalloc", "missing", False, 0),
        ),
        lost={"ringbuf": 3, "exec_hints_dropped": 0},
        watched_by_engine={"vllm": 1, "sglang": 1},
        loop_seconds=0.012,
        link_bytes_per_second=4096 * MIB,
    )


def test_rows_from_the_snapshot() -> None:
    frame = build_frame(snapshot(), host="node-a")
    r = {row.pid: row for row in frame.rows}
    a = r[101]
    assert (a.engine, a.role, a.pod) == ("vllm", "prefill", "ns/vllm-0")
    assert a.alloc_per_s == 37 and a.alloc_bytes_per_s == 74 * MIB and a.free_per_s == 36
    assert a.outstanding_device == 460 * MIB and a.outstanding_host == 4 * MIB
    assert a.page_free_per_s == 2311
    assert a.evict_reclaim_bps == 3 * MIB and a.evict_policy_bps == MIB  # the tier it owns
    assert a.stall_ms_per_s == pytest.approx(12.5)
    assert a.xfer_bps == 512 * MIB and a.xfer_effective_bps == 1024 * MIB and a.link_pct == pytest.approx(25.0)
    assert a.kv_removed_per_s == 42.0 and a.regret_pct == 50.0
    assert a.lost_bps == 21 * MIB and a.lost_cause == "gpu:evicted"
    assert a.alerts == ("KVHostTierEvictionUnderPressure",)
    b = r[202]
    assert b.outstanding_device is None and b.evict_reclaim_bps == 0 and b.kv_removed_per_s is None
    assert b.regret_pct is None and b.lost_bps is None and b.lost_cause == ""
    assert b.link_pct is None
    h = frame.header
    assert h.processes == 2 and h.alloc_per_s == 38  # the exited process is not counted
    assert h.gpu_bytes == 8 * 1024 * MIB and h.evict_reclaim_bps == 3 * MIB
    assert h.probes_attached == 2 and h.probes_failed == ()  # a missing optional CUDA symbol is not a failure
    assert h.probes_silent == ("page_free",)
    assert h.lost_events == 3 and h.lost == {"ringbuf": 3}


def test_json_round_trip_and_garbage() -> None:
    frame = build_frame(snapshot(), host="node-a")
    assert decode(encode(frame)) == frame
    for bad in (b"", b"{", b'{"version": 1}', b"[1, 2]", b'{"header": 5, "rows": [], "alerts": []}'):
        with pytest.raises((msgspec.ValidationError, msgspec.DecodeError)):
            decode(bad)


def render(frame: TopFrame, view: ViewState | None = None) -> list[str]:
    buf = io.StringIO()
    print_once(frame, "daemon http://x", view or ViewState(), out=buf)
    return [line.rstrip() for line in buf.getvalue().splitlines()]


def test_plain_frame_exact() -> None:
    lines = render(build_frame(snapshot(), host="node-a"))
    assert lines[0].startswith("kvwatch top - node-a - ") and lines[0].endswith(
        "daemon http://x - every 1 s - sort alloc desc"
    )
    assert lines[1] == (
        "processes 2 (sglang 1, vllm 1)  GPU 8192.0 MiB  allocs 38/s  KV-tier evicted 3.0 MiB/s (deleted 1.0)  "
        "stall 12.5 ms/s  transfers 512.0 MiB/s (link 4096.0 MiB/s)"
    )
    assert lines[2] == "probes 2 attached  silent: page_free  lost events 3 (ringbuf 3)  loop 12 ms"
    head = lines[4].split()
    assert head[:4] == ["PID", "ENGINE/ROLE", "POD/CONTAINER", "GPU"]
    assert lines[5].split() == [
        "101", "vllm/prefill", "ns/vllm-0", "8192.0", "37", "74.0", "36", "460.0", "4.0", "2311",
        "3.0", "1.0", "12.5", "512.0", "1024.0", "25%", "42", "50%", "21.0", "gpu:evicted",
        "KVHostTierEvictionUnderPressure",
    ]  # fmt: skip
    assert lines[6].split() == [
        "202", "sglang", "-", "-", "1", "0.0", "0", "-", "-", "0", "0.0", "0.0", "0", "0.0", "-", "-", "-", "-", "-",
        "-", "-",
    ]  # fmt: skip
    assert "303" not in "\n".join(lines)  # exited
    assert lines[-2].startswith("WARNING  KVHostTierEvictionUnderPressure (x) pid 101 since ")
    assert lines[-1].startswith("WARNING  KVWatchProbeDown (silent) node since ")


def test_sort_filter_and_empty() -> None:
    frame = build_frame(snapshot(), host="n")
    assert [r.pid for r in ViewState(sort="pid", reverse=False).rows(frame)] == [101, 202]
    assert [r.pid for r in ViewState(sort="pid").rows(frame)] == [202, 101]
    assert [r.pid for r in ViewState(filter="SGLANG").rows(frame)] == [202]
    assert [r.pid for r in ViewState(alerting_only=True).rows(frame)] == [101]
    assert render(frame, ViewState(filter="nothing-like-this"))[4] == "no process matches the filter"
    empty = build_frame(Snapshot(wall_time=1.0, monotonic=1.0, tick=1, ready=True, not_ready_reasons=()), host="n")
    lines = render(empty)
    assert lines[1].startswith("processes 0 (none)  GPU - MiB  allocs 0/s")
    assert lines[4] == "no inference processes watched (discovery rules: kvwatch doctor; or --pid)"
    assert len(lines) == 5


def tenants_snapshot(at: float, a_stored: float, b_stored: float) -> Snapshot:
    rows = (
        TenantRow("tenant-a", "GPU", a_stored, 50, 10, 40, 640, resident=30),
        TenantRow("tenant-b", "GPU", b_stored, 5, 0, 0, 0, resident=90),
    )
    p = proc(101, kv_tenants=TenantsView(rows, {}, labelled=2, folded=0, overflow=0))
    thrash = Alert(
        alert="KVTenantThrash",
        subject_key="101@1/tenant:tenant-a",
        labels={"pid": "101", "engine": "vllm", "tenant": "tenant-a", "aggressor": "tenant-b"},
        cause="noisy_neighbour",
        severity="warning",
        started_at=at - 5,
        values={},
        summary="tenant-a evicted",
    )
    return dataclasses.replace(Snapshot.empty(), wall_time=at, processes=(p,), alerts=(thrash,))


def test_tenant_view_rates_shares_and_who_evicts_whom() -> None:
    view = ViewState(tenants=True)
    first = render(build_frame(tenants_snapshot(100.0, 100, 200)), view)
    assert [line.split()[4:7] for line in first[5:7]] == [["-", "-", "-"]] * 2  # one frame: no rates yet
    lines = render(build_frame(tenants_snapshot(102.0, 110, 400)), view)  # 2 s later
    assert lines[0].endswith(" - tenants")
    assert lines[4].split()[:5] == ["PID", "ENGINE", "TENANT", "MEDIUM", "STORED/s"]
    assert lines[5].split() == ["101", "vllm", "tenant-a", "GPU", "5.0", "0.0", "0.0", "30", "25%", "tenant-b"]
    assert lines[6].split() == ["101", "vllm", "tenant-b", "GPU", "100", "0.0", "0.0", "90", "75%", "-"]
    view.alerting_only = True
    assert [line.split()[2] for line in render(build_frame(tenants_snapshot(102.0, 110, 400)), view)[5:6]] == [
        "tenant-a"
    ]
    none = render(build_frame(snapshot()), ViewState(tenants=True))
    assert any(line.startswith("no tenants:") for line in none)
