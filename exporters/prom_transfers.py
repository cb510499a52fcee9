"""Prometheus families of the KV transfer probes (NIXL, UCX, NCCL, RDMA registration): bytes and
calls per library and operation, NIXL completion times and bandwidth, per watched process."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from kvwatch.daemon.model.snapshot import Snapshot, TransferView
from kvwatch.daemon.model.transfers import link_utilization
from kvwatch.exporters.labels import PROCESS_LABELS, label_values
from kvwatch.exporters.metric_specs import COUNTER, GAUGE, HISTOGRAM, Metrics, MetricSpec
from kvwatch.exporters.prom_aggregates import completions_by_lib, cumulative_buckets, xfer_ok_calls

METRICS = Metrics(
    (
        MetricSpec(
            "kvwatch_transfer_bytes",
            COUNTER,
            "bytes moved by KV transfer calls (nixl: completed transfers; ucx, nccl: submitted)",
            (*PROCESS_LABELS, "lib", "op"),
        ),
        MetricSpec(
            "kvwatch_transfer_calls",
            COUNTER,
            "transfer calls (nixl: posts) by result",
            (*PROCESS_LABELS, "lib", "op", "result"),
        ),
        MetricSpec("kvwatch_transfer_completed", COUNTER, "NIXL transfers completed", (*PROCESS_LABELS, "lib")),
        MetricSpec(
            "kvwatch_transfer_duration_seconds",
            HISTOGRAM,
            "per-transfer completion time (post to done)",
            (*PROCESS_LABELS, "lib"),
        ),
        MetricSpec(
            "kvwatch_transfer_effective_bandwidth_bytes",
            GAUGE,
            "bytes over the summed per-transfer completion times, last 5 s",
            (*PROCESS_LABELS, "lib"),
        ),
        MetricSpec(
            "kvwatch_transfer_link_utilization_ratio",
            GAUGE,
            "effective bandwidth over the configured link bandwidth",
            (*PROCESS_LABELS, "lib"),
        ),
        MetricSpec(
            "kvwatch_rdma_registered_bytes",
            GAUGE,
            "memory registered for RDMA (ibv_reg_mr*) minus deregistered",
            PROCESS_LABELS,
        ),
        MetricSpec(
            "kvwatch_rdma_registrations", COUNTER, "RDMA memory registrations by result", (*PROCESS_LABELS, "result")
        ),
        MetricSpec("kvwatch_transfer_probes_attached", GAUGE, "transfer API symbols probed", PROCESS_LABELS),
        MetricSpec(
            "kvwatch_transfer_link_bandwidth_bytes",
            GAUGE,
            "configured KV transfer link bandwidth (bytes/s, 0: unknown)",
            (),
        ),
        MetricSpec("kvwatch_transfer_pending", GAUGE, "NIXL transfers posted and not completed yet", ()),
    )
)


def transfer_families(s: Snapshot) -> Iterator[Metric]:
    fams = _TransferFamilies()
    for p in s.processes:
        if p.transfers is not None:
            fams.add(label_values(p.labels, PROCESS_LABELS), p.transfers, s.link_bytes_per_second)
    yield from fams.families()
    link = METRICS.gauge("kvwatch_transfer_link_bandwidth_bytes")
    link.add_metric([], s.link_bytes_per_second)
    yield link
    pending = METRICS.gauge("kvwatch_transfer_pending")
    pending.add_metric([], s.transfers_pending)
    yield pending


class _TransferFamilies:
    def __init__(self) -> None:
        self.nbytes = METRICS.counter("kvwatch_transfer_bytes")
        self.calls = METRICS.counter("kvwatch_transfer_calls")
        self.completed = METRICS.counter("kvwatch_transfer_completed")
        self.duration = METRICS.histogram("kvwatch_transfer_duration_seconds")
        self.bandwidth = METRICS.gauge("kvwatch_transfer_effective_bandwidth_bytes")
        self.utilization = METRICS.gauge("kvwatch_transfer_link_utilization_ratio")
        self.registered = METRICS.gauge("kvwatch_rdma_registered_bytes")
        self.registrations = METRICS.counter("kvwatch_rdma_registrations")
        self.attached = METRICS.gauge("kvwatch_transfer_probes_attached")

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
