"""Prometheus families of the CUDA allocator probes: allocation, free and VMM map calls and bytes,
outstanding bytes, failures by error code, and host/device copies, per watched process."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvwatch.daemon.model.snapshot import CudaView, Snapshot
from kvwatch.exporters.labels import PROCESS_LABELS, label_values
from kvwatch.probes.records import ApiCounters


def cuda_families(s: Snapshot) -> Iterator[Metric]:
    fams = _CudaFamilies()
    for p in s.processes:
        if p.cuda is not None:
            fams.add(label_values(p.labels, PROCESS_LABELS), p.cuda)
    yield from fams.families()


class _CudaFamilies:
    def __init__(self) -> None:
        labels = list(PROCESS_LABELS)
        self.alloc_calls = CounterMetricFamily(
            "kvwatch_cuda_alloc_calls",
            "CUDA allocation calls (result ok / error)",
            labels=[*labels, "api", "result"],
        )
        self.alloc_bytes = CounterMetricFamily(
            "kvwatch_cuda_alloc_bytes", "bytes successfully allocated", labels=[*labels, "api"]
        )
        self.free_calls = CounterMetricFamily(
            "kvwatch_cuda_free_calls", "CUDA free calls", labels=[*labels, "api", "result"]
        )
        self.freed_bytes = CounterMetricFamily(
            "kvwatch_cuda_freed_bytes", "bytes freed (allocations kvwatch saw)", labels=[*labels, "api"]
        )
        self.unknown = CounterMetricFamily(
            "kvwatch_cuda_free_unknown",
            "successful frees of allocations made before kvwatch attached (size unknown)",
            labels=[*labels, "api"],
        )
        self.maps = CounterMetricFamily(
            "kvwatch_cuda_vmm_map_calls", "cuMemMap / cuMemUnmap calls", labels=[*labels, "api"]
        )
        self.mapped = CounterMetricFamily(
            "kvwatch_cuda_vmm_mapped_bytes", "bytes mapped / unmapped by the VMM API", labels=[*labels, "api"]
        )
        self.outstanding = GaugeMetricFamily(
            "kvwatch_cuda_outstanding_bytes",
            "allocated minus freed since kvwatch attached (kind: device, host, vmm)",
            labels=[*labels, "kind"],
        )
        self.failures = CounterMetricFamily(
            "kvwatch_cuda_alloc_failures",
            "failed allocation calls by CUDA error code",
            labels=[*labels, "api", "code"],
        )
        self.attached = GaugeMetricFamily(
            "kvwatch_cuda_probes_attached", "CUDA API symbols probed in the process", labels=labels
        )
        self.copy_calls = CounterMetricFamily(
            "kvwatch_cuda_copy_calls",
            "host/device copy calls by direction (h2d, d2h, d2d, default) and result",
            labels=[*labels, "api", "direction", "result"],
        )
        self.copy_bytes = CounterMetricFamily(
            "kvwatch_cuda_copy_bytes",
            "bytes copied between host and device (KV offload d2h, reload h2d)",
            labels=[*labels, "api", "direction"],
        )

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
