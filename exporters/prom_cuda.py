"""Prometheus families of the CUDA allocator probes: allocation, free and VMM map calls and bytes,
outstanding bytes, failures by error code, and host/device copies, per watched process."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from kvwatch.daemon.model.snapshot import CudaView, Snapshot
from kvwatch.exporters.labels import PROCESS_LABELS, label_values
from kvwatch.exporters.metric_specs import COUNTER, GAUGE, Metrics, MetricSpec
from kvwatch.probes.records import ApiCounters

METRICS = Metrics(
    (
        MetricSpec(
            "kvwatch_cuda_alloc_calls",
            COUNTER,
            "CUDA allocation calls (result ok / error)",
            (*PROCESS_LABELS, "api", "result"),
        ),
        MetricSpec("kvwatch_cuda_alloc_bytes", COUNTER, "bytes successfully allocated", (*PROCESS_LABELS, "api")),
        MetricSpec("kvwatch_cuda_free_calls", COUNTER, "CUDA free calls", (*PROCESS_LABELS, "api", "result")),
        MetricSpec(
            "kvwatch_cuda_freed_bytes", COUNTER, "bytes freed (allocations kvwatch saw)", (*PROCESS_LABELS, "api")
        ),
        MetricSpec(
            "kvwatch_cuda_free_unknown",
            COUNTER,
            "successful frees of allocations made before kvwatch attached (size unknown)",
            (*PROCESS_LABELS, "api"),
        ),
        MetricSpec("kvwatch_cuda_vmm_map_calls", COUNTER, "cuMemMap / cuMemUnmap calls", (*PROCESS_LABELS, "api")),
        MetricSpec(
            "kvwatch_cuda_vmm_mapped_bytes", COUNTER, "bytes mapped / unmapped by the VMM API", (*PROCESS_LABELS, "api")
        ),
        MetricSpec(
            "kvwatch_cuda_outstanding_bytes",
            GAUGE,
            "allocated minus freed since kvwatch attached (kind: device, host, vmm)",
            (*PROCESS_LABELS, "kind"),
        ),
        MetricSpec(
            "kvwatch_cuda_alloc_failures",
            COUNTER,
            "failed allocation calls by CUDA error code",
            (*PROCESS_LABELS, "api", "code"),
        ),
        MetricSpec("kvwatch_cuda_probes_attached", GAUGE, "CUDA API symbols probed in the process", PROCESS_LABELS),
        MetricSpec(
            "kvwatch_cuda_copy_calls",
            COUNTER,
            "host/device copy calls by direction (h2d, d2h, d2d, default) and result",
            (*PROCESS_LABELS, "api", "direction", "result"),
        ),
        MetricSpec(
            "kvwatch_cuda_copy_bytes",
            COUNTER,
            "bytes copied between host and device (KV offload d2h, reload h2d)",
            (*PROCESS_LABELS, "api", "direction"),
        ),
    )
)


def cuda_families(s: Snapshot) -> Iterator[Metric]:
    fams = _CudaFamilies()
    for p in s.processes:
        if p.cuda is not None:
            fams.add(label_values(p.labels, PROCESS_LABELS), p.cuda)
    yield from fams.families()


class _CudaFamilies:
    def __init__(self) -> None:
        self.alloc_calls = METRICS.counter("kvwatch_cuda_alloc_calls")
        self.alloc_bytes = METRICS.counter("kvwatch_cuda_alloc_bytes")
        self.free_calls = METRICS.counter("kvwatch_cuda_free_calls")
        self.freed_bytes = METRICS.counter("kvwatch_cuda_freed_bytes")
        self.unknown = METRICS.counter("kvwatch_cuda_free_unknown")
        self.maps = METRICS.counter("kvwatch_cuda_vmm_map_calls")
        self.mapped = METRICS.counter("kvwatch_cuda_vmm_mapped_bytes")
        self.outstanding = METRICS.gauge("kvwatch_cuda_outstanding_bytes")
        self.failures = METRICS.counter("kvwatch_cuda_alloc_failures")
        self.attached = METRICS.gauge("kvwatch_cuda_probes_attached")
        self.copy_calls = METRICS.counter("kvwatch_cuda_copy_calls")
        self.copy_bytes = METRICS.counter("kvwatch_cuda_copy_bytes")

    def add(self, v: list[str], cuda: CudaView) -> None:
        self.attached.add_metric(v, cuda.symbols_attached)
        for kind, n in sorted(cuda.outstanding.items()):
            self.outstanding.add_metric([*v, kind], n)
        for (label, code), n in sorted(cuda.failures.items()):
            self.failures.add_metric([*v, label, str(code)], n)
        for label, c in sorted(cuda.apis.items()):
            api_label, sep, direction = label.partition(":")
            if sep:  # copies: one row per direction
                self.copy_calls.add_metric([*v, api_label, direction, "ok"], c.ok)
                self.copy_calls.add_metric([*v, api_label, direction, "error"], c.err)
                self.copy_bytes.add_metric([*v, api_label, direction], c.bytes)
        # every allocation API probed is exported, from zero until its first call
        for label, klass in cuda.api_classes.items():
            self._add_api(v, label, klass, cuda.apis.get(label) or ApiCounters())

    def _add_api(self, v: list[str], label: str, klass: str, c: ApiCounters) -> None:
        if klass == "alloc":
            self.alloc_calls.add_metric([*v, label, "ok"], c.ok)
            self.alloc_calls.add_metric([*v, label, "error"], c.err)
            self.alloc_bytes.add_metric([*v, label], c.bytes)
        elif klass == "free":
            self.free_calls.add_metric([*v, label, "ok"], c.ok)
            self.free_calls.add_metric([*v, label, "error"], c.err)
            self.freed_bytes.add_metric([*v, label], c.bytes)
            self.unknown.add_metric([*v, label], c.unknown)
        else:
            self.maps.add_metric([*v, label], c.ok)
            self.mapped.add_metric([*v, label], c.bytes)

    def families(self) -> Iterator[Metric]:
        yield from (
            self.alloc_calls,
            self.alloc_bytes,
            self.free_calls,
            self.freed_bytes,
            self.unknown,
            self.maps,
            self.mapped,
            self.outstanding,
            self.failures,
            self.attached,
            self.copy_calls,
            self.copy_bytes,
        )
