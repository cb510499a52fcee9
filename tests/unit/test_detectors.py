"""Detectors on synthetic series: no kernel, an explicit clock."""

from __future__ import annotations

from kvwatch.daemon.alerts import AlertBook
from kvwatch.daemon.config import HostTierEvictionConfig, OOMConfig
from kvwatch.daemon.config.base import parse
from kvwatch.daemon.detectors.base import Baseline, Hysteresis
from kvwatch.daemon.detectors.host_tier import ALERT, HostTierEviction
from kvwatch.daemon.detectors.oom import OOMKilled
from kvwatch.daemon.detectors.probe_down import ProbeDown
from kvwatch.daemon.model.findings import Subject
from kvwatch.daemon.model.history import History
from kvwatch.daemon.model.memory import MEMORY, PAGES, MemoryCounters, TierCounters
from kvwatch.daemon.model.series import CounterSeries
from kvwatch.daemon.model.windows import NodeWindow, OomEvent, ProcessWindow, TierWindow
from kvwatch.probes.records import HookState, HookStatus

MIB = 1024 * 1024
PAGE = 4096


class TierSim:
    """A tier and its owner, advanced one second at a time with chosen rates."""

    def __init__(self, config: HostTierEvictionConfig, *, owner_age: float = 1000.0) -> None:
        self.detector = HostTierEviction(config)
        self.tier: History[TierCounters] = History(TierCounters)
        self.owner: History[MemoryCounters] = History(MemoryCounters)
        self.t = 0.0
        self.totals = {"reclaim_pages": 0.0, "policy_pages": 0.0, "refault_pages": 0.0, "added_pages": 0.0}
        self.stall = 0.0
        self.owner_age = owner_age
        self.psi: float | None = None

    def step(
        self,
        evict_mib_s: float = 0.0,
        refault_frac: float = 0.0,
        stall_s: float = 0.0,
        policy_mib_s: float = 0.0,
    ) -> bool:
        self.t += 1.0
        pages = evict_mib_s * MIB / PAGE
        self.totals["reclaim_pages"] += pages
        self.totals["refault_pages"] += pages * refault_frac
        self.totals["policy_pages"] += policy_mib_s * MIB / PAGE
        self.stall += stall_s
        self.tier.add(self.t, {PAGES: TierCounters(**self.totals, reclaim_bytes=self.totals["reclaim_pages"] * PAGE)})
        self.owner.add(self.t, {MEMORY: MemoryCounters(memcg_reclaim_seconds=self.stall)})
        subject = Subject("pid:1@1", {"pid": "1", "engine": "vllm"})
        owner = ProcessWindow(subject, self.owner_age + self.t, memory=self.owner)
        tw = TierWindow(Subject("tier:0", {"tier": "t"}), 1000.0 + self.t, self.tier, (owner,))
        view = NodeWindow(now=self.t, processes={}, tiers={"tier:0": tw}, psi_memory_some_avg10=self.psi)
        (f,) = self.detector.evaluate(view)
        assert f.alert == ALERT
        self.last = f
        return f.firing


def cfg(**kw: float) -> HostTierEvictionConfig:
    base = {"warmup_seconds": 0.0, "window_seconds": 2.0, "confirm_windows": 2, "clear_windows": 3}
    return parse(HostTierEvictionConfig, {**base, **kw})


def test_fires_on_eviction_with_refaults_after_confirm() -> None:
    sim = TierSim(cfg())
    for _ in range(20):
        assert not sim.step(evict_mib_s=1.0, refault_frac=0.5)  # quiet baseline, under the floor
    fired_at = None
    for i in range(10):
        if sim.step(evict_mib_s=200.0, refault_frac=0.6) and fired_at is None:
            fired_at = i
    assert fired_at == 1  # second hot window: confirm_windows=2
    assert sim.last.cause == "refault"
    assert sim.last.values["evicted_bytes_per_second"] > 100 * MIB


def test_eviction_without_harm_does_not_fire() -> None:
    sim = TierSim(cfg())
    for _ in range(30):
        assert not sim.step(evict_mib_s=500.0, refault_frac=0.0)  # cold data evicted: no refault, no stall


def test_stall_or_psi_corroborate() -> None:
    sim = TierSim(cfg())
    fired = [sim.step(evict_mib_s=200.0, stall_s=0.2) for _ in range(5)]
    assert any(fired) and sim.last.cause == "reclaim_stall"
    sim2 = TierSim(cfg())
    sim2.psi = 35.0
    fired = [sim2.step(evict_mib_s=200.0) for _ in range(5)]
    assert any(fired) and sim2.last.cause == "psi"


def test_policy_deletions_never_alert() -> None:
    sim = TierSim(cfg())
    for _ in range(30):
        assert not sim.step(policy_mib_s=5000.0)


def test_floor_guards_idle_process() -> None:
    sim = TierSim(cfg(floor_bytes_per_second=64 * MIB))
    for _ in range(30):
        assert not sim.step(evict_mib_s=10.0, refault_frac=1.0)  # 10 MiB/s: below the absolute floor


def test_baseline_raises_threshold() -> None:
    sim = TierSim(cfg(floor_bytes_per_second=1 * MIB, baseline_half_life_seconds=30.0, factor=5.0))
    for _ in range(300):
        sim.step(evict_mib_s=100.0, refault_frac=0.0)  # a steady, harmless 100 MiB/s becomes the baseline
    assert sim.last.values["baseline_bytes_per_second"] > 90 * MIB
    for _ in range(5):
        assert not sim.step(evict_mib_s=300.0, refault_frac=0.5)  # 3x baseline: below 5x
    fired = [sim.step(evict_mib_s=800.0, refault_frac=0.5) for _ in range(5)]
    assert any(fired)


