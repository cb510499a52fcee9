"""The direct Alertmanager sink with a fake clock and a fake (sometimes failing) endpoint."""

from __future__ import annotations

import json
from typing import Any

from kvwatch.daemon.config import AlertmanagerConfig
from kvwatch.daemon.model.snapshot import Alert
from kvwatch.exporters.alertmanager import AlertmanagerSink


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Endpoint:
    def __init__(self) -> None:
        self.bodies: list[list[dict[str, Any]]] = []
        self.fail = 0

    def __call__(self, body: bytes) -> None:
        if self.fail:
            self.fail -= 1
            raise OSError("connection refused")
        self.bodies.append(json.loads(body))


def alert(pid: int = 7, ended: float | None = None) -> Alert:
    return Alert(
        "KVCacheReuseCollapse",
        f"{pid}@1",
        {"pid": str(pid), "engine": "vllm", "role": "", "pod": "ns/p"},
        "empty_cache",
        "warning",
        1_700_000_000.0,
        {"ratio": 37.0},
        "allocation calls 37x baseline",
        ended,
    )


def sink(**cfg: Any) -> tuple[AlertmanagerSink, Endpoint, Clock]:
    ep, clock = Endpoint(), Clock()
    c = AlertmanagerConfig(url="http://am:9093", labels={"cluster": "c1"}, **cfg)
    return AlertmanagerSink(c, node="n1", clock=clock, post=ep, start=False), ep, clock


def test_onset_shape_resend_and_resolve() -> None:
    s, ep, clock = sink(resend_seconds=60)
    s.onset(alert())
    assert s.send_due()
    (a,) = ep.bodies[0]
    assert a["labels"] == {
        "alertname": "KVCacheReuseCollapse",
        "severity": "warning",
        "node": "n1",
        "source": "kvwatch",
        "cause": "empty_cache",
        "pid": "7",
        "engine": "vllm",
        "pod": "ns/p",
        "cluster": "c1",
    }
    assert a["startsAt"] == "2023-11-14T22:13:20Z" and "endsAt" not in a
    assert a["annotations"]["runbook_url"].endswith("docs/runbook.md#kvcachereusecollapse")
    assert a["annotations"]["description"] == "allocation calls 37x baseline (ratio=37)"
    s.send_due()
    assert len(ep.bodies) == 1  # nothing new, not yet due again
    clock.t += 60
    s.send_due()
    assert len(ep.bodies) == 2  # re-sent: Alertmanager forgets what it stops hearing about
    s.clear(alert(ended=1_700_000_100.0))
    s.send_due()
    assert ep.bodies[2][0]["endsAt"] == "2023-11-14T22:15:00Z"
    clock.t += 600
    s.send_due()
    assert len(ep.bodies) == 3 and s.pending() == 0  # resolved and delivered: forgotten
    assert s.stats == {"sent": 3, "failed": 0, "dropped": 0}


def test_failures_back_off_and_the_latest_state_wins() -> None:
    s, ep, clock = sink(max_backoff_seconds=8)
    ep.fail = 5
    s.onset(alert())
    backoffs = []
    for _ in range(5):
        assert not s.send_due()
        backoffs.append(s._backoff)
    assert backoffs == [0.5, 1.0, 2.0, 4.0, 8.0]  # capped
    s.clear(alert(ended=1_700_000_050.0))  # resolved while Alertmanager was away
    assert s.send_due()
    ((a,),) = ep.bodies
    assert "endsAt" in a  # one post, the resolved state
    assert s.stats["failed"] == 5 and s._backoff == 0


def test_bounded_pending_drops_and_counts() -> None:
    s, ep, _ = sink(max_pending=3)
    for pid in range(5):
        s.onset(alert(pid))
    assert s.pending() == 3 and s.stats["dropped"] == 2
    s.send_due()
    assert sorted(a["labels"]["pid"] for a in ep.bodies[0]) == ["2", "3", "4"]
