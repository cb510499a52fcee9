"""The Prometheus collector against a golden file and promtool (its HTTP endpoints:
``tests/integration/test_http.py``)."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.daemon.config import DetectorsConfig
from kvwatch.daemon.detectors.registry import alert_label_names, alert_names, build_detectors
from kvwatch.daemon.families.cuda import API_CLASSES as CUDA_API_CLASSES
from kvwatch.daemon.model.engines import (
    AuditRow,
    EnginePlan,
    EngineSample,
    EngineView,
    GroupTotals,
    LossTotal,
    MediumTotals,
    ScrapeTarget,
    StreamSpec,
    StreamStats,
    TargetState,
    TenantRow,
    TenantsView,
    TierReading,
)
from kvwatch.daemon.model.snapshot import (
    Alert,
    CudaView,
    FamilyCost,
    MemoryCounters,
    ProbeView,
    ProcessRates,
    ProcessView,
    ProgramRuns,
    SelfCostView,
    Snapshot,
    TierCounters,
    TierRates,
    TierReclaimer,
    TierView,
    TransferView,
)
from kvwatch.exporters.http_conns import ConnectionStats, ConnectionTable
from kvwatch.exporters.metric_specs import declared
from kvwatch.exporters.prometheus import SnapshotCollector, build_registry
from kvwatch.probes.records import ApiCounters, XferCounters, bucket_of

TENANTS = TenantsView(
    rows=(
        TenantRow(
            "team-a", "GPU", stored=23, removed=19, removed_young=17, regretted=13, regret_tokens=208, resident=4
        ),
        TenantRow(
            "salt-1a2b3c4d", "GPU", stored=101, removed=7, removed_young=5, regretted=0, regret_tokens=0, resident=94
        ),
        TenantRow("other", "GPU", stored=3, removed=2, removed_young=0, regretted=1, regret_tokens=16, resident=1),
    ),
    losses={("team-a", "gpu", "evicted"): LossTotal(blocks=19, bytes=19 * 32768.0)},
    labelled=2,
    folded=3,
    overflow=0,
)
GOLDEN = Path(__file__).parent.parent / "fixtures" / "golden_metrics.txt"
METRICS_DOC = Path(__file__).parents[2] / "docs" / "metrics.md"
SQUEEZER_POD = "8d4e1f2a-1b2c-4d5e-8f90-123456789abc"
SQUEEZER = (
    "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod8d4e1f2a_1b2c_4d5e_8f90_123456789abc.slice"
    "/cri-containerd-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef.scope"
)
LABELS = {
    "engine": "vllm",
    "role": "decode",
    "component": "engine_core",
    "container": "abcdef012345",
    "pod": "vllm-0",
}


def _stream(rank: int, gpu: MediumTotals, **kw: object) -> StreamStats:
    spec = StreamSpec(f"tcp://127.0.0.1:{5557 + rank}", None, "", rank, "4242@77")
    fields: dict[str, object] = {
        "connected": True,
        "batches": 100,
        "events": 150,
        "media": {"GPU": gpu},
        "cleared": 1,
        "gaps": 0,
        "missed": 0,
        "replayed": 0,
        "lost": 0,
        "decode_errors": {},
        "restarts": 0,
        "replay_requests": 0,
        "last_seq": 99,
        "last_batch_ts": 999.0,
        "last_message_at": 49.0,
        "tracked_blocks": 10,
        "regret_horizon": {"GPU": 900.0 - 300.0 * rank},  # the engine's: the shorter, rank 1's
    }
    fields.update(kw)
    return StreamStats(spec=spec, **fields)  # type: ignore[arg-type]


# regrets: rank 0 stored 19 removed GPU blocks again (3 within 1 s, 11 within 15 s, 5 within
# 5 min), rank 1 two more after about 12 min: the buckets sum over ranks
GPU_RANK0 = MediumTotals(
    230,
    190,
    23,
    regretted=19,
    restored=5,
    resident=40,
    regret_tokens=304,
    regret_seconds=900.5,
    regret_buckets=(3, 0, 11, 0, 5, 0, 0),
    announced=12,
)
SLIDING_RANK0 = MediumTotals(230, 211, 170, regretted=2, resident=19)

REGRET_1 = (0, 0, 0, 0, 0, 2, 0)
GPU_RANK1 = MediumTotals(11, 5, 1, regretted=2, regret_tokens=32, regret_seconds=700.0, regret_buckets=REGRET_1)


def hybrid(gpu: MediumTotals, sliding: MediumTotals, cpu: MediumTotals | None = None) -> tuple[GroupTotals, ...]:
    """A Gemma-3-style engine's groups: full attention (the reference) and a 256-token sliding window."""
    out = [
        GroupTotals("GPU", 0, "full_attention", None, True, gpu),
        GroupTotals("GPU", 1, "sliding_window", 256, False, sliding),
    ]
    if cpu is not None:
        out.append(GroupTotals("CPU", 0, "full_attention", None, True, cpu))
    return tuple(out)


