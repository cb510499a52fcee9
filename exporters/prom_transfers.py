"""Prometheus families of the KV transfer probes (NIXL, UCX, NCCL, RDMA registration): bytes and
calls per library and operation, NIXL completion times and bandwidth, per watched process."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from kvwatch.daemon.model.snapshot import Snapshot, TransferView
from kvwatch.daemon.model.transfers import link_utilization
from kvwatch.exporters.labels import PROCESS_LABELS, label_values
from kvwatch.exporters.prom_aggregates import completions_by_lib, cumulative_buckets, xfer_ok_calls


def transfer_families(s: Snapshot) -> Iterator[Metric]:
    fams = _TransferFamilies()
    for p in s.processes:
        if p.transfers is not None:
            fams.add(label_values(p.labels, PROCESS_LABELS), p.transfers, s.link_bytes_per_second)
    yield from fams.families()
    link = GaugeMetricFamily(
        "kvwatch_transfer_link_bandwidth_bytes", "configured KV transfer link bandwidth (bytes/s, 0: unknown)"
    )
    link.add_metric([], s.link_bytes_per_second)
    yield link
    pending = GaugeMetricFamily("kvwatch_transfer_pending", "NIXL transfers posted and not completed yet")
    pending.add_metric([], s.transfers_pending)
    yield pending


class _TransferFamilies:
    def __init__(self) -> None:
        labels = list(PROCESS_LABELS)
        self.nbytes = CounterMetricFamily(
            "kvwatch_transfer_bytes",
            "bytes moved by KV transfer calls (nixl: completed transfers; ucx, nccl: submitted)",
            labels=[*labels, "lib", "op"],
        )
        self.calls = CounterMetricFamily(
            "kvwatch_transfer_calls", "transfer calls (nixl: posts) by result", labels=[*labels, "lib", "op", "result"]
        )
        self.completed = CounterMetricFamily(
            "kvwatch_transfer_completed", "NIXL transfers completed", labels=[*labels, "lib"]
        )
        self.duration = HistogramMetricFamily(
            "kvwatch_transfer_duration_seconds", "per-transfer completion time (post to done)", labels=[*labels, "lib"]
        )
        self.bandwidth = GaugeMetricFamily(
            "kvwatch_transfer_effective_bandwidth_bytes",
            "bytes over the summed per-transfer completion times, last 5 s",
            labels=[*labels, "lib"],
        )
        self.utilization = GaugeMetricFamily(
            "kvwatch_transfer_link_utilization_ratio",
            "effective bandwidth over the configured link bandwidth",
            labels=[*labels, "lib"],
        )
        self.registered = GaugeMetricFamily(
            "kvwatch_rdma_registered_bytes",
            "memory registered for RDMA (ibv_reg_mr*) minus deregistered",
            labels=labels,
        )
        self.registrations = CounterMetricFamily(
            "kvwatch_rdma_registrations", "RDMA memory registrations by result", labels=[*labels, "result"]
        )
        self.attached = GaugeMetricFamily(
            "kvwatch_transfer_probes_attached", "transfer API symbols probed", labels=labels
        )

    def add(self, v: list[str], x: TransferView, link_bytes_per_second: float) -> None:
        self.attached.add_metric(v, x.symbols_attached)
        self.registered.add_metric(v, x.registered_bytes)
        self.registrations.add_metric([*v, "ok"], x.registrations)
        self.registrations.add_metric([*v, "error"], x.registration_errors)
        for (lib, op), c in sorted(x.xfers.items()):
            self.nbytes.add_metric([*v, lib, op], c.bytes)
            self.calls.add_metric([*v, lib, op, "ok"], xfer_ok_calls(lib, c))
            self.calls.add_metric([*v, lib, op, "error"], c.errors)
        # completions are timed for NIXL only (post to done); UCX and NCCL count submitted calls
        nixl = completions_by_lib(x.xfers).get("nixl")
        if nixl is None:
            return
        self.completed.add_metric([*v, "nixl"], nixl.completed)
        self.duration.add_metric([*v, "nixl"], cumulative_buckets(nixl), nixl.duration_ns / 1e9)
        self.bandwidth.add_metric([*v, "nixl"], x.effective_bytes_per_second)
        ratio = link_utilization(x.effective_bytes_per_second, link_bytes_per_second)
        if ratio is not None:
            self.utilization.add_metric([*v, "nixl"], ratio)

    def families(self) -> Iterator[Metric]:
        yield from (
            self.nbytes,
            self.calls,
            self.completed,
            self.duration,
            self.bandwidth,
            self.utilization,
            self.registered,
            self.registrations,
            self.attached,
        )
