"""KVPrefixCacheIneffective on synthetic engine series, and the block accounting it rests on:
silent on a steady hot-prefix workload; ``not_hit`` when the same blocks come back and are not
hit (prefix caching effectively broken), ``not_shared`` (info) when nothing recurs; a reset in
the window is intentional."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from kvwatch.daemon.config import DetectorsConfig, PrefixCacheIneffectiveConfig
from kvwatch.daemon.detectors.prefix_cache import PrefixCacheIneffective
from kvwatch.daemon.detectors.registry import alert_names, build_detectors
from kvwatch.daemon.engines.blocks import MediumBlocks
from kvwatch.daemon.model.engine_scrape import ENGINE, EngineState, ScrapeCounts
from kvwatch.daemon.model.engines import EngineSample
from kvwatch.daemon.model.findings import Finding, Subject
from kvwatch.daemon.model.history import History
from kvwatch.daemon.model.kv_counts import STREAM, MediumCounts, StreamEvents
from kvwatch.daemon.model.windows import NodeWindow, ProcessWindow

CFG = PrefixCacheIneffectiveConfig(warmup_seconds=10, window_seconds=20, clear_windows=3)
SUBJECT = Subject("7@1", {"pid": "7", "engine": "vllm"})
BS = 16


@dataclass
class Engine:
    """An engine behind its KV event stream (block accounting as kvwatch's hub does it) and
    its /metrics (prefix-cache queried and hit tokens), one second at a time."""

    caching: bool = True  # False: every prefix is recomputed and its blocks stored again
    blocks: MediumBlocks = field(default_factory=lambda: MediumBlocks(100_000, 100_000))
    kv: History[MediumCounts] = field(default_factory=lambda: History(MediumCounts))  # the KV event stream's
    kv_events: History[StreamEvents] = field(default_factory=lambda: History(StreamEvents))
    engine: History[ScrapeCounts] = field(default_factory=lambda: History(ScrapeCounts))  # its /metrics
    t: float = 0.0
    queried: float = 0.0
    hits: float = 0.0
    cleared: float = 0.0
    next_unique: int = 1 << 40

    def second(self, detector: PrefixCacheIneffective, *, shared: int, unique: int, reset: bool = False) -> Finding:
        """``shared`` requests with one 4-block prefix in common, ``unique`` with their own."""
        self.t += 1.0
        prefix = [1, 2, 3, 4]
        for _ in range(shared):
            self.queried += 4 * BS
            resident = self.caching and self.blocks.restored + self.blocks.stored > 0
            if resident:
                self.hits += 4 * BS
            else:
                self.blocks.store(prefix, self.t, BS)
        for _ in range(unique):
            own = list(range(self.next_unique, self.next_unique + 4))
            self.next_unique += 4
            self.queried += 4 * BS
            self.blocks.store(own, self.t, BS)
            self.blocks.remove(own, self.t, self.t - 10)  # the pool turns over
        if reset:
            self.blocks.clear()
            self.cleared += 1
        m = self.blocks.totals()
        self.kv.add(self.t, {"GPU": MediumCounts(stored=m.stored, regretted=m.regretted, restored=m.restored)})
        self.kv_events.add(self.t, {STREAM: StreamEvents(cleared=self.cleared)})
        self.engine.add(self.t, {ENGINE: ScrapeCounts(prefix_queries=self.queried, prefix_hits=self.hits)})
        state = EngineState(True, fresh=True, scrape=EngineSample(self.t, prefix_queries=self.queried))
        window = ProcessWindow(
            SUBJECT, self.t, engine=self.engine, engine_state=state, kv=self.kv, kv_events=self.kv_events
        )
        (f,) = detector.evaluate(NodeWindow(now=self.t, processes={SUBJECT.key: window}, tiers={}))
        return f


def run(d: PrefixCacheIneffective, e: Engine, seconds: int, **kw: int | bool) -> list[Finding]:
    return [e.second(d, **kw) for _ in range(seconds)]  # type: ignore[arg-type]


def test_silent_on_a_steady_hot_prefix_workload() -> None:
    d, e = PrefixCacheIneffective(CFG), Engine()
    findings = run(d, e, 120, shared=200, unique=5)
    assert not any(f.firing for f in findings)
    assert findings[-1].values["hit_ratio"] > 0.9


def test_not_hit_when_the_same_blocks_come_back_unserved() -> None:
    d, e = PrefixCacheIneffective(CFG), Engine(caching=False)
    findings = run(d, e, 60, shared=200, unique=5)
    f = findings[-1]
    assert f.firing and f.cause == "not_hit" and f.severity == "warning"
    assert f.values["hit_ratio"] == 0.0 and f.values["queried_tokens"] == 20 * 205 * 4 * BS
    assert f.values["stored_blocks"] == 20 * (200 + 5) * 4  # every shared prefix stored again
    assert f.values["stored_while_held"] == 20 * 200 * 4  # ... of which these were held already


def test_not_shared_is_information_only() -> None:
    d, e = PrefixCacheIneffective(CFG), Engine()
    f = run(d, e, 60, shared=0, unique=100)[-1]
    assert f.firing and f.cause == "not_shared" and f.severity == "info"
    assert f.values["stored_while_held"] == f.values["stored_after_eviction"] == 0


def test_a_flood_of_unique_prompts_after_hits_is_no_statement_about_the_workload() -> None:
    """An engine that hit its prefixes (its normal) flooded with unique prompts: its window shares
    nothing, but that is a drop (KVEvictionBurst's case when it evicts), not the workload's nature.
    Once missing has been its normal for a while (the baseline learnt it), not_shared is said."""
    cfg = msgspec.structs.replace(CFG, baseline_half_life_seconds=30.0)
    d, e = PrefixCacheIneffective(cfg), Engine()
    assert not any(f.firing for f in run(d, e, 60, shared=200, unique=5))
    flood = run(d, e, 200, shared=0, unique=100)
    assert not any(f.firing for f in flood[:30]), [f.values["baseline_hit_ratio"] for f in flood[:30]]
    assert flood[-1].firing and flood[-1].cause == "not_shared"
    assert flood[-1].values["baseline_hit_ratio"] <= 2 * cfg.max_hit_ratio


def test_blocks_back_only_after_their_eviction_are_the_pools_size_not_a_broken_cache() -> None:
    d, e, findings = PrefixCacheIneffective(CFG), Engine(), []
    for _ in range(60):  # the same 100 prompts every second, each evicted before it comes back
        e.next_unique = 1 << 40
        findings.append(e.second(d, shared=0, unique=100))
    assert findings[-1].values["stored_after_eviction"] > 0 and findings[-1].values["stored_while_held"] == 0
    assert not any(f.firing for f in findings)


def test_a_reset_is_intentional_and_recovery_clears() -> None:
    d, e = PrefixCacheIneffective(CFG), Engine(caching=False)
    assert run(d, e, 60, shared=200, unique=5)[-1].firing
    e.caching = True
    findings = run(d, e, 40, shared=200, unique=5)
    assert not findings[-1].firing
    d2, e2 = PrefixCacheIneffective(CFG), Engine(caching=False)
    run(d2, e2, 5, shared=200, unique=5)
    findings = [e2.second(d2, shared=200, unique=5, reset=i % 10 == 0) for i in range(60)]
    assert not any(f.firing for f in findings)  # a reset every 10 s: every window holds one


def test_in_the_registry_and_the_alert_names() -> None:
    assert "KVPrefixCacheIneffective" in alert_names(build_detectors(DetectorsConfig(), 0.0))
    assert any(isinstance(x, PrefixCacheIneffective) for x in build_detectors(DetectorsConfig(), 0.0))
