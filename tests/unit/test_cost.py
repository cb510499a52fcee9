"""The self-cost meter and its circuit breaker (daemon/families/cost.py) and KVWatchProbeShed, on
synthetic ticks: a process's probed calls and CPU time, the per-call cost given."""

from __future__ import annotations

import pytest

from kvwatch.daemon.config import SelfCostConfig
from kvwatch.daemon.detectors.probe_shed import ProbeShed
from kvwatch.daemon.families.cost import Sample, SelfCost, hot_apis
from kvwatch.daemon.model.findings import Subject
from kvwatch.daemon.model.uprobes import UprobeState
from kvwatch.daemon.model.windows import NodeWindow, ProcessWindow

CONFIG = SelfCostConfig(budget=0.01, window_seconds=2.0, windows=3, backoff_seconds=10.0, backoff_max_seconds=25.0)


class Process:
    """A process making ``rate`` probed calls a second on half a core."""

    def __init__(self, meter: SelfCost) -> None:
        self.meter, self.calls, self.copies, self.cpu, self.shed = meter, 0.0, 0.0, 0.0, False

    def run(self, t0: int, t1: int, rate: float) -> list[tuple[int, str, float, tuple[str, ...] | None]]:
        out = []
        for t in range(t0, t1):
            if not self.shed:
                self.calls += rate
                self.copies += 0.95 * rate  # the hot API: 95 % of the calls
            self.cpu += 0.5
            per_api = {"cuda": {"cudaMemcpyAsync": self.copies, "cudaMalloc": self.calls - self.copies}}
            s = Sample("p", 7, self.cpu, {"cuda": self.calls, "transfer": 0.0}, {"cuda": self.shed}, per_api)
            out += [(t, fam, backoff, apis) for _pid, fam, apis, backoff in self.meter.update([s], float(t))]
        return out


def meter(call_ns: float | None = 2000.0) -> SelfCost:
    m = SelfCost(CONFIG)
    m.calibrated(call_ns)
    return m


def test_cost_is_calls_times_the_per_call_cost() -> None:
    m = meter()
    p = Process(m)
    assert p.run(0, 11, 1000.0) == []  # 1000 calls/s x 2 us = 2 ms/s of 500 ms/s: 0.4 %
    assert m.ratio("p") == pytest.approx(0.004)
    (cuda, transfer) = m.costs("p", {"cuda": False})
    assert cuda.cost_seconds == pytest.approx(10 * 1000 * 2e-6) and transfer.cost_seconds == 0.0


def test_over_budget_three_windows_sheds_then_backs_off_doubling() -> None:
    m = meter()
    p = Process(m)
    sheds = p.run(0, 20, 5000.0)  # 10 ms/s of 500: 2 %, over a 1 % budget
    assert [(t, fam, backoff) for t, fam, backoff, _ in sheds] == [
        (6, "cuda", 10.0),
        (12, "cuda", 20.0),
        (18, "cuda", 25.0),
    ]
    assert {apis for *_, apis in sheds} == {("cudaMemcpyAsync",)}  # the hot API only: allocations stay probed
    assert m.ratio("p") == pytest.approx(0.02)
    assert m.sheds == {"cuda": 3}
    assert m.costs("p", {"cuda": True})[0].shed


def test_nothing_judged_while_shed_and_backoff_resets_once_calm() -> None:
    m = meter()
    p = Process(m)
    assert len(p.run(0, 7, 5000.0)) == 1
    p.shed = True  # the attacher detached it: calls stand still
    assert p.run(7, 30, 5000.0) == []
    before = m.costs("p", {"cuda": True})[0].cost_seconds
    p.shed = False  # attached again; the rate fell
    assert p.run(30, 50, 100.0) == []
    assert m.costs("p", {"cuda": False})[0].cost_seconds == pytest.approx(before + 20 * 100 * 2e-6)
    assert len(p.run(50, 57, 5000.0)) == 1  # over again: the back-off is the base one again
    assert m.update([Sample("p", 7, p.cpu, {"cuda": p.calls}, {})], 57.0) == []


def test_no_cost_known_no_judgement_and_a_configured_cost_wins() -> None:
    m = meter(None)
    assert Process(m).run(0, 20, 1e6) == []
    assert m.ratio("p") is None
    fixed = SelfCost(SelfCostConfig(call_cost_ns=500.0))
    assert fixed.call_ns("cuda") == 500.0 and fixed.source("cuda") == "config"


def test_tiny_absolute_cost_is_under_the_floor() -> None:
    m = SelfCost(SelfCostConfig(budget=0.01, window_seconds=2.0, windows=1, floor_ms_per_second=1.0))
    m.calibrated(2000.0)
    p = Process(m)
    p.cpu = 0.0
    out = []
    for t in range(10):  # 100 calls/s = 0.2 ms/s, on a nearly idle process (0.01 s CPU/s): 2 %
        p.calls += 100
        p.cpu += 0.01
        out += m.update([Sample("p", 7, p.cpu, {"cuda": p.calls}, {})], float(t))
    assert out == [] and m.ratio("p") == pytest.approx(0.02)


def test_bpf_statistics_add_the_programs_own_time_per_call() -> None:
    m = meter(1500.0)
    m.programs({"cuda": {"kvw_enter_cudaMalloc": (30_000, 100), "kvw_return_cudaMalloc": (20_000, 100)}}, True)
    assert m.call_ns("cuda") == pytest.approx(1500.0 + 2 * 50_000 / 200)
    m.calibrated(1500.0, program_ns=140.0)  # the canary's own two minimal programs: counted once only
    assert m.call_ns("cuda") == pytest.approx(1360.0 + 2 * 50_000 / 200)
    assert (
        m.call_ns("transfer") == 1500.0 and m.source("cuda") == "canary+bpf_stats" and m.source("transfer") == "canary"
    )
    view = m.view(["cuda"])
    assert view.bpf_stats and view.programs[0].runs == 100
    m.programs({}, False)
    assert m.call_ns("cuda") == 1500.0 and m.source("cuda") == "canary"


def test_hot_apis() -> None:
    assert hot_apis({"a": 80.0, "b": 15.0, "c": 5.0}) == ("a", "b")  # 95 % >= 90 %
    assert hot_apis({"a": 95.0, "b": 5.0}) == ("a",)
    assert hot_apis({}) is None  # not counted per API: the whole family


def test_shed_detector() -> None:
    shed = {"cuda": UprobeState(calls=9.0, shed=True, symbols=4), "transfer": UprobeState(symbols=2)}
    p = ProcessWindow(Subject("k", {"pid": "7"}), 10.0, uprobes=shed, uprobe_cost_ratio=0.02)
    (f,) = ProbeShed().evaluate(NodeWindow(now=0.0, processes={"k": p}, tiers={}))
    assert f.firing and f.cause == "cuda" and "2.0%" in f.summary
    assert f.values == {"uprobe_cost_ratio": 0.02}
    p = ProcessWindow(Subject("k", {"pid": "7"}), 10.0, uprobes={**shed, "cuda": UprobeState(symbols=4)})
    (f,) = ProbeShed().evaluate(NodeWindow(now=0.0, processes={"k": p}, tiers={}))
    assert not f.firing
