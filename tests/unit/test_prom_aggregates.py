"""The values the Prometheus families derive from a snapshot, apart from the family layout."""

from __future__ import annotations

from kvwatch.daemon.alerts import AlertBook
from kvwatch.daemon.config import DetectorsConfig
from kvwatch.daemon.detectors.registry import alert_names, build_detectors, lasting_alerts
from kvwatch.exporters.prom_aggregates import (
    completions_by_lib,
    cumulative_buckets,
    snapshot_age,
    xfer_ok_calls,
)
from kvwatch.probes.records import BUCKET_BOUNDS, NBUCKETS, XferCounters


def test_snapshot_age_is_zero_before_the_first_snapshot_and_never_negative() -> None:
    assert snapshot_age(0.0, 1000.0) == 0.0
    assert snapshot_age(990.0, 1000.0) == 10.0
    assert snapshot_age(1010.0, 1000.0) == 0.0  # wall clock stepped back


def test_nixl_counts_failed_posts_among_its_calls() -> None:
    c = XferCounters(calls=10, errors=3)
    assert xfer_ok_calls("nixl", c) == 7
    assert xfer_ok_calls("nccl", c) == 10


def test_completions_sum_over_a_libraries_operations() -> None:
    one = (1,) + (0,) * (NBUCKETS - 1)
    write = XferCounters(calls=5, bytes=100, completed=4, duration_ns=40, buckets=one)
    read = XferCounters(calls=2, completed=2, duration_ns=6, buckets=one)
    send = XferCounters(calls=9, bytes=900)
    per_lib = completions_by_lib({("nixl", "write"): write, ("nixl", "read"): read, ("nccl", "send"): send})
    assert per_lib["nccl"] is send  # one operation: its counters as they are
    nixl = per_lib["nixl"]
    assert (nixl.completed, nixl.duration_ns, nixl.buckets[0]) == (6, 46, 2)


def test_cumulative_buckets_end_with_every_completion() -> None:
    counts = (2, 0, 3) + (0,) * (NBUCKETS - 4) + (1,)  # the last kernel bucket is open-ended
    buckets = cumulative_buckets(XferCounters(completed=6, buckets=counts))
    assert len(buckets) == len(BUCKET_BOUNDS) + 1
    assert [n for _, n in buckets[:3]] == [2, 2, 5]
    assert buckets[-2][1] == 5 and buckets[-1] == ("+Inf", 6)
    assert buckets[0][0] == f"{BUCKET_BOUNDS[0]:.9g}"


def test_every_alert_the_detectors_raise_is_counted_from_zero() -> None:
    """The alert book counts onsets of every alert the registry's detectors can raise (a detector
    that raises two, as KVCacheReuseCollapse with CUDAMemoryGrowth, names both)."""
    detectors = build_detectors(DetectorsConfig(), 0.0)
    book = AlertBook([], alert_names(detectors), lasting_alerts(detectors))
    assert len(book.fired) == len(detectors) + 1 and set(book.fired.values()) == {0}
    assert {"CUDAMemoryGrowth", "KVCacheReuseCollapse", "KVWatchProbeShed"} <= set(book.fired)
    assert book.lasting == {"InferenceProcessOOMKilled"}
