"""KVTransferBandwidthCollapse replayed on the transfer stream of a real disaggregated vLLM.

The fixture holds every NIXL READ that ``kvwatch record`` saw in vLLM 0.26.0's decode EngineCore on the
H200 (prefill/decode over NixlConnector, UCX over tcp/lo): start, duration and bytes of 1,847 transfers,
the run's phase marks, and the two alerts the daemon raised in that run. The replay rebuilds what the
transfer family gives the detector each 1 s tick (posts, completions, bytes, summed durations, and the
transfers in flight with their bytes and age) and runs the detector with the run's settings.
"""

from __future__ import annotations

import bisect
import gzip
import json
from itertools import accumulate
from pathlib import Path
from typing import Any

from kvwatch.daemon.config import TransferCollapseConfig
from kvwatch.daemon.config.base import parse
from kvwatch.daemon.detectors.transfer_collapse import TransferCollapse
from kvwatch.daemon.model.findings import Subject
from kvwatch.daemon.model.history import History
from kvwatch.daemon.model.transfers import NIXL, TransferCounts, TransfersInFlight
from kvwatch.daemon.model.windows import NodeWindow, ProcessWindow

FIXTURE = Path(__file__).parents[1] / "fixtures" / "transfers" / "vllm-0.26.0-pd-h200.json.gz"
RUN_SETTINGS = {"warmup_seconds": 30}  # the run's --set; every other setting at its default


def load() -> dict[str, Any]:
    with gzip.open(FIXTURE, "rt") as f:
        return json.load(f)


def replay(data: dict[str, Any], phase: float = 0.0, **settings: Any) -> list[tuple[float, float | None]]:
    """(onset, clear) of every firing, in seconds from the recording's start; ticks at ``phase`` + k s."""
    xs = data["transfers"]
    det = TransferCollapse(parse(TransferCollapseConfig, {**RUN_SETTINGS, **settings}))
    starts = [x[0] for x in xs]
    done = sorted((s + d, d, b) for s, d, b in xs)
    ends = [e for e, _, _ in done]
    cum_seconds = [0.0, *accumulate(d for _, d, _ in done)]
    cum_bytes = [0, *accumulate(b for _, _, b in done)]
    transfers: History[TransferCounts] = History(TransferCounts)
    firing, spans = False, []
    t, last = phase, data["phases"]["lowdemand_end"]
    while t <= last:
        t += 1.0
        n = bisect.bisect_right(ends, t)
        counts = TransferCounts(
            posts=float(bisect.bisect_right(starts, t)),
            completed=float(n),
            bytes=float(cum_bytes[n]),
            seconds=cum_seconds[n],
        )
        transfers.add(t, {NIXL: counts})
        flying = [(s, b) for s, d, b in xs if s <= t < s + d]
        in_flight = TransfersInFlight(
            transfers=float(len(flying)), bytes=float(sum(b for _, b in flying)), seconds=sum(t - s for s, _ in flying)
        )
        age = t + data["decode_discovered_before_start_s"]
        subject = Subject("decode", {"pid": "1335"})
        pw = ProcessWindow(subject, age, transfers=transfers, in_flight=in_flight)
        (f,) = det.evaluate(NodeWindow(now=t, processes={"decode": pw}, tiers={}))
        if f.firing and not firing:
            spans.append((t, None))
        elif firing and not f.firing:
            spans[-1] = (spans[-1][0], t)
        firing = f.firing
    return spans


def within(spans: list[tuple[float, float | None]], lo: float, hi: float) -> list[tuple[float, float | None]]:
    return [s for s in spans if lo <= s[0] < hi]


PHASES = (0.0, 0.25, 0.5, 0.75)  # the daemon's tick falls anywhere in the second: the verdict must not depend on it


def test_starving_the_transfer_path_fires_and_clears_while_demand_changes_alone_stay_silent() -> None:
    """Decode's processes capped at 0.25 CPU: the tcp/lo reads slow from ~0.5 s to ~1.8 s (vLLM's own
    vllm:nixl_xfer_time_seconds), posts fall to ~1.3/s with ~3-5 reads in flight. One client (low demand)
    and the steady load stay silent."""
    data = load()
    ph = data["phases"]
    daemon_onset = data["daemon_alerts"][1][0]  # the daemon's own alert in that phase
    for phase in PHASES:
        spans = replay(data, phase)
        assert not within(spans, ph["steady_start"], ph["steady_end"]), phase
        assert not within(spans, ph["lowdemand_start"] - 5, ph["lowdemand_end"] + 1), phase
        (starve,) = within(spans, ph["starve_start"], ph["starve_end"])
        assert starve[0] - ph["starve_start"] <= 10.0 and abs(starve[0] - daemon_onset) <= 5.0, (phase, starve)
        assert starve[1] is not None and starve[1] - ph["starve_end"] <= 15.0, (phase, starve)


def test_the_starve_alert_needs_the_stall_evidence() -> None:
    """~1.3 reads complete a second with ~3-5 in flight: under min_transfers (20) in a 5 s window, so only
    the transfers' time (min_stalled_transfers) makes it evidence."""
    data = load()
    ph = data["phases"]
    for phase in PHASES:
        assert not within(replay(data, phase, min_stalled_transfers=10**6), ph["starve_start"], ph["starve_end"])


def test_a_whole_gpu_stall_is_seen_once_its_reads_have_taken_long_enough() -> None:
    """A copy hog time-slicing the GPU stalls prefill, decode and the reads alike (no request completed in 45 s).
    The replay counts a read from its post's entry; the daemon sees it once the post returns, and the posts
    themselves took seconds there, so the daemon fired only as the stuck reads completed after the hog."""
    data = load()
    ph = data["phases"]
    for phase in PHASES:
        (stall,) = within(replay(data, phase), ph["slow_start"], ph["recover_end"])
        assert stall[1] is not None and stall[1] <= ph["recover_end"]
    daemon = data["daemon_alerts"][0]
    assert ph["recover_start"] <= daemon[0] <= ph["recover_start"] + 5 and daemon[1] <= ph["recover_end"]
