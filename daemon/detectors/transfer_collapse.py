"""KVTransferBandwidthCollapse: KV transfers slowing down while they are still wanted.

Per process (NIXL transfers, whose completion kvwatch sees): effective bandwidth —
bytes over the summed per-transfer completion times — below ``fraction`` x its
baseline, while demand holds (posts, or the transfers in flight on average, at least
``demand_fraction`` of their baseline: slow transfers pile up, or hold the in-flight
share of a load whose posts they throttle) and enough
transfers in the window to judge: ``min_transfers`` completed or in flight, or, when
the path stalls so that few complete at all, ``min_stalled_transfers`` whose time
adds up to what ``min_transfers`` usual ones take (the usual time per transfer is
the baseline concurrency over the baseline post rate, Little's law). Demand falling
is not a collapse; a new peer's first seconds are left out by the tracker.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwatch.daemon.config import TransferCollapseConfig
from kvwatch.daemon.detectors.base import Baseline, Hysteresis
from kvwatch.daemon.detectors.per_process import ProcessDetector
from kvwatch.daemon.model.alerts import AlertSpec
from kvwatch.daemon.model.findings import Finding
from kvwatch.daemon.model.transfers import NIXL, effective_bandwidth, link_utilization
from kvwatch.daemon.model.windows import ProcessWindow

ALERT = "KVTransferBandwidthCollapse"
SPECS = (
    AlertSpec(
        name=ALERT,
        fires_when="NIXL bandwidth < 0.3 × baseline while demand holds",
        severities=("warning",),
        causes=("bandwidth",),
        labels=(),
        summary=(
            "KV transfer bandwidth collapsed ({{ $labels.cause }}): {{ $labels.engine }} pid {{ "
            "$labels.pid }} on {{ $labels.instance }}"
        ),
        description=(
            "Effective KV transfer bandwidth of {{ $labels.engine }} {{ $labels.role }} pid {{ "
            "$labels.pid }} fell far below its baseline; cause {{ $labels.cause }}. Now: {{ with "
            "printf \"sum(kvwatch_transfer_effective_bandwidth_bytes{instance='%s',pid='%s'})\" "
            "$labels.instance $labels.pid | query }}{{ . | first | value | humanize1024 }}B/s{{ else "
            "}}unknown{{ end }}. Disaggregated prefill/decode: time-to-first-token grows with no "
            "error anywhere."
        ),
    ),
)
MB = 1e6


@dataclass(slots=True)
class _State:
    bandwidth: Baseline
    posts: Baseline
    concurrency: Baseline
    hysteresis: Hysteresis
    learning_since: float | None = None


class TransferCollapse(ProcessDetector[TransferCollapseConfig, _State]):
    name = ALERT

    def __init__(self, config: TransferCollapseConfig, link_bytes_per_second: float = 0.0) -> None:
        super().__init__(config)
        self.link = link_bytes_per_second

    def new_state(self) -> _State:
        c = self.config
        h = c.baseline_half_life_seconds
        return _State(Baseline(h), Baseline(h), Baseline(h), Hysteresis(c.confirm_windows, c.clear_windows))

    def applies(self, p: ProcessWindow) -> bool:
        return NIXL in p.transfers

    def measure(self, p: ProcessWindow) -> dict[str, float]:
        """Over the window: transfers completed, plus those still in flight (their bytes over
        their time so far — an upper bound of their bandwidth, so never an alarm of its own)."""
        w = self.config.window_seconds
        done, dt = p.transfers.delta(NIXL, w)
        flying = p.in_flight
        busy = done.seconds + flying.seconds
        out = {
            "effective_bytes_per_second": effective_bandwidth(done, flying),
            "transfers_completed": done.completed,
            "transfers_in_flight": flying.transfers,
            "posts_per_second": done.posts / dt if dt > 0 else 0.0,
            "concurrency": busy / w,
            "transfer_seconds": busy,
            "bytes": done.bytes + flying.bytes,
        }
        share = link_utilization(out["effective_bytes_per_second"], self.link)
        if share is not None:
            out["link_utilization"] = share
        return out

    def judge(self, key: str, st: _State, p: ProcessWindow, now: float) -> Finding:
        c = self.config
        m = self.measure(p)
        bw = m["effective_bytes_per_second"]
        seen = m["transfers_completed"] + m["transfers_in_flight"]
        evidence = seen >= c.min_transfers
        if evidence and st.learning_since is None and p.age >= c.warmup_seconds:
            st.learning_since = now
        warm = st.learning_since is not None and now - st.learning_since >= c.baseline_min_seconds
        usual = st.concurrency.value / st.posts.value if st.posts.value > 0 else 0.0
        stalled = seen >= c.min_stalled_transfers and m["transfer_seconds"] >= c.min_transfers * usual
        evidence = evidence or (warm and usual > 0 and stalled)
        limit = c.fraction * st.bandwidth.value
        demand = (
            m["posts_per_second"] >= c.demand_fraction * st.posts.value
            or m["concurrency"] >= c.demand_fraction * st.concurrency.value
        )
        hot = warm and evidence and bw < limit and demand
        # Too few completions to judge is not recovery: slow transfers complete rarely.
        # The alert clears on good bandwidth again, or when transfers stopped altogether.
        idle = m["posts_per_second"] == 0 and m["transfers_completed"] == 0 and m["transfers_in_flight"] == 0
        cool = (evidence and bw >= 2 * limit) or idle
        firing, _changed = st.hysteresis.step(hot, cool, now)
        if firing or hot or not evidence:
            for b in (st.bandwidth, st.posts, st.concurrency):
                b.hold(now)
        elif st.learning_since is not None:
            st.bandwidth.update(bw, now)
            st.posts.update(m["posts_per_second"], now)
            st.concurrency.update(m["concurrency"], now)
        values = {
            **m,
            "baseline_bytes_per_second": st.bandwidth.value,
            "threshold_bytes_per_second": limit,
            "baseline_posts_per_second": st.posts.value,
            "ratio_to_baseline": bw / st.bandwidth.value if st.bandwidth.value > 0 else 0.0,
            "baseline_seconds_per_transfer": usual,
        }
        link = f", {m['link_utilization']:.0%} of the link" if "link_utilization" in m else ""
        return Finding(
            alert=ALERT,
            subject=p.subject,
            firing=firing,
            cause="bandwidth" if firing else "",
            values=values,
            summary=(
                f"KV transfers of pid {p.subject.labels.get('pid', '?')} at {bw / MB:.1f} MB/s effective "
                f"(baseline {st.bandwidth.value / MB:.1f} MB/s{link}) with {m['posts_per_second']:.1f} "
                f"posts/s and {m['concurrency']:.1f} in flight"
            ),
            severity="warning",
        )
