"""Loader for the CUDA allocation probe family (``cuda.bpf.c``).

One program, compiled once; per watched process, uprobes are attached (with
``pid=``) to the exact ``libcudart.so.N`` and ``libcuda.so.1`` files it mapped,
by ELF address read once per file. Libraries loaded later are picked up by
``refresh``; ``detach`` releases everything of a process, also after it exited.
Costs and caveats are at the top of ``cuda.bpf.c``.
"""

from __future__ import annotations

import ctypes
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kvwatch.probes.bpf import PROBES_DIR, Program, percpu_sum, program_text
from kvwatch.probes.cstruct import read_structs
from kvwatch.probes.libs import CUDART, LIBCUDA, LIBUCM, MappedLibrary, matching
from kvwatch.probes.records import ApiCounters
from kvwatch.probes.uprobes import PerProcessUprobes, ProcessAttachment, ProcessGoneDuringAttach, UprobeApi

__all__ = ["ProcessGoneDuringAttach"]

FAMILY = "cuda"
SOURCE = PROBES_DIR / "cuda.bpf.c"

OP_ALLOC_OUT, OP_REGISTER, OP_FREE, OP_MAP, OP_UNMAP, OP_COPY, OP_BATCH_COPY = 1, 2, 3, 4, 5, 6, 7
KINDS = ("device", "host", "vmm")
# cudaMemcpyKind (the runtime's direction argument; the driver's copy functions have it in their name)
COPY_DIRECTIONS = ("h2h", "h2d", "d2h", "d2d", "default")


@dataclass(frozen=True, slots=True)
class CudaApi(UprobeApi):
    op: int = 0
    kind: str = "device"
    ptr_arg: int = 0  # out-pointer (alloc) or key (free/register) argument, 1-based; 0 none
    size_arg: int = 0  # size argument, 1-based; 0 none
    ucx_patched: bool = False  # UCX's memory hooks rewrite this driver function's entry
    copy_dir: int = 0  # copies: the direction (cudaMemcpyKind) when fixed by the function, 0: from ptr_arg

    @property
    def beneath_runtime(self) -> bool:
        """A driver call that a runtime allocation makes underneath (cudaMalloc -> cuMemAlloc_v2)."""
        return self.lib == "cuda" and self.op in (OP_ALLOC_OUT, OP_FREE) and self.kind == "device"

    @property
    def is_alloc(self) -> bool:
        return self.op in (OP_ALLOC_OUT, OP_REGISTER)

    @property
    def is_free(self) -> bool:
        return self.op == OP_FREE

    @property
    def is_copy(self) -> bool:
        return self.op in (OP_COPY, OP_BATCH_COPY)


def _api(  # noqa: PLR0917 - one table row per call, positional on purpose
    symbol: str, label: str, lib: str, op: int, kind: str, ptr: int, size: int, *, ucx: bool = False
) -> CudaApi:
    return CudaApi(label, lib, symbol, symbol, op=op, kind=kind, ptr_arg=ptr, size_arg=size, ucx_patched=ucx)


def _copy(symbol: str, label: str, lib: str, *, size: int, direction_arg: int = 0, direction: int = 0) -> CudaApi:
    return CudaApi(label, lib, symbol, symbol, op=OP_COPY, ptr_arg=direction_arg, size_arg=size, copy_dir=direction)


def _batch(symbol: str, label: str, lib: str) -> CudaApi:
    """(dsts, srcs, sizes, count, attrs, ...): the entry reads the sizes and finds the direction."""
    return CudaApi(label, lib, symbol, symbol, op=OP_BATCH_COPY)