def test_warmup_suppresses() -> None:
    sim = TierSim(cfg(warmup_seconds=120.0), owner_age=0.0)
    for _ in range(60):
        assert not sim.step(evict_mib_s=500.0, refault_frac=0.9)


def test_hysteresis_clears_once_and_fires_once() -> None:
    sim = TierSim(cfg())
    book = AlertBook([])
    states = []
    for rate in [0] * 5 + [300] * 6 + [0] * 10:
        sim.step(evict_mib_s=rate, refault_frac=0.8)
        book.apply([sim.last], wall_now=sim.t)
        states.append(sim.last.firing)
    assert book.fired[ALERT] == 1
    assert states.count(True) >= 6
    assert states[-1] is False  # cleared after clear_windows evaluations below half the threshold
    assert [a.ended_at is not None for a in book.history] == [False, True]


def test_oom_immediate_then_expires() -> None:
    det = OOMKilled(OOMConfig(active_seconds=10))
    subj = Subject("7@1", {"pid": "7", "engine": "vllm"})
    ev = OomEvent(subj, 7, "python3", "", 512 * MIB, 0, at=0.0)
    (f,) = det.evaluate(NodeWindow(now=0.0, processes={}, tiers={}, oom_events=[ev]))
    assert f.firing and f.severity == "critical" and f.cause == "victim"
    (f,) = det.evaluate(NodeWindow(now=5.0, processes={}, tiers={}))
    assert f.firing
    (f,) = det.evaluate(NodeWindow(now=10.5, processes={}, tiers={}))
    assert not f.firing
    assert det.evaluate(NodeWindow(now=11.0, processes={}, tiers={})) == []


def test_oom_sibling_can_be_excluded() -> None:
    det = OOMKilled(OOMConfig(include_cgroup_siblings=False))
    ev = OomEvent(Subject("oom:9", {}), 9, "helper", "7@1", 0, 0, at=0.0)
    assert det.evaluate(NodeWindow(now=0.0, processes={}, tiers={}, oom_events=[ev])) == []


def test_probe_down_failed_and_silent() -> None:
    det = ProbeDown()
    statuses = [
        HookStatus("page_free", "memory", "kmem:mm_page_free", HookState.ATTACHED),
        HookStatus("oom_victim", "memory", "oom:mark_victim", HookState.MISSING, "not on this kernel"),
        HookStatus("task_rename", "memory", "task:task_rename", HookState.FAILED, required=False),
        HookStatus("pagecache_add", "memory", "filemap:x", HookState.DISABLED),
    ]
    out = {
        f.subject.labels["probe"]: f
        for f in det.evaluate(NodeWindow(0.0, {}, {}, probes=statuses, probe_hits={"page_free": 5}))
    }
    assert set(out) == {"page_free", "oom_victim"}
    assert out["oom_victim"].firing and out["oom_victim"].cause == "missing"
    assert not out["page_free"].firing
    out = {
        f.subject.labels["probe"]: f
        for f in det.evaluate(NodeWindow(61.0, {}, {}, probes=statuses, probe_hits={"page_free": 5}))
    }
    assert out["page_free"].firing and out["page_free"].cause == "silent"
    out = {
        f.subject.labels["probe"]: f
        for f in det.evaluate(NodeWindow(62.0, {}, {}, probes=statuses, probe_hits={"page_free": 6}))
    }
    assert not out["page_free"].firing


def test_baseline_half_life() -> None:
    b = Baseline(half_life=10.0)
    for t in range(5):
        b.update(100.0, float(t))
    assert abs(b.value - 100.0) < 1e-9  # early on: the plain mean, not the first sample's
    b2 = Baseline(half_life=10.0)
    b2.update(40.0, 0.0)
    b2.update(60.0, 1.0)
    assert abs(b2.value - 50.0) < 1.0  # two young samples weigh about the same
    for t in range(2, 1000):
        b2.update(0.0, float(t))  # a long stretch of zeros
    b2.update(100.0, 1010.0)  # then ten seconds (one half-life) of 100
    assert 45.0 < b2.value < 55.0
    b2.hold(2000.0)
    b2.update(0.0, 2001.0)  # after a hold, learning resumes from where it was
    assert b2.value < 55.0


def test_hysteresis_needs_consecutive() -> None:
    h = Hysteresis(confirm=2, clear=2)
    assert h.step(True, False, 0) == (False, False)
    assert h.step(False, True, 1) == (False, False)
    assert h.step(True, False, 2) == (False, False)
    assert h.step(True, False, 3) == (True, True)
    assert h.step(False, False, 4) == (True, False)  # not hot, not cool either: stays
    assert h.step(False, True, 5) == (True, False)
    assert h.step(False, True, 6) == (False, True)


def test_series_rates_and_reset() -> None:
    s = CounterSeries(horizon=10.0)
    for t in range(20):
        s.add(float(t), float(t * 10))
    assert s.rate(5.0) == 10.0
    assert s.delta(5.0) == (50.0, 5.0)
    assert len(s.samples) <= 12
    s.add(20.0, 3.0)  # counter went backwards: the series restarts
    assert s.rate(5.0) == 0.0