def engine_view() -> EngineView:
    return EngineView(
        plan=EnginePlan("4242@77", 4242, metrics_url="http://127.0.0.1:8000/metrics", refused={"kv_event_streams": 44}),
        streams=(
            _stream(
                0,
                GPU_RANK0,
                media={"GPU": GPU_RANK0, "CPU": MediumTotals(7, 2, 0)},
                groups=hybrid(GPU_RANK0, SLIDING_RANK0, MediumTotals(7, 2, 0)),
                localities={"CPU": "LOCAL"},
                extras={"cache_salt": 3, "lora": 40},
            ),
            _stream(
                1,
                GPU_RANK1,
                groups=hybrid(GPU_RANK1, MediumTotals(11, 9, 9)),
                connected=False,
                gaps=2,
                missed=5,
                replayed=3,
                lost=2,
                restarts=1,
                decode_errors={"payload": 4, "event": 1},
            ),
        ),
        scrape=TargetState(
            ScrapeTarget("http://127.0.0.1:8000/metrics", "4242@77"),
            ok=41,
            failures={"deadline": 2},
            rejected={"nan": 3},
            last=EngineSample(
                at=48.0,
                usage=0.93,
                prefix_queries=91_200.0,
                prefix_hits=60_800.0,
                preemptions=23.0,
                generation_tokens=322_409.0,
                sleeping=False,
                external_queries=30_400.0,
                external_hits=4_800.0,
                offload_store_bytes=2_936_012_800.0,
                offload_load_bytes=157_286_400.0,
            ),
        ),
        scrape_age=2.0,
        hit_ratio=0.25,
        regret_ratio={"GPU": 0.125},
        block_bytes=524_288,
        block_bytes_source="offload",
        tiers=(
            TierReading("vllm", "cpu", "stored", "bytes", 2_936_012_800.0),
            TierReading("vllm", "cpu", "loaded", "bytes", 157_286_400.0),
            TierReading("vllm", "cpu", "queried", "tokens", 30_400.0),
            TierReading("vllm", "cpu", "hit", "tokens", 4_800.0),
            TierReading("kvbm", "disk", "stored", "blocks", 3_812.0),
            TierReading("kvbm", "disk", "hit_ratio", "ratio", 0.3125),
            TierReading("lmcache_mp", "cpu", "usage", "ratio", 0.7489),
            TierReading("lmcache_mp", "cpu", "used", "bytes", 12_884_901_893.0),
        ),
        tier_hit_ratio={("vllm", "cpu"): 0.125, ("kvbm", "disk"): 0.3125},
    )


# the audit of process 4242: its offload counter reported half the bytes its CPU blocks hold, four
# windows out of nine; its resident blocks within its pool
AUDIT = (
    AuditRow(
        "offload_store_blocks",
        "bytes",
        "vllm:kv_offload_store_bytes",
        "KV event stream CPU blocks stored x block size",
        engine=52_428_800.0,
        kvwatch=104_857_600.0,
        divergence=-0.5,
        diverged=True,
        window=9,
        windows_diverged=4,
        window_seconds=30.0,
    ),
    AuditRow(
        "resident_blocks",
        "blocks",
        "vllm:cache_config_info num_gpu_blocks",
        "KV event stream GPU blocks resident",
        engine=2048.0,
        kvwatch=1500.0,
        divergence=0.267578125,
        diverged=False,
        window=9,
        windows_diverged=0,
        window_seconds=30.0,
    ),
)


