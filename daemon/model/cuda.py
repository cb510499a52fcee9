"""What the CUDA family observes of a process's caching allocator each tick, typed.

Kept in the process's ``History`` under ``CUDA``; read by KVCacheReuseCollapse / CUDAMemoryGrowth
(over their window) and the snapshot's rates.
"""

from __future__ import annotations

from dataclasses import dataclass

CUDA = "cuda"  # the history's key: the CUDA runtime and driver, whose segment calls are probed


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
