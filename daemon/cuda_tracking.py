"""CUDA probes for the watched processes: attach on discovery, rescan for libraries
loaded later, detach on exit, and turn the counters into per-process series.

Every failure here is per process: it is counted and logged once, and the
other processes (and the other probe families) keep working.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import structlog
from kvwatch.daemon.logs import ErrorBook
from kvwatch.daemon.procfs import ProcessIdentity
from kvwatch.daemon.tracker import Tracked
from kvwatch.probes.cuda import (
    CUDA_APIS,
    AllocationFailed,
    CudaProbes,
    LargeAllocation,
    ProcessCuda,
    ProcessGoneDuringAttach,
)
from kvwatch.probes.libs import LibraryError
from kvwatch.probes.records import HookState

log = structlog.get_logger("kvwatch.cuda")

# What the reuse-collapse detector counts as the allocator going to the device.
SEGMENT_ALLOCS = ("cudaMalloc", "cudaMallocAsync", "cuMemAlloc", "cuMemAllocAsync", "cuMemCreate")
SEGMENT_FREES = ("cudaFree", "cudaFreeAsync", "cuMemFree", "cuMemFreeAsync", "cuMemRelease")


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
    }


@dataclass(slots=True)
class _Attached:
    identity: ProcessIdentity
    next_rescan: float
    failures: dict[tuple[str, int], int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CudaProcessState:
    counters: ProcessCuda | None
    failures: dict[tuple[str, int], int]
    symbols_attached: int
    libraries: tuple[str, ...]
    ucx: bool


class CudaTracker:
    def __init__(
        self,
        probes: CudaProbes,
        errors: ErrorBook,
        *,
        clock: Callable[[], float],
        rescan_seconds: float,
    ) -> None:
        self.probes = probes
        self.errors = errors
        self.clock = clock
        self.rescan_seconds = rescan_seconds
        self._attached: dict[int, _Attached] = {}
        self._counters: dict[int, ProcessCuda] = {}
        self.hits: dict[str, int] = {}
        self.lost: dict[str, int] = {}

    def sync(self, tracked: Iterable[Tracked]) -> None:
        """Attach to new processes, rescan due ones, detach the gone."""
        now = self.clock()
        alive = {t.pid: t for t in tracked if t.exited_at is None}
        for pid, a in list(self._attached.items()):
            t = alive.get(pid)
            if t is None or t.proc.identity != a.identity:
                self.detach(pid)
        for pid, t in alive.items():
            known = self._attached.get(pid)
            if known is not None and now < known.next_rescan:
                continue
            if known is None:
                known = self._attached[pid] = _Attached(t.proc.identity, now)
            known.next_rescan = now + self.rescan_seconds
            self._attach(pid)

    def _attach(self, pid: int) -> None:
        previous = self.probes.attachments.get(pid)
        before = len(previous.libraries) if previous is not None else 0
        try:
            att = self.probes.attach(pid)
        except ProcessGoneDuringAttach as err:
            self.errors.record(
                "cuda_attach_process_gone", "process exited while CUDA probes attached", err, pid=pid
            )
            self._attached.pop(pid, None)
            return
        except LibraryError as err:
            self.errors.record("cuda_attach_library", "CUDA library unreadable", err, pid=pid)
            return
        except Exception as err:
            self.errors.record("cuda_attach", "CUDA attach failed", err, pid=pid)
            return
        if len(att.libraries) > before:
            states: dict[str, int] = {}
            for s in att.symbols:
                states[s.state.value] = states.get(s.state.value, 0) + 1
            log.info(
                "cuda probes attached",
                pid=pid,
                libraries=[lib.path for lib in att.libraries.values()],
                symbols=states,
                ucx_hooks=att.ucx,
            )
            for s in att.symbols:
                if s.state is HookState.FAILED:
                    self.errors.record(
                        "cuda_symbol_failed", "CUDA symbol refused", None, api=s.api, reason=s.reason
                    )

    def detach(self, pid: int) -> None:
        try:
            self.probes.detach(pid)
        except Exception as err:
            self.errors.record("cuda_detach", "CUDA detach failed", err, pid=pid)
        self._attached.pop(pid, None)
        self._counters.pop(pid, None)

    def ingest(self) -> None:
        for ev in self.probes.take_events():
            a = self._attached.get(ev.tgid)
            if isinstance(ev, AllocationFailed) and a is not None:
                key = (ev.api, ev.code)
                a.failures[key] = a.failures.get(key, 0) + 1
            elif isinstance(ev, LargeAllocation):
                log.info("large CUDA allocation", pid=ev.tgid, api=ev.api, bytes=ev.size)
        sample = self.probes.sample()
        self._counters = {pid: c for pid, c in sample.processes.items() if pid in self._attached}
        self.hits, self.lost = sample.hits, dict(sample.lost)
        self.lost["cuda_malformed_events"] = self.probes.malformed

    def series(self, pid: int) -> dict[str, float] | None:
        c = self._counters.get(pid)
        if c is None:
            return None if pid not in self._attached else cuda_series(ProcessCuda(apis={}))
        return cuda_series(c)

    def state(self, pid: int) -> CudaProcessState | None:
        a = self._attached.get(pid)
        att = self.probes.attachments.get(pid)
        if a is None or att is None:
            return None
        return CudaProcessState(
            counters=self._counters.get(pid),
            failures=dict(a.failures),
            symbols_attached=att.attached,
            libraries=tuple(lib.path for lib in att.libraries.values()),
            ucx=att.ucx,
        )

    def api_states(self) -> dict[str, HookState]:
        """Per API: attached in at least one process, else why not (for the probe table)."""
        out: dict[str, HookState] = {}
        for att in self.probes.attachments.values():
            for s in att.symbols:
                if s.state is HookState.ATTACHED or s.api not in out:
                    out[s.api] = s.state
        return {a.label: out.get(a.label, HookState.MISSING) for a in CUDA_APIS}

    def close(self) -> None:
        for pid in list(self._attached):
            self.detach(pid)