# the ledger of process 4242: 23 GPU blocks evicted, 7 while preempting, 5 never offloaded,
# 3 MiB of its disk tier reclaimed; 2 blocks of an unknown size lost on a third tier
LOSSES = {
    ("gpu", "evicted"): LossTotal(23, 23 * 524_288.0),
    ("gpu", "preempted"): LossTotal(7, 7 * 524_288.0),
    ("cpu", "offload_dropped"): LossTotal(5, 5 * 524_288.0),
    ("disk", "reclaim"): LossTotal(0, 3 * 2.0**20),
    ("other", "cleared"): LossTotal(2, None),
}


def fixture_snapshot(wall: float = 1000.0) -> Snapshot:
    return Snapshot(
        wall_time=wall,
        monotonic=50.0,
        tick=42,
        ready=True,
        not_ready_reasons=(),
        processes=(
            ProcessView(
                key="4242@77",
                pid=4242,
                labels={"pid": "4242", **LABELS},
                source="rule",
                alive=True,
                memory=MemoryCounters(2311.0, 0.25, 3.0, 1.5, 17.0),
                rates=ProcessRates(),
                gpu_used_bytes=80 * 2**30,
                cuda=CudaView(
                    api_classes=CUDA_API_CLASSES,
                    apis={
                        "cudaMalloc": ApiCounters(ok=2981, err=2, bytes=2981 * 20 * 2**20),
                        "cudaFree": ApiCounters(ok=2980, bytes=2979 * 20 * 2**20, unknown=1),
                        "cuMemCreate": ApiCounters(ok=18, bytes=18 * 2**21),
                        "cuMemMap": ApiCounters(ok=18, bytes=18 * 2**21),
                        "cudaMemcpyAsync:d2h": ApiCounters(ok=10, bytes=10 * 2**21),
                        "cudaMemcpyAsync:h2d": ApiCounters(ok=7, err=1, bytes=7 * 2**21),
                    },
                    outstanding={"device": 20 * 2**20, "host": 0, "vmm": 18 * 2**21},
                    failures={("cudaMalloc", 2): 2},
                    symbols_attached=17,
                    libraries=("/usr/lib/libcudart.so.12",),
                    ucx_hooks=False,
                ),
                transfers=TransferView(
                    xfers={
                        ("nixl", "write"): XferCounters(
                            calls=25,
                            errors=2,
                            bytes=23 * 64 * 2**20,
                            completed=23,
                            duration_ns=23 * 16_000_000,
                            buckets=tuple(23 if b == bucket_of(16_000_000) else 0 for b in range(26)),
                        ),
                        ("nccl", "send"): XferCounters(calls=7, bytes=7 * 2000),
                    },
                    registered_bytes=8 * 2**20,
                    registrations=4,
                    deregistrations=2,
                    registration_errors=1,
                    released_incomplete=0,
                    symbols_attached=11,
                    libraries=("/opt/nixl/libnixl.so",),
                    effective_bytes_per_second=4.2e9,
                ),
                engine=engine_view(),
                kv_losses=LOSSES,
                kv_audit=AUDIT,
                kv_tenants=TENANTS,
                uprobe_costs=(
                    FamilyCost("cuda", 0.4375, 0.0125, True, 2),
                    FamilyCost("transfer", 0.0625, 0.0125, False, 0),
                ),
            ),
            ProcessView(
                key="4243@78",
                pid=4243,
                labels={
                    "pid": "4243",
                    "engine": 'we"ird\\name\n',
                    "role": "",
                    "component": "",
                    "container": "",
                    "pod": "",
                },
                source="manual",
                alive=True,
                memory=MemoryCounters(),
                rates=ProcessRates(),
            ),
        ),
        tiers=(
            TierView(
                key="tier:0",
                tier_id=0,
                name="lmcache:/mnt/nvme/kv",
                path="/mnt/nvme/kv",
                source="lmcache",
                owners=(4242,),
                files=123,
                totals=TierCounters(reclaim_bytes=4096.0 * 1000, policy_bytes=4096.0 * 7, refault_pages=250.0),
                rates=TierRates(),
                reclaimers=(  # 1000 pages: the tier's reclaim, row by row
                    TierReclaimer("cgroup", "memcg", SQUEEZER, SQUEEZER_POD, "0123456789ab", 4096.0 * 700, 0.0),
                    TierReclaimer("kswapd", "global", "", "", "", 4096.0 * 250, 0.0),
                    TierReclaimer("other", "memcg", "", "", "", 4096.0 * 40, 0.0),
                    TierReclaimer("unknown", "", "", "", "", 4096.0 * 10, 0.0),
                ),
            ),
        ),
        alerts=(
            Alert(
                alert="KVHostTierEvictionUnderPressure",
                subject_key="tier:0",
                labels={"tier": "lmcache:/mnt/nvme/kv", "pid": "4242", **LABELS},
                cause="refault",
                severity="warning",
                started_at=990.0,
                values={"evicted_bytes_per_second": 1e8},
                summary="s",
            ),
        ),
        alert_labels=alert_label_names(),
        alerts_fired={  # the alert book's: every alert the detectors raise, from zero
            **dict.fromkeys(alert_names(build_detectors(DetectorsConfig(), 0.0)), 0),
            "KVHostTierEvictionUnderPressure": 1,
            "InferenceProcessOOMKilled": 2,
        },
        oom_kills={("vllm", "decode", "abcdef012345", "vllm-0"): 2},
        probes=(
            ProbeView("page_free", "memory", "kmem:mm_page_free", "attached", True, 123456),
            ProbeView("oom_victim", "memory", "oom:mark_victim", "missing", True, 0, "not on this kernel"),
        ),
        lost={"ringbuf": 3, "watched_full": 0},
        errors={"tick_sample": 1},
        watched_by_engine={"vllm": 1, 'we"ird\\name\n': 1},
        label_overflow=0,
        loop_seconds=0.002,
        psi_memory_some_avg10=1.5,
        link_bytes_per_second=50e9,
        transfers_pending=3,
        self_cost=SelfCostView(
            bpf_stats=True,
            canary_call_ns=1510.0,
            call_ns={"cuda": (1734.5, "canary+bpf_stats"), "transfer": (1510.0, "canary")},
            programs=(
                ProgramRuns("memory", "tracepoint__kmem__mm_page_free", 0.0723, 2_000_003),
                ProgramRuns("cuda", "kvw_enter_cudaMalloc", 0.0000611, 523),
            ),
            sheds={"cuda": 2},
        ),
    )