# The single table: its order gives the API indices passed to the C code.
CUDA_APIS: tuple[CudaApi, ...] = (
    _api("cudaMalloc", "cudaMalloc", "cudart", OP_ALLOC_OUT, "device", 1, 2),
    _api("cudaMallocAsync", "cudaMallocAsync", "cudart", OP_ALLOC_OUT, "device", 1, 2),
    _api("cudaMallocHost", "cudaMallocHost", "cudart", OP_ALLOC_OUT, "host", 1, 2),
    _api("cudaHostAlloc", "cudaHostAlloc", "cudart", OP_ALLOC_OUT, "host", 1, 2),
    _api("cudaHostRegister", "cudaHostRegister", "cudart", OP_REGISTER, "host", 1, 2),
    _api("cudaFree", "cudaFree", "cudart", OP_FREE, "device", 1, 0),
    _api("cudaFreeAsync", "cudaFreeAsync", "cudart", OP_FREE, "device", 1, 0),
    _api("cudaFreeHost", "cudaFreeHost", "cudart", OP_FREE, "host", 1, 0),
    _api("cudaHostUnregister", "cudaHostUnregister", "cudart", OP_FREE, "host", 1, 0),
    _api("cuMemAlloc_v2", "cuMemAlloc", "cuda", OP_ALLOC_OUT, "device", 1, 2, ucx=True),
    _api("cuMemAllocAsync", "cuMemAllocAsync", "cuda", OP_ALLOC_OUT, "device", 1, 2, ucx=True),
    _api("cuMemFree_v2", "cuMemFree", "cuda", OP_FREE, "device", 1, 0, ucx=True),
    _api("cuMemFreeAsync", "cuMemFreeAsync", "cuda", OP_FREE, "device", 1, 0, ucx=True),
    _api("cuMemCreate", "cuMemCreate", "cuda", OP_ALLOC_OUT, "vmm", 1, 2),
    _api("cuMemRelease", "cuMemRelease", "cuda", OP_FREE, "vmm", 1, 0),
    _api("cuMemMap", "cuMemMap", "cuda", OP_MAP, "vmm", 0, 2, ucx=True),
    _api("cuMemUnmap", "cuMemUnmap", "cuda", OP_UNMAP, "vmm", 0, 2, ucx=True),
    # copies between host and device: KV offload (store to host) and reload (back to the GPU)
    _copy("cudaMemcpyAsync", "cudaMemcpyAsync", "cudart", size=3, direction_arg=4),
    _copy("cudaMemcpy", "cudaMemcpy", "cudart", size=3, direction_arg=4),
    _copy("cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync", "cuda", size=3, direction=1),
    _copy("cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync", "cuda", size=3, direction=2),
    _copy("cuMemcpyHtoD_v2", "cuMemcpyHtoD", "cuda", size=3, direction=1),
    _copy("cuMemcpyDtoH_v2", "cuMemcpyDtoH", "cuda", size=3, direction=2),
    # batched copies: vLLM's KV offload (one call per transfer, through the driver)
    _batch("cudaMemcpyBatchAsync", "cudaMemcpyBatchAsync", "cudart"),
    _batch("cuMemcpyBatchAsync", "cuMemcpyBatchAsync", "cuda"),
    _batch("cuMemcpyBatchAsync_v2", "cuMemcpyBatchAsync_v2", "cuda"),
)

LOST_SOURCES = (
    "ringbuf",
    "stale_inflight",
    "inflight_full",
    "stats_full",
    "ledger_full",
    "batch_truncated",  # a batched copy of more entries than the probe reads (its bytes are short)
    "batch_unreadable",  # a batched copy whose sizes array could not be read
)
_STAT_FIELDS = ("ok", "err", "bytes", "unknown")
_PROC_FIELDS = (
    "frees_after_failure",
    "clustered_frees",
    "seg_2m",
    "seg_20m",
    "max_alloc",
    "nested",
)


@dataclass(frozen=True, slots=True)
class ProcessCuda:
    """Everything the CUDA probes counted for one TGID (cumulative since attach)."""

    apis: dict[str, ApiCounters]  # by label
    frees_after_failure: int = 0
    clustered_frees: int = 0
    seg_2m: int = 0
    seg_20m: int = 0
    max_alloc: int = 0
    nested: int = 0

    def alloc_calls(self, labels: tuple[str, ...]) -> int:
        return sum(self.apis[a].ok for a in labels if a in self.apis)

    def outstanding(self) -> dict[str, int]:
        out = dict.fromkeys(KINDS, 0)
        for api in CUDA_APIS:
            c = self.apis.get(api.label)
            if c is None:
                continue
            if api.is_alloc:
                out[api.kind] += c.bytes
            elif api.is_free:
                out[api.kind] -= c.bytes
        return out

    def calls_by_api(self) -> dict[str, int]:
        """Calls made (ok or not) per API label, a copy API's directions together."""
        out: dict[str, int] = {}
        for label, c in self.apis.items():
            api = label.partition(":")[0]
            out[api] = out.get(api, 0) + c.ok + c.err
        return out

    def copy_bytes(self, direction: str) -> int:
        """Bytes copied in one direction (h2d, d2h, ...) by every copy API."""
        return sum(c.bytes for label, c in self.apis.items() if label.endswith(f":{direction}"))


@dataclass(frozen=True, slots=True)
class AllocationFailed:
    tgid: int
    api: str
    code: int
    size: int
    ts_ns: int


@dataclass(frozen=True, slots=True)
class LargeAllocation:
    tgid: int
    api: str
    size: int
    ts_ns: int


@dataclass(frozen=True, slots=True)
class CudaSample:
    monotonic_ns: int
    processes: dict[int, ProcessCuda]
    hits: dict[str, int]
    lost: dict[str, int]


# The ring-buffer record, declared in C only: ``struct cuda_event_t`` of SOURCE, read at import.
RING_STRUCTS = read_structs(program_text(SOURCE), "cuda_event_t")
_RawEvent = RING_STRUCTS["cuda_event_t"]


CudaEvent = AllocationFailed | LargeAllocation


