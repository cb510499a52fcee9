"""One fold of tenants per engine process: the agent in-process, its engine taps fed the stats of
a real stream count (``StreamCounts``) of the simulated vLLM's pool, ticked once an engine step.
With more tenants than ``engines.tenant_top_k``, KVTenantThrash names only tenants that the
exported tenant rows (``prom_tenants``) carry under their own label, or ``other``; the fold is
sticky both ways, and the detectors' series and the exported rows are folded alike every tick."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvwatch.daemon.config import Config
from kvwatch.daemon.config.base import parse
from kvwatch.daemon.engines.stream_counts import StreamCounts
from kvwatch.daemon.engines.taps import EngineTaps
from kvwatch.daemon.engines.tenants import TenantNamer
from kvwatch.daemon.host.procfs import ProcFS
from kvwatch.daemon.lab import wire_encode as we
from kvwatch.daemon.lab.engine_sim_pool import BlockPool, Scheduler
from kvwatch.daemon.logs import ErrorBook
from kvwatch.daemon.model.engines import MediumTotals, StreamSpec, StreamStats
from kvwatch.daemon.model.snapshot import Snapshot
from kvwatch.daemon.wiring import assemble
from kvwatch.exporters.prom_tenants import tenant_families
from tests.support.procfs import FakeProc, make_proc

KV = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}
VLLM = ["/opt/venv/bin/python3", "/opt/venv/bin/vllm", "serve", "m", "--kv-events-config", json.dumps(KV)]
TENANTS = "abcx"
THRASH = {"warmup_seconds": 10, "baseline_min_seconds": 10, "window_seconds": 5, "floor_regretted_per_second": 2}
Stats = Callable[[StreamSpec], StreamStats]


def stats_of(counts: StreamCounts) -> Stats:
    def stats(spec: StreamSpec) -> StreamStats:
        return counts.stats(
            spec, connected=True, gaps=0, missed=0, replayed=0, lost=0, restarts=0,
            replay_requests=0, last_seq=0, last_message_at=0.0,
        )  # fmt: skip

    return stats


class _Hub:
    """The KV event hub's place in the taps: the streams the taps plan, with ``stats``'s counts."""

    def __init__(self, stats: Stats) -> None:
        self.make = stats
        self.specs: list[StreamSpec] = []

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def set_streams(self, specs: Any) -> None:
        self.specs = list(specs)

    def stats(self) -> dict[StreamSpec, StreamStats]:
        return {s: self.make(s) for s in self.specs}


class _NoScrapes:
    """The scraper's place: no /metrics page is read (tenants come from the stream alone)."""

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def set_targets(self, targets: Any) -> None:
        pass

    def states(self) -> dict[Any, Any]:
        return {}


class Node:
    """One vLLM process watched by the agent, its stream's stats from ``stats``; a second a tick."""

    def __init__(self, tmp_path: Path, stats: Callable[[Config], Stats], top_k: int = 2) -> None:
        root = make_proc(tmp_path / "proc", [FakeProc(300, "vllm", VLLM)])
        self.config = parse(
            Config,
            {
                "discovery": {"proc_root": str(root), "nvml": "off"},
                "engines": {
                    "tenant_top_k": top_k,
                    "tenant_key_file": str(tmp_path / "state" / "tenant.key"),
                    "tenants": [{"name": f"tenant-{n}", "salt": f"salt-{n}"} for n in TENANTS],
                },
                "detectors": {"tenant_thrash": THRASH},
            },
        )
        self.now = 0.0
        taps = EngineTaps(
            self.config.engines,
            ProcFS(tmp_path),
            ErrorBook(),
            hub=_Hub(stats(self.config)),  # type: ignore[arg-type]
            scraper=_NoScrapes(),  # type: ignore[arg-type]
            clock=lambda: self.now,
        )
        self.agent = assemble(
            self.config, memory=None, procfs=ProcFS(proc=root), engines=taps, clock=self.clock, wall=self.clock
        )

    def clock(self) -> float:
        return self.now

    def tick(self) -> Snapshot:
        self.now += 1.0
        return self.agent.tick()

    def detector_tenants(self) -> dict[str, float]:
        """The detectors' input: the process's GPU blocks stored, by tenant label."""
        (t,) = self.agent.tracker.tracked()
        return {name: t.tenants.last(name).stored for name in t.tenants}


def exported(snap: Snapshot) -> set[str]:
    """Every tenant label of the exported tenant families (what /metrics shows)."""
    return {s.labels["tenant"] for fam in tenant_families(snap) for s in fam.samples if "tenant" in s.labels}


def exported_gpu_stored(snap: Snapshot) -> dict[str, float]:
    (p,) = snap.processes
    assert p.kv_tenants is not None
    return {r.tenant: r.stored for r in p.kv_tenants.rows if r.medium == "GPU"}


# --- the alert names only what the exporters label -------------------------------------------------


