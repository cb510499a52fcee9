"""What the CUDA family observes of a process's caching allocator and copies each tick, typed.

Kept in the process's ``History`` under ``CUDA``; read by KVCacheReuseCollapse / CUDAMemoryGrowth
(over their window) and the snapshot's rates.
"""

from __future__ import annotations

from dataclasses import dataclass

CUDA = "cuda"  # the history's key: the CUDA runtime and driver, whose segment calls are probed
TREE = "engine_tree"  # the copies history's key for the copies of an engine's processes, summed on the tapped one


@dataclass(frozen=True, slots=True)
class AllocatorCounts:
    """Cumulative: the segment calls the allocator made to the device (cudaMalloc & co.) that
    succeeded, their bytes (frees: of known sizes), the allocations that failed, frees soon after a
    failure, frees in bursts (``empty_cache``), 2 MiB and 20 MiB segments allocated, and the largest
    single allocation seen (the KV pool, once allocated)."""

    alloc_calls: float = 0.0
    free_calls: float = 0.0
    alloc_bytes: float = 0.0
    freed_bytes: float = 0.0
    alloc_failures: float = 0.0
    frees_after_failure: float = 0.0
    clustered_frees: float = 0.0
    seg_2m: float = 0.0
    seg_20m: float = 0.0
    max_alloc: float = 0.0


@dataclass(frozen=True, slots=True)
class CopyCounts:
    """Cumulative bytes copied between host and device (the copy probes), under ``CUDA`` for the
    process's own and ``TREE`` for its engine's processes together."""

    h2d_bytes: float = 0.0
    d2h_bytes: float = 0.0


@dataclass(frozen=True, slots=True)
class GpuUse:
    """NVML's figures for a process, latest: the largest GPU's memory and what the process holds."""

    device_total_bytes: float = 0.0
    used_bytes: float = 0.0
