"""KVPreemptionLivelock on synthetic engine counters: silent under ordinary preemption at a
healthy throughput, fires when preemptions keep rising while generated tokens fall toward
zero, carries the requests preempted and the tokens lost, and clears on recovery."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvwatch.daemon.config import DetectorsConfig, PreemptionLivelockConfig
from kvwatch.daemon.detectors.preemption_livelock import PreemptionLivelock
from kvwatch.daemon.detectors.registry import alert_names, build_detectors
from kvwatch.daemon.model.engine_scrape import ENGINE, EngineState, ScrapeCounts
from kvwatch.daemon.model.engines import EngineSample
from kvwatch.daemon.model.findings import Finding, Subject
from kvwatch.daemon.model.history import History
from kvwatch.daemon.model.windows import NodeWindow, ProcessWindow

CFG = PreemptionLivelockConfig(warmup_seconds=10, baseline_min_seconds=20, window_seconds=5, clear_windows=3)
SUBJECT = Subject("7@1", {"pid": "7", "engine": "vllm"})


@dataclass
class Engine:
    """An engine's cumulative counters (its /metrics), fed one second at a time."""

    engine: History[ScrapeCounts] = field(default_factory=lambda: History(ScrapeCounts))
    t: float = 0.0
    preempted: float = 0.0
    tokens: float = 0.0

    def second(self, detector: PreemptionLivelock, *, preempt: float, tokens: float) -> Finding:
        self.t += 1.0
        self.preempted += preempt
        self.tokens += tokens
        self.engine.add(self.t, {ENGINE: ScrapeCounts(preemptions=self.preempted, generation_tokens=self.tokens)})
        sample = EngineSample(self.t, preemptions=self.preempted, generation_tokens=self.tokens)
        state = EngineState(tapped=True, fresh=True, scrape=sample)
        window = ProcessWindow(SUBJECT, age=self.t, engine=self.engine, engine_state=state)
        (f,) = detector.evaluate(NodeWindow(now=self.t, processes={SUBJECT.key: window}, tiers={}))
        return f


def run(detector: PreemptionLivelock, engine: Engine, seconds: int, **kw: float) -> list[Finding]:
    return [engine.second(detector, **kw) for _ in range(seconds)]


def test_silent_under_ordinary_preemption_at_a_healthy_throughput() -> None:
    d, e = PreemptionLivelock(CFG), Engine()
    run(d, e, 60, preempt=0, tokens=2000)
    findings = run(d, e, 120, preempt=3, tokens=1700)  # preempting hard, still generating
    assert not any(f.firing for f in findings)
    findings = run(d, e, 60, preempt=0, tokens=10)  # slow but nothing preempted: not a livelock
    assert not any(f.firing for f in findings)


def test_fires_when_preemptions_rise_and_tokens_collapse_then_clears() -> None:
    d, e = PreemptionLivelock(CFG), Engine()
    run(d, e, 60, preempt=0, tokens=2000)
    onset = run(d, e, 30, preempt=4, tokens=150)
    firing = [i for i, f in enumerate(onset) if f.firing]
    # the 5 s window must hold mostly collapsed seconds before tokens/s <= 400, then 2 windows
    assert firing and firing[0] <= 6, [f.values["tokens_per_second"] for f in onset]
    f = onset[-1]
    assert f.cause == "livelock" and f.alert == "KVPreemptionLivelock"
    assert f.values["preempted_in_window"] == 4 * 5 and f.values["tokens_in_window"] == 150 * 5
    assert f.values["baseline_tokens_per_second"] == 2000.0  # learnt from the healthy minute only
    assert f.values["tokens_lost_in_window"] == 2000 * 5 - 150 * 5
    cleared = run(d, e, 30, preempt=0.2, tokens=1900)
    assert not cleared[-1].firing
    assert sum(1 for f in cleared if f.firing) <= 5 + CFG.clear_windows  # the window, then clear_windows


def test_not_judged_before_a_rate_is_learnt_nor_on_an_idle_engine() -> None:
    d, e = PreemptionLivelock(CFG), Engine()
    findings = run(d, e, 30, preempt=5, tokens=0)  # from the start: nothing learnt, nothing judged
    assert not any(f.firing for f in findings)
    run(d, e, 60, preempt=0, tokens=1)  # idle: the rate learnt (1/s) is below the 10 tokens/s floor
    findings = run(d, e, 30, preempt=5, tokens=0)
    assert not any(f.firing for f in findings) and findings[-1].values["baseline_tokens_per_second"] == 1.0


def test_in_the_registry_and_the_alert_names() -> None:
    assert "KVPreemptionLivelock" in alert_names(build_detectors(DetectorsConfig(), 0.0))
    assert any(isinstance(x, PreemptionLivelock) for x in build_detectors(DetectorsConfig(), 0.0))
