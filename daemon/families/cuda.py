"""CUDA probes for the watched processes: attach on discovery, rescan for libraries
loaded later, detach on exit, and turn the counters into per-process series.

Every failure here is per process: it is counted and logged once, and the
other processes (and the other probe families) keep working.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import structlog
from kvwatch.daemon.config import Config
from kvwatch.daemon.families.attachments import Attached, FamilyTracker
from kvwatch.daemon.families.runner import UprobeFamily
from kvwatch.daemon.host.procfs import ProcessIdentity
from kvwatch.daemon.logs import ErrorBook
from kvwatch.probes.cuda import AllocationFailed, CudaProbes, LargeAllocation, ProcessCuda
from kvwatch.probes.records import SEGMENT_ALLOCS, SEGMENT_FREES

log = structlog.get_logger("kvwatch.cuda")

# What the reuse-collapse detector counts as the allocator going to the device.


def cuda_series(c: ProcessCuda) -> dict[str, float]:
    def ok(labels: Iterable[str]) -> float:
        return float(sum(c.apis[a].ok for a in labels if a in c.apis))

    def nbytes(labels: Iterable[str]) -> float:
        return float(sum(c.apis[a].bytes for a in labels if a in c.apis))

    return {
        "cuda_alloc_calls": ok(SEGMENT_ALLOCS),
        "cuda_free_calls": ok(SEGMENT_FREES),
        "cuda_alloc_bytes": nbytes(SEGMENT_ALLOCS),
        "cuda_freed_bytes": nbytes(SEGMENT_FREES),
        "cuda_alloc_failures": float(sum(c.apis[a].err for a in SEGMENT_ALLOCS if a in c.apis)),
        "cuda_frees_after_failure": float(c.frees_after_failure),
        "cuda_clustered_frees": float(c.clustered_frees),
        "cuda_seg_2m": float(c.seg_2m),
        "cuda_seg_20m": float(c.seg_20m),
        "cuda_max_alloc": float(c.max_alloc),
        "cuda_copy_h2d_bytes": float(c.copy_bytes("h2d")),
        "cuda_copy_d2h_bytes": float(c.copy_bytes("d2h")),
    }


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


class CudaTracker(FamilyTracker):
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

    def series(self, pid: int) -> dict[str, float] | None:
        c = self._counters.get(pid)
        if c is None:
            return None if pid not in self.attached else cuda_series(ProcessCuda(apis={}))
        return cuda_series(c)

    def api_calls(self, pid: int) -> dict[str, float]:
        c = self._counters.get(pid)
        return {api: float(n) for api, n in c.calls_by_api().items()} if c is not None else {}

    def calls(self, pid: int) -> float | None:
        if pid not in self.attached:
            return None
        return sum(self.api_calls(pid).values(), 0.0)

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


CudaFamily = UprobeFamily[CudaProbes, CudaTracker]


def cuda_family(probes: CudaProbes | None, config: Config, errors: ErrorBook, clock: Callable[[], float]) -> CudaFamily:
    return UprobeFamily(
        "cuda",
        probes,
        lambda p: CudaTracker(p, errors, clock=clock, rescan_seconds=config.probes.cuda_rescan_seconds),
        enabled=config.probes.cuda,
    )
