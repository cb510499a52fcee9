"""CUDA probes for the watched processes: attach on discovery, rescan for libraries
loaded later, detach on exit, and turn the counters into per-process typed observations.

Every failure here is per process: it is counted and logged once, and the
other processes (and the other probe families) keep working.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import structlog

from kvwatch.daemon.config import Config
from kvwatch.daemon.families.attachments import Attached, FamilyProcesses
from kvwatch.daemon.families.runner import UprobeFamily
from kvwatch.daemon.host.procfs import ProcessIdentity
from kvwatch.daemon.logs import ErrorBook
from kvwatch.daemon.model.cuda import CUDA, AllocatorCounts, CopyCounts
from kvwatch.daemon.model.snapshot import CudaView
from kvwatch.daemon.tracker import Tracked
from kvwatch.probes.cuda import CUDA_APIS, AllocationFailed, CudaProbes, LargeAllocation, ProcessCuda
from kvwatch.probes.records import SEGMENT_ALLOCS, SEGMENT_FREES

log = structlog.get_logger("kvwatch.cuda")

# What the reuse-collapse detector counts as the allocator going to the device.


def allocator_counts(c: ProcessCuda) -> AllocatorCounts:
    def ok(labels: Iterable[str]) -> float:
        return float(sum(c.apis[a].ok for a in labels if a in c.apis))

    def nbytes(labels: Iterable[str]) -> float:
        return float(sum(c.apis[a].bytes for a in labels if a in c.apis))

    return AllocatorCounts(
        alloc_calls=ok(SEGMENT_ALLOCS),
        free_calls=ok(SEGMENT_FREES),
        alloc_bytes=nbytes(SEGMENT_ALLOCS),
        freed_bytes=nbytes(SEGMENT_FREES),
        alloc_failures=float(sum(c.apis[a].err for a in SEGMENT_ALLOCS if a in c.apis)),
        frees_after_failure=float(c.frees_after_failure),
        clustered_frees=float(c.clustered_frees),
        seg_2m=float(c.seg_2m),
        seg_20m=float(c.seg_20m),
        max_alloc=float(c.max_alloc),
    )


def copy_counts(c: ProcessCuda) -> CopyCounts:
    """The copies a process made, for the engine's audit and the OS-side eviction view."""
    return CopyCounts(h2d_bytes=float(c.copy_bytes("h2d")), d2h_bytes=float(c.copy_bytes("d2h")))


API_CLASSES = {a.label: "alloc" if a.is_alloc else "free" if a.is_free else "map" for a in CUDA_APIS if not a.is_copy}


@dataclass(slots=True)
class _Attached(Attached):
    failures: dict[tuple[str, int], int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CudaProcessState:
    counters: ProcessCuda | None
    failures: dict[tuple[str, int], int]
    symbols_attached: int
    libraries: tuple[str, ...]
    ucx: bool


class CudaProcesses(FamilyProcesses):
    probes: CudaProbes

    def __init__(
        self,
        probes: CudaProbes,
        errors: ErrorBook,
        *,
        clock: Callable[[], float],
        rescan_seconds: float,
    ) -> None:
        super().__init__(probes, errors, clock=clock, rescan_seconds=rescan_seconds)
        self._counters: dict[int, ProcessCuda] = {}

    def new_attached(self, identity: ProcessIdentity, now: float) -> Attached:
        return _Attached(identity, now)

    def forget(self, pid: int) -> None:
        super().forget(pid)
        self._counters.pop(pid, None)

    def ingest(self) -> None:
        for ev in self.probes.take_events():
            a = self.attached.get(ev.tgid)
            if isinstance(ev, AllocationFailed) and isinstance(a, _Attached):
                key = (ev.api, ev.code)
                a.failures[key] = a.failures.get(key, 0) + 1
            elif isinstance(ev, LargeAllocation):
                log.info("large CUDA allocation", pid=ev.tgid, api=ev.api, bytes=ev.size)
        sample = self.probes.sample()
        self._counters = {pid: c for pid, c in sample.processes.items() if pid in self.attached}
        self.hits, self.lost = sample.hits, dict(sample.lost)
        self.lost["cuda_malformed_events"] = self.probes.malformed

    def observe(self, t: Tracked, now: float) -> None:
        """The process's allocator counts and copies into its histories, while attached."""
        if t.pid in self.attached:
            c = self._counters.get(t.pid)
            t.allocator.add(now, {CUDA: allocator_counts(c) if c is not None else AllocatorCounts()})
            t.copies.add(now, {CUDA: copy_counts(c) if c is not None else CopyCounts()})

    def api_calls(self, pid: int) -> dict[str, float]:
        c = self._counters.get(pid)
        return {api: float(n) for api, n in c.calls_by_api().items()} if c is not None else {}

    def calls(self, pid: int) -> float | None:
        """Every trapped call: the counted ones, and those made beneath one (the driver call inside
        cudaMalloc or cudaMemcpyBatchAsync), counted apart but trapped on entry and return alike."""
        if pid not in self.attached:
            return None
        c = self._counters.get(pid)
        return float(sum(c.calls_by_api().values()) + c.nested) if c is not None else 0.0

    def view(self, pid: int) -> CudaView | None:
        """The process's CUDA counters for the snapshot, while the family tracks it."""
        st = self.state(pid)
        if st is None:
            return None
        c = st.counters
        return CudaView(
            apis=dict(c.apis) if c else {},
            api_classes=API_CLASSES,
            outstanding=c.outstanding() if c else {"device": 0, "host": 0, "vmm": 0},
            failures=st.failures,
            symbols_attached=st.symbols_attached,
            libraries=st.libraries,
            ucx_hooks=st.ucx,
        )

    def state(self, pid: int) -> CudaProcessState | None:
        a = self.attached.get(pid)
        att = self.probes.attachments.get(pid)
        if not isinstance(a, _Attached) or att is None:
            return None
        return CudaProcessState(
            counters=self._counters.get(pid),
            failures=dict(a.failures),
            symbols_attached=att.attached,
            libraries=tuple(lib.path for lib in att.libraries.values()),
            ucx=att.ucx,
        )


CudaFamily = UprobeFamily[CudaProbes, CudaProcesses]


def cuda_family(
    probes: CudaProbes | None,
    config: Config,
    errors: ErrorBook,
    clock: Callable[[], float],
    more_observations: Callable[[Tracked], None] | None = None,
) -> CudaFamily:
    """``more_observations``: NVML's numbers of the process, taken with the family's."""
    return UprobeFamily(
        "cuda",
        probes,
        lambda p: CudaProcesses(p, errors, clock=clock, rescan_seconds=config.probes.cuda_rescan_seconds),
        errors,
        enabled=config.probes.cuda,
        more_observations=more_observations,
    )
