"""Every detector the loop runs, from one list: adding a detector is its module (the detector and
its alerts' specs) and a line here and in ``ALERT_SPECS``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar, Protocol

from kvwatch.daemon.config import DetectorsConfig
from kvwatch.daemon.detectors import (
    eviction_burst,
    host_tier,
    metric_divergence,
    oom,
    preemption_livelock,
    prefix_cache,
    probe_down,
    probe_shed,
    reuse_collapse,
    tenant_thrash,
    transfer_collapse,
)
from kvwatch.daemon.detectors.eviction_burst import EvictionBurst
from kvwatch.daemon.detectors.host_tier import HostTierEviction
from kvwatch.daemon.detectors.metric_divergence import EngineMetricDivergence
from kvwatch.daemon.detectors.oom import OOMKilled
from kvwatch.daemon.detectors.preemption_livelock import PreemptionLivelock
from kvwatch.daemon.detectors.prefix_cache import PrefixCacheIneffective
from kvwatch.daemon.detectors.probe_down import ProbeDown
from kvwatch.daemon.detectors.probe_shed import ProbeShed
from kvwatch.daemon.detectors.reuse_collapse import ReuseCollapse
from kvwatch.daemon.detectors.tenant_thrash import TenantThrash
from kvwatch.daemon.detectors.transfer_collapse import TransferCollapse
from kvwatch.daemon.model.alerts import AlertSpec
from kvwatch.daemon.model.findings import Finding
from kvwatch.daemon.model.windows import NodeWindow


class Detector(Protocol):
    """A pure function of the view and its own state: findings for every subject it judges."""

    name: str
    alerts: ClassVar[tuple[str, ...]]  # every alert it raises (() on a ProcessDetector: its name alone)
    outlives_subject: ClassVar[bool]  # its alerts stay active when their subject is gone

    def evaluate(self, view: NodeWindow) -> list[Finding]: ...

    def forget(self, subject_key: str) -> None: ...


def build_detectors(config: DetectorsConfig, link_bytes_per_second: float) -> list[Detector]:
    return [
        HostTierEviction(config.host_tier_eviction),
        ReuseCollapse(config.reuse_collapse),
        TransferCollapse(config.transfer_collapse, link_bytes_per_second),
        EvictionBurst(config.eviction_burst),
        PrefixCacheIneffective(config.prefix_cache_ineffective),
        PreemptionLivelock(config.preemption_livelock),
        TenantThrash(config.tenant_thrash),
        EngineMetricDivergence(config.engine_metric_divergence),
        OOMKilled(config.oom),
        ProbeDown(),
        ProbeShed(),
    ]


def alert_names(detectors: Iterable[Detector]) -> tuple[str, ...]:
    """Every alert the detectors raise, in their order: what the alert book counts from zero."""
    return tuple(n for d in detectors for n in (d.alerts or (d.name,)))


def lasting_alerts(detectors: Iterable[Detector]) -> frozenset[str]:
    """Alerts that stay when their subject (a process) is gone."""
    return frozenset(n for d in detectors if d.outlives_subject for n in (d.alerts or (d.name,)))


# Every alert a detector raises, the engine's KV first and kvwatch's own last: the rules, the README's table and the
# exported alert labels are generated from these (deploy/prometheus/generate.py).
ALERT_SPECS: tuple[AlertSpec, ...] = (
    *eviction_burst.SPECS,
    *preemption_livelock.SPECS,
    *prefix_cache.SPECS,
    *tenant_thrash.SPECS,
    *reuse_collapse.SPECS,
    *host_tier.SPECS,
    *transfer_collapse.SPECS,
    *oom.SPECS,
    *metric_divergence.SPECS,
    *probe_down.SPECS,
    *probe_shed.SPECS,
)


def alert_label_names(specs: Iterable[AlertSpec] = ALERT_SPECS) -> tuple[str, ...]:
    """The labels alerts carry beyond alert, cause, severity and a process's: every spec's, once,
    in order."""
    return tuple(dict.fromkeys(label for s in specs for label in s.labels))