class PoolEngine:
    """The simulated vLLM's 400-block pool: per tenant (requests, hot prefixes: 0 for unique
    prompts) 6-block prompts a second, counted by a real ``StreamCounts``."""

    def __init__(self) -> None:
        self.sched = Scheduler(BlockPool(400), None, max_num_seqs=64, seed=3)
        self.counts: StreamCounts | None = None
        self.unique = 0
        self.enc = msgspec.msgpack.Encoder()

    def stats(self, config: Config) -> Stats:
        if self.counts is None:
            self.counts = StreamCounts((100_000, 100_000), 10.0, TenantNamer(config.engines.tenants, b"k"))
        return stats_of(self.counts)

    def second(self, at: float, tenants: Mapping[str, tuple[int, int]]) -> None:
        assert self.counts is not None
        events: list[dict[str, Any]] = []
        for name, (n, hot) in tenants.items():
            for i in range(n):
                if hot:
                    seed = 1000 * (TENANTS.index(name) + 1) + (int(at) * n + i) % hot
                else:
                    self.unique += 1
                    seed = 10_000_000 + self.unique
                prompt = [3 + (seed * 7919 + j) % 31_000 for j in range(6 * 16 + 1)]
                events += self.sched.run_now(prompt, (f"salt-{name}", None))
        self.counts.ingest(we.encode_batch(we.Layout.V0_26, 1000.0 + at, events, 0, self.enc))


@pytest.mark.parametrize(
    ("first", "joins", "named"),
    [
        # a's hot prefixes and x label the pool; b, the flood, comes later: past the top 2
        ({"a": (8, 40), "x": (2, 1)}, {}, ("tenant-a", "other")),
        # b (light at first) and x label the pool; c, the victim, comes later: past the top 2
        ({"b": (2, 1), "x": (2, 1)}, {"c": (8, 40)}, ("other", "tenant-b")),
    ],
    ids=["aggressor_past_top_k", "victim_past_top_k"],
)
def test_a_thrash_alert_names_only_tenants_the_exporters_label(
    tmp_path: Path, first: dict[str, tuple[int, int]], joins: dict[str, tuple[int, int]], named: tuple[str, str]
) -> None:
    engine = PoolEngine()
    node = Node(tmp_path, engine.stats, top_k=2)

    def second(**tenants: tuple[int, int]) -> tuple[set[tuple[str, str]], set[str]]:
        engine.second(node.now + 1.0, tenants)
        snap = node.tick()
        alerts = {(a.labels["tenant"], a.labels["aggressor"]) for a in snap.alerts if a.alert == "KVTenantThrash"}
        return alerts, exported(snap)

    for _ in range(5):
        assert second(**first)[0] == set()
    for _ in range(40):  # the late tenant's normal, learnt
        assert second(**first, **joins)[0] == set()
    fired: set[tuple[str, str]] = set()
    for _ in range(20):  # b floods unique prompts: the hot prefixes are pushed out and recomputed
        alerts, labels = second(**{**first, **joins, "b": (30, 0)})
        assert {n for pair in alerts for n in pair if n} <= labels, (alerts, labels)
        fired |= alerts
    assert fired == {named}
    late = {f"tenant-{n}" for n in ({"b"} | joins.keys()) - first.keys()}
    assert not late & labels and "other" in labels  # the late tenant's rows are other's


# --- one sticky fold, for the detectors and the exporters ------------------------------------------------


def test_the_fold_is_sticky_both_ways_and_the_same_for_detectors_and_exporters(tmp_path: Path) -> None:
    """Per tick, cumulative GPU blocks stored (removed: half as many) per tenant. a and b label the
    pool (top 2); then a and b stop while c surges and d comes: a and b keep their labels, c and d
    stay other's."""
    ticks = [
        {"tenant-a": 100, "tenant-b": 50, "tenant-c": 10, "default": 5},
        {"tenant-a": 100, "tenant-b": 50, "tenant-c": 10_000, "tenant-d": 5_000, "default": 5},
        {"tenant-a": 100, "tenant-b": 51, "tenant-c": 90_000, "tenant-d": 40_000, "default": 9},
    ]
    now = [0]

    def stats(config: Config) -> Stats:
        def at(spec: StreamSpec) -> StreamStats:
            stored = ticks[min(now[0], len(ticks) - 1)]
            tenants = {n: MediumTotals(stored=v, removed=v // 2) for n, v in stored.items()}
            return StreamStats(
                spec=spec, connected=True, batches=1, events=1, media={}, cleared=0, gaps=0, missed=0,
                replayed=0, lost=0, decode_errors={}, restarts=0, replay_requests=0, last_seq=0,
                last_batch_ts=0.0, last_message_at=0.0, tracked_blocks=0, tenants={"GPU": tenants},
            )  # fmt: skip

        return at

    node = Node(tmp_path, stats, top_k=2)
    seen = []
    for i in range(len(ticks)):
        now[0] = i
        snap = node.tick()
        rows, series = exported_gpu_stored(snap), node.detector_tenants()
        assert series == rows, i  # the same labels, the same sums
        seen.append(set(rows))
    assert seen == [{"tenant-a", "tenant-b", "other", "default"}] * 3
    assert series["other"] == 90_000 + 40_000 and series["tenant-a"] == 100 and series["default"] == 9
    (p,) = snap.processes
    assert p.kv_tenants is not None and (p.kv_tenants.labelled, p.kv_tenants.folded) == (2, 2)
