"""KVTransferBandwidthCollapse and the bandwidth arithmetic, on synthetic transfers."""

from __future__ import annotations

from pathlib import Path

from kvwatch.daemon.config import TransferCollapseConfig
from kvwatch.daemon.config.base import parse
from kvwatch.daemon.detectors.transfer_collapse import ALERT, TransferCollapse
from kvwatch.daemon.families.transfer import link_bytes_per_second
from kvwatch.daemon.host.procfs import ProcFS
from kvwatch.daemon.model.findings import Subject
from kvwatch.daemon.model.history import History
from kvwatch.daemon.model.transfers import NIXL, TransferCounts, TransfersInFlight
from kvwatch.daemon.model.windows import NodeWindow, ProcessWindow

MB = 1e6


class Sim:
    """Transfers of `size` bytes, `per_second` posted and completed each second, each taking `seconds`."""

    def __init__(self, config: TransferCollapseConfig, link: float = 0.0) -> None:
        self.det = TransferCollapse(config, link)
        self.transfers: History[TransferCounts] = History(TransferCounts)
        self.in_flight = TransfersInFlight()
        self.t = 0.0
        self.tot = TransferCounts()

    def step(self, per_second: float, seconds_each: float, size: float = 4 * MB, posts: float | None = None) -> object:
        self.t += 1
        self.tot = TransferCounts(
            posts=self.tot.posts + (per_second if posts is None else posts),
            completed=self.tot.completed + per_second,
            bytes=self.tot.bytes + per_second * size,
            seconds=self.tot.seconds + per_second * seconds_each,
        )
        self.transfers.add(self.t, {NIXL: self.tot})
        pw = ProcessWindow(
            Subject("p", {"pid": "7"}), 1000 + self.t, transfers=self.transfers, in_flight=self.in_flight
        )
        (f,) = self.det.evaluate(NodeWindow(now=self.t, processes={"p": pw}, tiers={}))
        return f


def cfg(**kw: object) -> TransferCollapseConfig:
    base = {
        "warmup_seconds": 0,
        "baseline_min_seconds": 5,
        "window_seconds": 3,
        "min_transfers": 20,
        "confirm_windows": 2,
        "clear_windows": 2,
    }
    return parse(TransferCollapseConfig, {**base, **kw})


def test_effective_bandwidth_arithmetic() -> None:
    s = Sim(cfg())
    for _ in range(4):
        f = s.step(20, 0.004)
    m = f.values  # type: ignore[attr-defined]
    assert abs(m["effective_bytes_per_second"] - 1000 * MB) < 1  # 4 MB in 4 ms
    assert abs(m["concurrency"] - 0.08) < 1e-9  # 20/s x 4 ms in flight
    assert m["transfers_completed"] == 60


def test_fires_when_bandwidth_collapses_with_demand_and_clears() -> None:
    s = Sim(cfg(), link=1250 * MB)
    for _ in range(15):
        assert not s.step(20, 0.004).firing  # type: ignore[attr-defined]
    states = [s.step(20, 0.2).firing for _ in range(5)]  # type: ignore[attr-defined]  # 20 MB/s: 2 % of baseline
    assert states.index(True) <= 2
    f = s.step(20, 0.2)
    assert f.cause == "bandwidth" and f.values["link_utilization"] < 0.05  # type: ignore[attr-defined]
    for _ in range(6):
        f = s.step(20, 0.004)
    assert not f.firing  # type: ignore[attr-defined]


def test_demand_falling_is_not_a_collapse() -> None:
    s = Sim(cfg(min_transfers=5))
    for _ in range(15):
        s.step(20, 0.004)
    # fewer posts AND fewer in flight: the application simply asks less, slower transfers or not
    states = [s.step(3, 0.01, posts=3).firing for _ in range(10)]  # type: ignore[attr-defined]
    assert not any(states)


def test_slow_transfers_piling_up_count_as_demand() -> None:
    s = Sim(cfg())
    for _ in range(15):
        s.step(20, 0.004)
    # posts fall (handles all busy) but many transfers are in flight: demand holds
    states = [s.step(10, 0.5, posts=8).firing for _ in range(6)]  # type: ignore[attr-defined]
    assert any(states)


