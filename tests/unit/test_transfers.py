"""The transfer model's definitions (daemon/model/transfers.py): bandwidth and link share, once."""

from __future__ import annotations

from kvwatch.daemon.model.transfers import TransferCounts, TransfersInFlight, effective_bandwidth, link_utilization


def test_effective_bandwidth_is_bytes_over_busy_time_with_the_transfers_in_flight() -> None:
    done = TransferCounts(posts=29, completed=23, bytes=23 * 4e6, seconds=23 * 0.004)
    assert abs(effective_bandwidth(done) - 1e9) < 1e-3
    slow = TransfersInFlight(transfers=7, bytes=7 * 4e6, seconds=7 * 2.0)
    assert abs(effective_bandwidth(done, slow) - 30 * 4e6 / (23 * 0.004 + 14.0)) < 1e-6
    assert effective_bandwidth(TransferCounts()) == 0.0


def test_link_utilization_needs_a_known_link() -> None:
    assert link_utilization(5e9, 50e9) == 0.1
    assert link_utilization(5e9, 0.0) is None
