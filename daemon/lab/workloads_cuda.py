"""CUDA allocator workloads for `python -m kvwatch.daemon.lab.workloads cuda|cudacalls` (stub or real runtime)."""

from __future__ import annotations

import argparse
import ctypes
import mmap
import sys
import time
from pathlib import Path

from kvwatch.daemon.lab.workload_common import MIB, PAGE, say


class _Cuda:
    """ctypes front to a CUDA runtime + driver (the stub, or a real one)."""

    def __init__(self, lib_dir: Path) -> None:
        self.rt = ctypes.CDLL(str(lib_dir / "libcudart.so.12"))
        self.drv = ctypes.CDLL(str(lib_dir / "libcuda.so.1"))
        self.rt.cudaMalloc.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t)
        self.rt.cudaFree.argtypes = (ctypes.c_void_p,)
        self.rt.cudaMallocAsync.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_void_p)
        self.rt.cudaFreeAsync.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
        self.rt.cudaMemcpyAsync.argtypes = (
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        )
        self.drv.cuMemCreate.argtypes = (
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_ulonglong,
        )
        self.drv.cuMemRelease.argtypes = (ctypes.c_uint64,)
        self.drv.cuMemMap.argtypes = (
            ctypes.c_uint64,
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.c_uint64,
            ctypes.c_ulonglong,
        )
        self.drv.cuMemUnmap.argtypes = (ctypes.c_uint64, ctypes.c_size_t)

    def malloc(self, size: int) -> int | None:
        p = ctypes.c_void_p()
        return p.value if self.rt.cudaMalloc(ctypes.byref(p), size) == 0 else None

    def free(self, ptr: int) -> int:
        return int(self.rt.cudaFree(ctypes.c_void_p(ptr)))


SEGMENTS = (2 * MIB, 20 * MIB)


def _step_emptycache(cu: _Cuda, cache: list[int], i: int) -> None:
    """Segments for the step's tensors, then empty_cache() frees them in one burst."""
    ptrs = [cu.malloc(SEGMENTS[k % 2]) for k in range(6)]
    for p in ptrs:
        if p:
            cu.free(p)


def _step_churn(cu: _Cuda, cache: list[int], i: int) -> None:
    """Allocate and free a block per tensor as tensors come and go (no caching)."""
    p = cu.malloc(SEGMENTS[i % 2])
    if cache:
        cu.free(cache.pop(0))
    if p:
        cache.append(p)


def _step_oomretry(cu: _Cuda, cache: list[int], i: int) -> None:
    """Grow until the device is full; on failure free the whole cache and retry."""
    p = cu.malloc(SEGMENTS[1])
    if p is None:
        while cache:
            cu.free(cache.pop())
        p = cu.malloc(SEGMENTS[1])
    if p:
        cache.append(p)


def _step_growth(cu: _Cuda, cache: list[int], i: int) -> None:
    """A leak: allocations never freed."""
    p = cu.malloc(SEGMENTS[1])
    if p:
        cache.append(p)


def _step_expandable(cu: _Cuda, cache: list[int], i: int) -> None:
    """Expandable segments: physical handles created, mapped, unmapped, released."""
    h = ctypes.c_uint64()
    if cu.drv.cuMemCreate(ctypes.byref(h), SEGMENTS[0], None, 0) == 0:
        cu.drv.cuMemMap(0x7E0000000000, SEGMENTS[0], 0, h.value, 0)
        cu.drv.cuMemUnmap(0x7E0000000000, SEGMENTS[0])
        cu.drv.cuMemRelease(h.value)


def _step_asyncpool(cu: _Cuda, cache: list[int], i: int) -> None:
    """backend:cudaMallocAsync: a call per tensor, by design."""
    ptr = ctypes.c_void_p()
    if cu.rt.cudaMallocAsync(ctypes.byref(ptr), SEGMENTS[0], None) == 0 and ptr.value:
        cu.rt.cudaFreeAsync(ptr, None)


def _step_offload(cu: _Cuda, cache: list[int], i: int) -> None:
    """A KV block stored to host memory and another loaded back: one D2H, one H2D copy of 2 MiB."""
    for kind in (2, 1):
        cu.rt.cudaMemcpyAsync(None, None, 2 * MIB, kind, None)


def _step_cached(cu: _Cuda, cache: list[int], i: int) -> None:
    """Every tensor comes from the cache: no CUDA call at all."""


CUDA_STEPS = {
    "cached": _step_cached,
    "emptycache": _step_emptycache,
    "uncached": _step_churn,
    "fragmentation": _step_churn,
    "oomretry": _step_oomretry,
    "growth": _step_growth,
    "expandable": _step_expandable,
    "asyncpool": _step_asyncpool,
    "offload": _step_offload,
}


def cmd_cuda(args: argparse.Namespace) -> None:
    """Phases on stdin: each line "PATTERN RATE SECONDS" runs round(RATE x SECONDS) steps of that
    allocator pattern (at least one), paced at RATE steps/s, then answers "done"; "quit" ends.
    The number of steps never depends on how fast the machine is (a test counts them)."""
    cu = _Cuda(Path(args.lib_dir))
    cache: list[int] = []
    for _ in range(args.prealloc):
        p = cu.malloc(20 * MIB)
        if p:
            cache.append(p)
    say("ready")
    i = 0
    while True:
        line = sys.stdin.readline().split()
        if not line or line[0] == "quit":
            return
        pattern, rate, seconds = line[0], float(line[1]), float(line[2])
        period = 1.0 / rate if rate > 0 else seconds
        nxt = time.monotonic()
        for _ in range(max(1, round(rate * seconds))):
            CUDA_STEPS[pattern](cu, cache, i)
            i += 1
            nxt += period
            time.sleep(max(0.0, nxt - time.monotonic()))
        say("done")