def decode_event(data: bytes) -> CudaEvent:
    if len(data) < ctypes.sizeof(_RawEvent):
        raise ValueError(f"short event: {len(data)} bytes")
    e = _RawEvent.from_buffer_copy(data)
    if e.api >= len(CUDA_APIS):
        raise ValueError(f"unknown api {e.api}")
    api = CUDA_APIS[e.api].label
    if e.type == 1:
        return AllocationFailed(e.tgid, api, e.rc, e.size, e.ts_ns)
    if e.type == 2:
        return LargeAllocation(e.tgid, api, e.size, e.ts_ns)
    raise ValueError(f"unknown event type {e.type}")


@dataclass(frozen=True, slots=True)
class CudaProbeOptions:
    max_ledger: int = 65536
    max_processes: int = 1024
    ringbuf_pages: int = 16
    large_alloc_bytes: int = 1 << 30
    # libcuda too: "all"; "auto" leaves out the driver's plain allocation calls
    # (cuMemAlloc_v2 & co.) in processes that map a CUDA runtime, whose calls are
    # counted a layer above and would otherwise pay a second probe pair each;
    # "off": runtime only. UCX's patched functions are always left alone.
    driver_api: str = "auto"


class CudaProbes(PerProcessUprobes[CudaEvent]):
    family = FAMILY
    libraries_by_kind: ClassVar[dict[str, re.Pattern[str]]] = {"cudart": CUDART, "cuda": LIBCUDA}
    apis: ClassVar[Sequence[UprobeApi]] = CUDA_APIS
    source: ClassVar[Path] = SOURCE
    ring_buffer = "cuda_events"
    lost_sources: ClassVar[Sequence[str]] = LOST_SOURCES
    mirrors: ClassVar[Mapping[str, type[ctypes.Structure]]] = RING_STRUCTS
    process_maps: ClassVar[Sequence[str]] = ("api_stats", "ledger", "host_ranges")
    process_map = "proc_cuda"
    thread_maps: ClassVar[Sequence[str]] = ("inflight",)

    def __init__(
        self,
        options: CudaProbeOptions | None = None,
        *,
        proc_root: Path = Path("/proc"),
        program_factory: Callable[[Path, list[str]], Program] = Program,
    ) -> None:
        super().__init__(proc_root)
        self.options = options or CudaProbeOptions()
        self._program_factory = program_factory

    def program_flags(self) -> list[str]:
        o = self.options
        kind = {k: i for i, k in enumerate(KINDS)}
        table = " ".join(
            f"X({a.fn},{i},{i},{a.op},{a.copy_dir if a.is_copy else kind[a.kind]},{a.ptr_arg},{a.size_arg})"
            for i, a in enumerate(CUDA_APIS)
        )
        return [
            f"-DMAX_LEDGER={o.max_ledger}",
            f"-DMAX_CUDA_PROCS={o.max_processes}",
            f"-DRINGBUF_PAGES={o.ringbuf_pages}",
            f"-DLARGE_ALLOC_BYTES={o.large_alloc_bytes}ULL",
            f"-DKVW_CUDA_APIS={table}",
        ]

    # --- attachment rules ----------------------------------------------------------------
    def kind_of(self, lib: MappedLibrary) -> str | None:
        kind = super().kind_of(lib)
        return None if kind == "cuda" and self.options.driver_api == "off" else kind

    def process_flags(self, libs: Sequence[MappedLibrary]) -> set[str]:
        flags = set()
        if matching(libs, LIBUCM):
            flags.add("ucx")
        if matching(libs, CUDART):
            flags.add("runtime")
        return flags

    def skip_reason(self, att: ProcessAttachment, api: UprobeApi) -> str:
        if not isinstance(api, CudaApi):
            return ""
        if api.ucx_patched and att.ucx:
            return "UCX memory hooks patch this function"
        if api.beneath_runtime and "runtime" in att.flags and self.options.driver_api == "auto":
            return "counted above, by the CUDA runtime"
        return ""

    # --- reading -------------------------------------------------------------------------------
    def decode(self, data: bytes) -> CudaEvent:
        return decode_event(data)

    def sample(self) -> CudaSample:
        prog = self.program
        per: dict[int, dict[str, ApiCounters]] = {}
        for k, values in prog.table("api_stats").items():
            index, direction = k.api & 0xFF, k.api >> 8  # copies: one row per direction
            if index >= len(CUDA_APIS) or direction >= len(COPY_DIRECTIONS):
                continue
            api = CUDA_APIS[index]
            label = f"{api.label}:{COPY_DIRECTIONS[direction]}" if api.is_copy else api.label
            per.setdefault(int(k.tgid), {})[label] = ApiCounters(**percpu_sum(values, _STAT_FIELDS))
        extra = {int(k.value): v for k, v in prog.table("proc_cuda").items()}
        procs = {}
        for tgid in set(per) | set(extra):
            v = extra.get(tgid)
            procs[tgid] = ProcessCuda(
                apis=per.get(tgid, {}),
                **({f: int(getattr(v, f)) for f in _PROC_FIELDS} if v is not None else {}),
            )
        return CudaSample(
            monotonic_ns=time.monotonic_ns(),
            processes=procs,
            hits=self.hit_counts(),
            lost=self.lost_counts(),
        )
