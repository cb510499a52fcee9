"""Snapshots built by hand: one engine process (pid 7) with CUDA counters and one disk tier, as
the loop would publish them at monotonic time ``t``."""

from __future__ import annotations

from kvwatch.daemon.families.cuda import API_CLASSES as CUDA_API_CLASSES
from kvwatch.daemon.model.snapshot import (
    Alert,
    CudaView,
    MemoryCounters,
    ProcessRates,
    ProcessView,
    Snapshot,
    TierCounters,
    TierRates,
    TierView,
)
from kvwatch.probes.records import ApiCounters

T0_NS = 5_000_000_000  # monotonic 5 s
T0_WALL = 1_700_000_000.0


def snap(t: float, allocs: int, evicted: int, alerts: tuple[Alert, ...] = ()) -> Snapshot:
    p = ProcessView(
        key="7@1",
        pid=7,
        labels={"pid": "7", "engine": "vllm", "role": "decode", "component": "", "container": "", "pod": "ns/p"},
        source="rule",
        alive=True,
        memory=MemoryCounters(page_free_pages=10.0 * t, direct_reclaim_seconds=0.001 * t),
        rates=ProcessRates(),
        cuda=CudaView(
            api_classes=CUDA_API_CLASSES,
            apis={"cudaMalloc": ApiCounters(ok=allocs, bytes=allocs * 2 << 20), "cudaFree": ApiCounters(ok=allocs)},
            outstanding={},
            failures={},
            symbols_attached=1,
            libraries=(),
            ucx_hooks=False,
        ),
    )
    tier = TierView(
        key="tier:1",
        tier_id=1,
        name="disk",
        path="/kv",
        source="config",
        owners=(7,),
        files=1,
        totals=TierCounters(reclaim_pages=float(evicted)),
        rates=TierRates(),
    )
    return Snapshot(
        wall_time=T0_WALL + t - 5,
        monotonic=t,
        tick=int(t),
        ready=True,
        not_ready_reasons=(),
        processes=(p,),
        tiers=(tier,),
        alerts=alerts,
        lost={"transfer_ringbuf": 0},
    )
