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


@dataclass(frozen=True, slots=True)
class FamilyCost:
    """What one uprobe family's probes cost one watched process (``daemon/selfcost.py``)."""

    family: str  # cuda / transfer
    cost_seconds: float  # estimated, cumulative: probed calls x the per-call cost
    ratio: float | None  # of the process's CPU time, over the last judged window
    shed: bool  # its probes detached by the budget's circuit breaker
    sheds: int  # times they were


@dataclass(frozen=True, slots=True)
class ProgramRuns:
    family: str  # memory / cuda / transfer
    program: str  # the BPF function
    run_seconds: float  # kernel-side, while BPF statistics were on
    runs: int


@dataclass(frozen=True, slots=True)
class SelfCostView:
    """The node's side of the self-cost meter."""

    bpf_stats: bool  # the kernel's BPF run-time statistics are on
    canary_call_ns: float | None  # a probed call's cost to its caller, timed at start
    call_ns: Mapping[str, tuple[float, str]]  # per family: the per-call cost the meter uses, and its
    # source: canary / canary+bpf_stats / config
    programs: tuple[ProgramRuns, ...] = ()
    sheds: Mapping[str, int] | None = None  # per family, since start
