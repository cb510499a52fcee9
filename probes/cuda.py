"""Loader for the CUDA allocation probe family (``cuda.bpf.c``).

One program, compiled once; per watched process, uprobes are attached (with
``pid=``) to the exact ``libcudart.so.N`` and ``libcuda.so.1`` files it mapped,
by ELF address read once per file. Libraries loaded later are picked up by
``refresh``; ``detach`` releases everything of a process, also after it exited.
Costs and caveats are at the top of ``cuda.bpf.c``.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvwatch.probes.bpf import PROBES_DIR, Program, percpu_sum, program_text
from kvwatch.probes.errors import ProbeAttachError
from kvwatch.probes.libs import (
    CUDART,
    LIBCUDA,
    LIBUCM,
    LibraryError,
    MappedLibrary,
    SymbolCache,
    SymbolTable,
    matching,
    read_maps,
)
from kvwatch.probes.records import HookState

FAMILY = "cuda"
SOURCE = PROBES_DIR / "cuda.bpf.c"

OP_ALLOC_OUT, OP_REGISTER, OP_FREE, OP_MAP, OP_UNMAP = 1, 2, 3, 4, 5
KINDS = ("device", "host", "vmm")


@dataclass(frozen=True, slots=True)
class CudaApi:
    symbol: str  # the exported (versioned) symbol
    label: str  # the ``api`` label users see
    lib: str  # "cudart" or "cuda"
    op: int
    kind: str
    ptr_arg: int  # out-pointer (alloc) or key (free/register) argument, 1-based; 0 none
    size_arg: int  # size argument, 1-based; 0 none
    ucx_patched: bool = False  # UCX's memory hooks rewrite this driver function's entry

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


# The single table: its order gives the API indices passed to the C code.
CUDA_APIS: tuple[CudaApi, ...] = (
    CudaApi("cudaMalloc", "cudaMalloc", "cudart", OP_ALLOC_OUT, "device", 1, 2),
    CudaApi("cudaMallocAsync", "cudaMallocAsync", "cudart", OP_ALLOC_OUT, "device", 1, 2),
    CudaApi("cudaMallocHost", "cudaMallocHost", "cudart", OP_ALLOC_OUT, "host", 1, 2),
    CudaApi("cudaHostAlloc", "cudaHostAlloc", "cudart", OP_ALLOC_OUT, "host", 1, 2),
    CudaApi("cudaHostRegister", "cudaHostRegister", "cudart", OP_REGISTER, "host", 1, 2),
    CudaApi("cudaFree", "cudaFree", "cudart", OP_FREE, "device", 1, 0),
    CudaApi("cudaFreeAsync", "cudaFreeAsync", "cudart", OP_FREE, "device", 1, 0),
    CudaApi("cudaFreeHost", "cudaFreeHost", "cudart", OP_FREE, "host", 1, 0),
    CudaApi("cudaHostUnregister", "cudaHostUnregister", "cudart", OP_FREE, "host", 1, 0),
    CudaApi("cuMemAlloc_v2", "cuMemAlloc", "cuda", OP_ALLOC_OUT, "device", 1, 2, ucx_patched=True),
    CudaApi("cuMemAllocAsync", "cuMemAllocAsync", "cuda", OP_ALLOC_OUT, "device", 1, 2, ucx_patched=True),
    CudaApi("cuMemFree_v2", "cuMemFree", "cuda", OP_FREE, "device", 1, 0, ucx_patched=True),
    CudaApi("cuMemFreeAsync", "cuMemFreeAsync", "cuda", OP_FREE, "device", 1, 0, ucx_patched=True),
    CudaApi("cuMemCreate", "cuMemCreate", "cuda", OP_ALLOC_OUT, "vmm", 1, 2),
    CudaApi("cuMemRelease", "cuMemRelease", "cuda", OP_FREE, "vmm", 1, 0),
    CudaApi("cuMemMap", "cuMemMap", "cuda", OP_MAP, "vmm", 0, 2, ucx_patched=True),
    CudaApi("cuMemUnmap", "cuMemUnmap", "cuda", OP_UNMAP, "vmm", 0, 2, ucx_patched=True),
)
API_INDEX = {a.label: i for i, a in enumerate(CUDA_APIS)}

LOST_SOURCES = ("ringbuf", "stale_inflight", "inflight_full", "stats_full", "ledger_full")
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
class ApiCounters:
    ok: int = 0
    err: int = 0
    bytes: int = 0
    unknown: int = 0


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


@dataclass(frozen=True, slots=True)
class SymbolAttach:
    library: str  # path as the process sees it
    api: str
    state: HookState
    reason: str = ""


@dataclass(slots=True)
class ProcessAttachment:
    pid: int
    libraries: dict[tuple[str, int], MappedLibrary] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    symbols: list[SymbolAttach] = field(default_factory=list)
    ucx: bool = False
    runtime: bool = False  # maps a libcudart

    @property
    def attached(self) -> int:
        return sum(1 for s in self.symbols if s.state is HookState.ATTACHED)


class ProcessGoneDuringAttach(Exception):
    pass


class _RawEvent(ctypes.Structure):
    _fields_ = (
        ("type", ctypes.c_uint32),
        ("tgid", ctypes.c_uint32),
        ("api", ctypes.c_uint32),
        ("rc", ctypes.c_int32),
        ("size", ctypes.c_uint64),
        ("ts_ns", ctypes.c_uint64),
    )


def decode_event(data: bytes) -> AllocationFailed | LargeAllocation:
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


class CudaProbes:
    family = FAMILY

    def __init__(
        self,
        options: CudaProbeOptions | None = None,
        *,
        proc_root: Path = Path("/proc"),
        program_factory: Callable[[Path, list[str]], Program] = Program,
    ) -> None:
        self.options = options or CudaProbeOptions()
        self.proc_root = proc_root
        self._program_factory = program_factory
        self._prog: Program | None = None
        self.symbols = SymbolCache()
        self.attachments: dict[int, ProcessAttachment] = {}
        self._events: list[AllocationFailed | LargeAllocation] = []
        self.malformed = 0

    def cflags(self) -> list[str]:
        o = self.options
        kind = {k: i for i, k in enumerate(KINDS)}
        table = " ".join(
            f"X({a.symbol},{i},{i},{a.op},{kind[a.kind]},{a.ptr_arg},{a.size_arg})"
            for i, a in enumerate(CUDA_APIS)
        )
        flags = [
            f"-DKVW_NR_HITS={len(CUDA_APIS)}",
            f"-DKVW_NR_LOST={len(LOST_SOURCES)}",
            f"-DMAX_LEDGER={o.max_ledger}",
            f"-DMAX_CUDA_PROCS={o.max_processes}",
            f"-DRINGBUF_PAGES={o.ringbuf_pages}",
            f"-DLARGE_ALLOC_BYTES={o.large_alloc_bytes}ULL",
            f"-DKVW_CUDA_APIS={table}",
        ]
        flags += [f"-DKVW_LOST_{s.upper()}={i}" for i, s in enumerate(LOST_SOURCES)]
        return flags

    def start(self) -> None:
        self._prog = self._program_factory(SOURCE, self.cflags())
        self._prog.open_ring_buffer("cuda_events", self._on_event)

    @property
    def program(self) -> Program:
        if self._prog is None:
            raise RuntimeError("CUDA probes not started")
        return self._prog

    def ebpf_text(self) -> str:
        return f"// cflags: {' '.join(self.cflags())}\n" + program_text(SOURCE)

    # --- attachment ----------------------------------------------------------------------
    def libraries(self, pid: int) -> tuple[list[MappedLibrary], bool]:
        """(CUDA libraries the process mapped, whether UCX's memory hooks are loaded)."""
        libs = read_maps(pid, self.proc_root)
        cuda = matching(libs, CUDART)
        if self.options.driver_api != "off":
            cuda += matching(libs, LIBCUDA)
        return cuda, bool(matching(libs, LIBUCM))

    def attach(self, pid: int) -> ProcessAttachment:
        """Attach to every CUDA library ``pid`` mapped and we have not attached yet.

        Raises ``ProcessGoneDuringAttach`` when the process exits midway (what was
        attached is then detached); a symbol that is missing or refused is a status.
        """
        att = self.attachments.setdefault(pid, ProcessAttachment(pid))
        try:
            libs, ucx = self.libraries(pid)
        except OSError as err:
            self.detach(pid)
            raise ProcessGoneDuringAttach(f"pid {pid}: {err}") from err
        att.ucx = att.ucx or ucx
        att.runtime = att.runtime or any(CUDART.match(lib.name) for lib in libs)
        for lib in libs:
            key = (lib.dev, lib.inode)
            if key in att.libraries:
                continue
            att.libraries[key] = lib
            self._attach_library(att, lib)
        return att

    def _attach_library(self, att: ProcessAttachment, lib: MappedLibrary) -> None:
        host_path = lib.host_path(self.proc_root)
        kind = "cudart" if CUDART.match(lib.name) else "cuda"
        try:
            table = self.symbols.get(host_path)
        except LibraryError as err:
            if not Path(self.proc_root / str(att.pid)).exists():
                self.detach(att.pid)
                raise ProcessGoneDuringAttach(str(err)) from err
            for api in CUDA_APIS:
                if api.lib == kind:
                    att.symbols.append(SymbolAttach(lib.path, api.label, HookState.FAILED, str(err)))
            return
        for api in CUDA_APIS:
            if api.lib == kind:
                att.symbols.append(self._attach_symbol(att, lib, host_path, table, api))

    def _skip_reason(self, att: ProcessAttachment, api: CudaApi) -> str:
        if api.ucx_patched and att.ucx:
            return "UCX memory hooks patch this function"
        if api.beneath_runtime and att.runtime and self.options.driver_api == "auto":
            return "counted above, by the CUDA runtime"
        return ""

    def _attach_symbol(
        self, att: ProcessAttachment, lib: MappedLibrary, host_path: str, table: SymbolTable, api: CudaApi
    ) -> SymbolAttach:
        skip = self._skip_reason(att, api)
        if skip:
            return SymbolAttach(lib.path, api.label, HookState.DISABLED, skip)
        addr = table.probe_address(api.symbol)
        if addr is None:
            return SymbolAttach(lib.path, api.label, HookState.MISSING, f"no {api.symbol} in {lib.name}")
        try:
            for retprobe, fn in ((False, f"kvw_enter_{api.symbol}"), (True, f"kvw_return_{api.symbol}")):
                ev = self.program.attach_uprobe(
                    api.label, host_path, fn, pid=att.pid, addr=addr, retprobe=retprobe
                )
                if ev:
                    att.events.append(ev)
        except ProbeAttachError as err:
            if not (self.proc_root / str(att.pid)).exists():
                self.detach(att.pid)
                raise ProcessGoneDuringAttach(f"pid {att.pid} exited during attach") from err
            return SymbolAttach(lib.path, api.label, HookState.FAILED, err.reason)
        return SymbolAttach(lib.path, api.label, HookState.ATTACHED)

    def detach(self, pid: int) -> int:
        att = self.attachments.pop(pid, None)
        if att is None:
            return 0
        n = sum(1 for ev in att.events if self.program.detach_uprobe_event(ev))
        self.forget_counters(pid)
        return n

    def forget_counters(self, tgid: int) -> None:
        prog = self.program
        for name in ("api_stats", "ledger"):
            table = prog.table(name)
            for k in [k for k in table if k.tgid == tgid]:
                with contextlib.suppress(KeyError):
                    del table[k]
        pc = prog.table("proc_cuda")
        with contextlib.suppress(KeyError):
            del pc[pc.Key(tgid)]

    # --- reading -------------------------------------------------------------------------------
    def _on_event(self, data: bytes) -> None:
        try:
            self._events.append(decode_event(data))
        except ValueError:
            self.malformed += 1

    def poll(self, timeout_ms: int) -> None:
        self.program.poll(timeout_ms)

    def consume(self) -> None:
        self.program.consume()

    def take_events(self) -> list[AllocationFailed | LargeAllocation]:
        out, self._events = self._events, []
        return out

    def sample(self) -> CudaSample:
        prog = self.program
        per: dict[int, dict[str, ApiCounters]] = {}
        for k, values in prog.table("api_stats").items():
            if k.api >= len(CUDA_APIS):
                continue
            per.setdefault(int(k.tgid), {})[CUDA_APIS[k.api].label] = ApiCounters(
                **percpu_sum(values, _STAT_FIELDS)
            )
        extra = {int(k.value): v for k, v in prog.table("proc_cuda").items()}
        procs = {}
        for tgid in set(per) | set(extra):
            v = extra.get(tgid)
            procs[tgid] = ProcessCuda(
                apis=per.get(tgid, {}),
                **({f: int(getattr(v, f)) for f in _PROC_FIELDS} if v is not None else {}),
            )
        hits_t, lost_t = prog.table("hits"), prog.table("lost")
        return CudaSample(
            monotonic_ns=time.monotonic_ns(),
            processes=procs,
            hits={a.label: sum(int(x) for x in hits_t[hits_t.Key(i)]) for i, a in enumerate(CUDA_APIS)},
            lost={s: sum(int(x) for x in lost_t[lost_t.Key(i)]) for i, s in enumerate(LOST_SOURCES)},
        )

    def close(self) -> None:
        if self._prog is not None:
            for pid in list(self.attachments):
                self.detach(pid)
            self._prog.close()
            self._prog = None
