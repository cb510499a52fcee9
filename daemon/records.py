"""The daemon's records that leave the loop: alerts (the snapshot and every exporter read them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

ALERT_NAMES = (
    "KVEvictionBurst",
    "KVPreemptionLivelock",
    "KVPrefixCacheIneffective",
    "KVCacheReuseCollapse",
    "KVHostTierEvictionUnderPressure",
    "KVTransferBandwidthCollapse",
    "InferenceProcessOOMKilled",
    "KVWatchProbeDown",
    "KVEngineMetricDivergence",
    "KVWatchProbeShed",
)


@dataclass(frozen=True, slots=True)
class Alert:
    alert: str
    subject_key: str
    labels: Mapping[str, str]
    cause: str
    severity: str
    started_at: float  # wall-clock seconds
    values: Mapping[str, float]
    summary: str
    ended_at: float | None = None