def _copying(rt: ctypes.CDLL) -> ctypes.CDLL:
    rt.cudaMemcpyAsync.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
    return rt


def _spin(rt: ctypes.CDLL, seconds: float) -> int:
    rt = _copying(rt)
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        for _ in range(1000):
            rt.cudaMemcpyAsync(None, None, PAGE, 1, None)
        n += 1000
    return n


def cmd_cudacalls(args: argparse.Namespace) -> None:
    """Exact numbers of CUDA runtime calls through a given libcudart (real or stub).
    Lines: "spin SECONDS" (copies back to back, answering "done N"),
    "call N" (N cudaMalloc then N cudaFree; "calllast N" through the library
    loaded last), "load PATH" (dlopen another
    library later), "unload" (dlclose it), "map PATH" (mmap any file), "quit"."""
    libs = [ctypes.CDLL(args.lib)]
    maps: list[mmap.mmap] = []
    say("ready")
    while True:
        words = sys.stdin.readline().split()
        if not words or words[0] == "quit":
            return
        if words[0] in ("call", "calllast"):  # calllast: through the library loaded last
            rt = libs[0] if words[0] == "call" else libs[-1]
            ok, first_rc = 0, None
            ptrs = []
            for i in range(int(words[1])):
                p = ctypes.c_void_p()
                rc = rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(PAGE * (i + 1)))
                first_rc = rc if first_rc is None else first_rc
                ok += rc == 0
                ptrs.append(p.value if rc == 0 and p.value else 0x1000 + i)
            for ptr in ptrs:
                rt.cudaFree(ctypes.c_void_p(ptr))
            say(f"done {ok} {first_rc}")
        elif words[0] == "spin":  # spin SECONDS: cudaMemcpyAsync of 4 KiB host->device, back to back
            say(f"done {_spin(libs[0], float(words[1]))}")
        elif words[0] == "copy":  # copy KIND N SIZE: N cudaMemcpyAsync of SIZE bytes in direction KIND
            rt = _copying(libs[0])
            kind, n, size = int(words[1]), int(words[2]), int(words[3])
            rcs = [rt.cudaMemcpyAsync(None, None, size, kind, None) for _ in range(n)]
            say(f"done {sum(rc == 0 for rc in rcs)} {rcs[0] if rcs else None}")
        elif words[0] == "batch":
            rcs = batch_copies(libs[0], Path(args.lib), words[1:])
            say(f"done {sum(rc == 0 for rc in rcs)} {rcs[0] if rcs else None}")
        elif words[0] == "load":
            libs.append(ctypes.CDLL(words[1]))
            say("loaded")
        elif words[0] == "unload":
            import _ctypes  # noqa: PLC0415 - dlclose lives here

            _ctypes.dlclose(libs.pop()._handle)
            say("unloaded")
        elif words[0] == "map":
            with open(words[1], "rb") as f:
                maps.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
            say("mapped")


class _MemcpyAttributes(ctypes.Structure):  # CUmemcpyAttributes / cudaMemcpyAttributes
    _fields_ = (
        ("src_access_order", ctypes.c_uint32),
        ("src_type", ctypes.c_uint32),
        ("src_id", ctypes.c_uint32),
        ("dst_type", ctypes.c_uint32),
        ("dst_id", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
    )


BATCH_SYMBOLS = {
    "runtime": "cudaMemcpyBatchAsync",
    "driver": "cuMemcpyBatchAsync",
    "driver_v2": "cuMemcpyBatchAsync_v2",
}


def batch_copies(rt: ctypes.CDLL, rt_path: Path, words: list[str]) -> list[int]:
    """``batch API DIR N ENTRIES SIZE``: N batched copies of ENTRIES blocks each, block i of
    SIZE + i bytes (so only a sum of the sizes array is right), between a pinned host buffer
    (cudaHostAlloc) and device memory (cudaMalloc) — as vLLM offloads KV blocks. DIR: h2d, d2h,
    or hint-h2d (the direction only in the location hints, pointers outside any host range)."""
    api, direction, n, entries, size = words[0], words[1], int(words[2]), int(words[3]), int(words[4])
    lib = rt if api == "runtime" else ctypes.CDLL(str(rt_path.with_name("libcuda.so.1")))
    fn = getattr(lib, BATCH_SYMBOLS[api])
    span = max(entries * (size + entries), 1 << 20)
    host, dev = ctypes.c_void_p(), ctypes.c_void_p()
    rt.cudaHostAlloc.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint)
    rt.cudaMalloc.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t)
    if rt.cudaHostAlloc(ctypes.byref(host), span, 0) or rt.cudaMalloc(ctypes.byref(dev), span):
        return [-1]
    h, d = int(host.value or 0), int(dev.value or 0)
    attrs = _MemcpyAttributes(src_access_order=1)
    if direction == "hint-h2d":
        h = 0x10_0000_0000  # in no host range: only the hints can tell
        attrs.src_type, attrs.dst_type = 2, 1  # HOST -> DEVICE
    src_base, dst_base = (d, h) if direction == "d2h" else (h, d)
    arr = ctypes.c_uint64 * entries
    offsets = [i * size + i * (i - 1) // 2 for i in range(entries)]
    srcs, dsts = arr(*(src_base + o for o in offsets)), arr(*(dst_base + o for o in offsets))
    sizes = arr(*(size + i for i in range(entries)))
    idx, fail = ctypes.c_size_t(0), ctypes.c_size_t(0)
    rcs = []
    for _ in range(n):
        tail = (ctypes.byref(fail), None) if api == "driver" else (None,)
        rcs.append(fn(dsts, srcs, sizes, ctypes.c_size_t(entries), ctypes.byref(attrs), ctypes.byref(idx), 1, *tail))
    return rcs