def test_in_flight_transfers_are_evidence_of_slowness() -> None:
    s = Sim(cfg())
    for _ in range(15):
        s.step(20, 0.004)
    # the link stalls: 1 completion a second, 40 transfers stuck for ~2 s each
    s.in_flight = TransfersInFlight(transfers=40, bytes=40 * 4 * MB, seconds=80.0)
    states = [s.step(1, 2.0).firing for _ in range(4)]  # type: ignore[attr-defined]
    assert any(states)
    f = s.step(1, 2.0)
    assert f.values["transfers_in_flight"] == 40 and f.values["effective_bytes_per_second"] < 5 * MB  # type: ignore[attr-defined]


def test_evidence_floor_and_warmup() -> None:
    s = Sim(cfg(min_transfers=50))
    for _ in range(15):
        s.step(20, 0.004)
    # 3 a window at 50 ms (8 % of baseline): 0.15 s of transfer time, less than 50 usual ones take (0.2 s)
    assert not any(s.step(1, 0.05).firing for _ in range(10))  # type: ignore[attr-defined]  # too few to judge
    s2 = Sim(cfg(warmup_seconds=10_000))
    for _ in range(10):
        s2.step(20, 0.004)
    assert not any(s2.step(20, 0.5).firing for _ in range(10))  # type: ignore[attr-defined]


def stalled(s: Sim, in_flight: int, age: float) -> None:
    s.in_flight = TransfersInFlight(transfers=in_flight, bytes=in_flight * 4 * MB, seconds=in_flight * age)


def test_a_stall_with_few_transfers_is_judged_by_their_time() -> None:
    """The shape of vLLM's decode on the H200 under a GPU copy hog: 4 reads stuck for tens of seconds, one
    completing every ~10 s, far below min_transfers; their time is hundreds of usual transfers'."""
    s = Sim(cfg())
    for _ in range(15):
        s.step(20, 0.004)
    states = []
    for i in range(6):
        stalled(s, 4, 2.0 * (i + 1))
        states.append(s.step(0, 0.0, posts=0).firing)  # type: ignore[attr-defined]
    assert any(states)
    f = s.step(0, 0.0, posts=0)
    v = f.values  # type: ignore[attr-defined]
    assert v["transfers_completed"] == 0 and v["transfers_in_flight"] == 4
    assert 0.003 < v["baseline_seconds_per_transfer"] < 0.005 and v["effective_bytes_per_second"] < 2 * MB
    stalled(s, 0, 0.0)
    for _ in range(6):
        f = s.step(20, 0.004)
    assert not f.firing  # type: ignore[attr-defined]


def test_one_stuck_transfer_is_not_a_collapse() -> None:
    """Fewer than min_stalled_transfers, after a pause: two transfers hanging are not the path's bandwidth."""
    s = Sim(cfg())
    for _ in range(15):
        s.step(20, 0.004)
    for _ in range(4):
        s.step(0, 0.0, posts=0)  # the window empties
    states = []
    for i in range(8):
        stalled(s, 2, 3.0 * (i + 1))
        states.append(s.step(0, 0.0, posts=0).firing)  # type: ignore[attr-defined]
    assert not any(states)


def test_link_speed_from_config_or_sysfs(tmp_path: Path) -> None:
    fs = ProcFS(tmp_path)
    assert link_bytes_per_second(400e9, "", fs) == 50e9
    net = tmp_path / "sys" / "class" / "net"
    (net / "ib0").mkdir(parents=True)
    (net / "ib0" / "speed").write_text("200000\n")
    assert link_bytes_per_second(0, "ib0", fs) == 25e9
    (net / "veth0").mkdir(parents=True)
    (net / "veth0" / "speed").write_text("-1\n")
    assert link_bytes_per_second(0, "veth0", fs) == 0.0
    assert link_bytes_per_second(0, "nope", fs) == 0.0
    assert ALERT == "KVTransferBandwidthCollapse"