def render(s: Snapshot) -> str:
    collector = SnapshotCollector(lambda: s, version="1.2.3", bcc_version="0.26.0", clock=lambda: 1001.0)
    text = generate_latest(build_registry(collector, self_process=False)).decode()
    return text.replace(f'kernel="{os.uname().release}"', 'kernel="KERNEL"')


def test_golden_metrics() -> None:
    text = render(fixture_snapshot())
    if os.environ.get("KVWATCH_REGEN_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def documented_families(text: str) -> set[str]:
    """Every family docs/metrics.md names in backticks: a name's trailing ``{labels}`` dropped, its
    ``{a,b}`` alternatives expanded; mentions of a prefix (``kvwatch_engine_*``) are not families."""
    out = set()
    for m in re.finditer(r"`(kvwatch_[^`\s]*)`", text):
        name = re.sub(r"\{[^{}]*\}$", "", m.group(1))
        if name.endswith(("_", "*")):
            continue
        parts = [p[1:-1].split(",") if p.startswith("{") else [p] for p in re.split(r"(\{[^}]*\})", name)]
        out |= {re.sub(r"_total$", "", "".join(x)) for x in itertools.product(*parts)}
    return out


def test_every_exported_family_is_declared_and_every_declared_one_exported() -> None:
    """The collectors' tables (``exporters/metric_specs.py``) against what they export on the golden
    scrape and the HTTP server's own connections: name, type, help, and the label names of every
    family with samples. A declaration no collector builds is dead; a family not declared cannot be
    built at all."""
    specs = {s.name: s for s in declared()}
    with_sink = replace(fixture_snapshot(), alertmanager={"sent": 3, "failed": 1, "dropped": 0})
    scraped = list(text_string_to_metric_families(render(with_sink)))
    scraped += ConnectionStats(ConnectionTable(4, 1.0, lambda: 0.0)).collect()
    assert len(specs) > 100
    assert sorted(specs) == sorted(f.name for f in scraped)
    for f in scraped:
        spec = specs[f.name]
        assert (f.type, f.documentation) == (spec.kind, spec.help), f.name
        for sample in f.samples:
            extra = set(sample.labels) - {"le"} - set(spec.labels)
            assert f.name == "kvwatch_alert_active" or not extra, (f.name, extra)  # alerts: their specs' labels too


def test_every_declared_family_is_documented_and_every_documented_one_declared() -> None:
    """docs/metrics.md against the declarations: a family added, renamed or dropped in one and not
    the other fails."""
    names = {s.name for s in declared()}
    documented = documented_families(METRICS_DOC.read_text())
    assert sorted(names - documented) == []
    assert sorted(documented - names) == []


def test_contract_names_present() -> None:
    names = {f.name for f in text_string_to_metric_families(render(fixture_snapshot()))}
    for contract in (
        "kvwatch_build_info",
        "kvwatch_probe_attached",
        "kvwatch_probe_hits",
        "kvwatch_events_lost",
        "kvwatch_watched_processes",
        "kvwatch_page_free_pages",
        "kvwatch_pagecache_evicted_bytes",
        "kvwatch_direct_reclaim_seconds",
        "kvwatch_oom_kills",
        "kvwatch_alert_active",
        "kvwatch_alerts_fired",
        "kvwatch_cuda_alloc_calls",
        "kvwatch_cuda_alloc_bytes",
        "kvwatch_cuda_free_calls",
        "kvwatch_cuda_outstanding_bytes",
        "kvwatch_kv_blocks_removed",
        "kvwatch_kv_blocks_stored",
    ):
        assert contract in names, contract


def test_parsed_values() -> None:
    fams = {f.name: f for f in text_string_to_metric_families(render(fixture_snapshot()))}
    (pf,) = [s for s in fams["kvwatch_page_free_pages"].samples if s.labels["pid"] == "4242"]
    assert pf.value == 2311 and pf.labels["pod"] == "vllm-0"
    ev = {s.labels["cause"]: s.value for s in fams["kvwatch_pagecache_evicted_bytes"].samples}
    assert ev == {"reclaim": 4096000.0, "policy": 28672.0}
    by = [s for s in fams["kvwatch_pagecache_reclaimed_bytes"].samples if s.name.endswith("_total")]
    assert sum(s.value for s in by) == ev["reclaim"]  # the rows add up to the tier's reclaim
    (squeezer,) = [s for s in by if s.labels["reclaimer"] == "cgroup"]
    assert squeezer.labels["reclaimer_pod_uid"] == SQUEEZER_POD and squeezer.labels["scope"] == "memcg"
    weird = [s for s in fams["kvwatch_watched_processes"].samples if s.labels["engine"].startswith("we")]
    assert weird[0].labels["engine"] == 'we"ird\\name\n'  # escaped on the wire, intact after parsing
    calls = {(s.labels["api"], s.labels["result"]): s.value for s in fams["kvwatch_cuda_alloc_calls"].samples}
    assert calls[("cudaMalloc", "ok")] == 2981 and calls[("cudaMalloc", "error")] == 2
    assert calls[("cuMemAlloc", "ok")] == 0  # every API of an attached process is exported, from zero
    out = {s.labels["kind"]: s.value for s in fams["kvwatch_cuda_outstanding_bytes"].samples}
    assert out == {"device": 20 * 2**20, "host": 0, "vmm": 18 * 2**21}
    (fail,) = fams["kvwatch_cuda_alloc_failures"].samples
    assert fail.labels["code"] == "2" and fail.value == 2
    tb = {(s.labels["lib"], s.labels["op"]): s.value for s in fams["kvwatch_transfer_bytes"].samples}
    assert tb == {("nixl", "write"): 23 * 64 * 2**20, ("nccl", "send"): 14000}
    le = {s.labels["le"]: s.value for s in fams["kvwatch_transfer_duration_seconds"].samples if "le" in s.labels}
    assert le["0.008388608"] == 0 and le["0.016777216"] == 23 and le["+Inf"] == 23  # 16 ms: bucket 2^24 ns
    (reg,) = fams["kvwatch_rdma_registered_bytes"].samples
    assert reg.value == 8 * 2**20
    (util,) = fams["kvwatch_transfer_link_utilization_ratio"].samples
    assert abs(util.value - 4.2e9 / 50e9) < 1e-12
    copied = {s.labels["direction"]: s.value for s in fams["kvwatch_cuda_copy_bytes"].samples}
    assert copied == {"d2h": 10 * 2**21, "h2d": 7 * 2**21}
    assert not [s for s in fams["kvwatch_cuda_vmm_map_calls"].samples if "Memcpy" in s.labels["api"]]
    removed = {s.labels["medium"]: s.value for s in fams["kvwatch_kv_blocks_removed"].samples}
    assert removed == {"GPU": 195, "CPU": 2}  # summed over the data-parallel ranks
    stored = {s.labels["medium"]: s.value for s in fams["kvwatch_kv_blocks_stored"].samples}
    assert stored == {"GPU": 241, "CPU": 7}
    lost = {s.labels["dp_rank"]: s.value for s in fams["kvwatch_kv_event_batches_lost"].samples}
    assert lost == {"0": 0, "1": 2}
    bad = {s.labels["kind"]: s.value for s in fams["kvwatch_kv_event_decode_errors"].samples}
    assert bad == {"payload": 4, "event": 1}
    scrapes = {s.labels["result"]: s.value for s in fams["kvwatch_engine_scrapes"].samples}
    assert scrapes == {"ok": 41, "deadline": 2}
    (usage,) = fams["kvwatch_engine_kv_usage_ratio"].samples
    assert usage.value == 0.93
    fired = {s.labels["alert"]: s.value for s in fams["kvwatch_alerts_fired"].samples}
    assert fired["KVHostTierEvictionUnderPressure"] == 1 and fired["KVEvictionBurst"] == 0


def test_exited_process_disappears() -> None:
    s = fixture_snapshot()
    assert 'pid="4243"' in render(s)
    assert 'pid="4243"' not in render(replace(s, processes=s.processes[:1]))


@pytest.mark.skipif(
    shutil.which("promtool") is None and not os.environ.get("KVWATCH_CI"),
    reason="promtool not installed (deploy/setup.sh test installs it)",
)
def test_promtool_check_metrics() -> None:
    out = subprocess.run(
        ["promtool", "check", "metrics"],
        input=GOLDEN.read_text(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_gone_process_keeps_its_loss_ledger_unless_its_labels_are_live() -> None:
    gone_labels = {"pid": "777", "engine": "vllm", "role": "", "component": "", "container": "", "pod": ""}
    oom = {("gpu", "oom"): LossTotal(23, 23 * 524_288.0)}
    live_clash = (fixture_snapshot().processes[0].labels, {("gpu", "oom"): LossTotal(5, None)})
    s = replace(fixture_snapshot(), departed_losses=((gone_labels, oom), live_clash))
    fams = {f.name: f for f in text_string_to_metric_families(render(s))}
    rows = [(x.labels["pid"], x.labels["cause"], x.value) for x in fams["kvwatch_kv_lost_blocks"].samples]
    assert ("777", "oom", 23.0) in rows
    assert len([r for r in rows if r[0] == "4242"]) == len([k for k, v in LOSSES.items() if v.blocks])


def test_ledger_lingers_after_the_process() -> None:
    from kvwatch.daemon.engines.ledger import LossLedger

    ledger = LossLedger(linger_seconds=300.0)
    ledger.of("1@1").add_blocks("gpu", "oom", 23)
    ledger.of("2@2")  # no rows: nothing to keep
    ledger.depart("1@1", {"pid": "1"}, now=10.0)
    ledger.depart("2@2", {"pid": "2"}, now=10.0)
    assert list(ledger.departed) == ["1@1"] and not ledger.engines
    ledger.expire(309.9)
    assert list(ledger.departed) == ["1@1"]
    ledger.expire(310.0)
    assert not ledger.departed
