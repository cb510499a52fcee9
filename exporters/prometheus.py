"""Prometheus custom collector: fresh metric families from the latest snapshot on every scrape.

Per-process series exist exactly while the process is watched (no labelled
Gauge leaking dead label sets); nothing here touches BPF maps, so concurrent
scrapers always agree. Each source's families are built in its own module
(exporters/prom_*.py) from the one snapshot a scrape reads, so they agree with
each other too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CollectorRegistry, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from kvwatch.daemon.model.snapshot import Snapshot
from kvwatch.exporters import (
    prom_agent,
    prom_alerts,
    prom_audit,
    prom_cuda,
    prom_engine_tiers,
    prom_engines,
    prom_losses,
    prom_memory,
    prom_selfcost,
    prom_tenants,
    prom_transfers,
)


class SnapshotCollector(Collector):
    def __init__(
        self,
        get_snapshot: Callable[[], Snapshot],
        *,
        version: str = "",
        bcc_version: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.get_snapshot = get_snapshot
        self.version = version
        self.bcc_version = bcc_version
        self.clock = clock

    def describe(self) -> Iterator[Metric]:
        # Families are the same on every scrape; describing them from an empty
        # snapshot lets the registry check names without a live daemon.
        yield from self._families(Snapshot.empty())

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self.get_snapshot())

    def _families(self, s: Snapshot) -> Iterator[Metric]:
        # The exposition order is part of the contract (tests/fixtures/golden_metrics.txt).
        yield from prom_agent.health_families(s, self.version, self.bcc_version, self.clock)
        yield from prom_agent.probe_families(s)
        yield from prom_agent.watch_families(s)
        yield from prom_memory.process_families(s)
        yield from prom_cuda.cuda_families(s)
        yield from prom_transfers.transfer_families(s)
        yield from prom_engines.engine_families(s)
        yield from prom_losses.loss_families(s)
        yield from prom_tenants.tenant_families(s)
        yield from prom_engine_tiers.tier_families(s)
        yield from prom_audit.audit_families(s)
        yield from prom_memory.tier_families(s)
        yield from prom_memory.oom_family(s)
        yield from prom_alerts.active_family(s)
        yield from prom_alerts.alertmanager_family(s)
        yield from prom_agent.uprobe_release_family(s)
        yield from prom_selfcost.self_cost_families(s)
        yield from prom_alerts.fired_family(s)
        yield from prom_memory.psi_family(s)


def build_registry(collector: SnapshotCollector, *, self_process: bool = True) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    if self_process:
        ProcessCollector(namespace="kvwatch", registry=registry)
    return registry
