"""Typed records the probe loaders hand to the daemon.

Counters are cumulative since the probe was loaded (never read-and-clear: two
readers can never split a count); the correlator turns them into rates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class HookState(Enum):
    ATTACHED = "attached"
    DISABLED = "disabled"  # switched off in config
    MISSING = "missing"  # the kernel lacks the tracepoint / the library lacks the symbol
    FAILED = "failed"  # the kernel refused it
    SHED = "shed"  # detached by kvwatch's cost budget, attached again after a back-off


@dataclass(frozen=True, slots=True)
class HookStatus:
    """One hook (tracepoint or uprobe) of a probe family."""

    name: str
    family: str
    target: str
    state: HookState
    reason: str = ""
    required: bool = True


@dataclass(frozen=True, slots=True)
class ProcessMemoryCounters:
    """Kernel-memory counters of one watched TGID."""

    tgid: int
    page_free_pages: int = 0
    direct_reclaim_ns: int = 0
    direct_reclaim_count: int = 0
    memcg_reclaim_ns: int = 0
    memcg_reclaim_count: int = 0


@dataclass(frozen=True, slots=True)
class TierCounters:
    """Page-cache counters of one KV tier (a set of directories)."""

    tier_id: int
    reclaim_pages: int = 0
    policy_pages: int = 0
    added_pages: int = 0
    refault_pages: int = 0
    unattributed_pages: int = 0  # reclaimed while the reclaimer map was full: in no ReclaimerKey


# Who reclaims, as the kernel tells them apart: a task inside a direct (global) or memcg (a
# limit) reclaim window, or a kernel thread answering node-wide pressure.
RECLAIMER_KINDS = ("direct", "memcg", "kswapd", "kdamond")
TASK_RECLAIMERS = ("direct", "memcg")


@dataclass(frozen=True, slots=True, order=True)
class ReclaimerKey:
    """One reclaimer of one KV tier, as the kernel keys its pages."""

    tier_id: int
    kind: str  # one of RECLAIMER_KINDS
    cgroup_id: int  # the reclaiming task's cgroup v2 id; 0 for a kernel thread


@dataclass(frozen=True, slots=True)
class MemorySample:
    """Everything the kernel-memory family counted, read at ``monotonic_ns``."""

    monotonic_ns: int
    processes: dict[int, ProcessMemoryCounters]
    tiers: dict[int, TierCounters]
    tier_readers: dict[tuple[int, int], int]  # (tgid, tier_id) → pages brought in
    hits: dict[str, int]
    lost: dict[str, int]
    # pages reclaimed, by reclaimer; read before ``tiers``, so a tier's entries (and its
    # unattributed pages) never add up to more than its reclaim_pages
    reclaimers: dict[ReclaimerKey, int] = field(default_factory=dict)


# --- rare events (ring buffer) ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OomKill:
    victim_pid: int
    victim_comm: str
    watched: bool
    total_vm_kb: int
    anon_rss_kb: int  # the tracepoint reports kB
    file_rss_kb: int
    shmem_rss_kb: int
    killer_tgid: int
    ts_ns: int


@dataclass(frozen=True, slots=True)
class ProcessForked:
    parent_tgid: int
    child_pid: int
    comm: str
    ts_ns: int


@dataclass(frozen=True, slots=True)
class ProcessExec:
    pid: int
    old_pid: int
    filename: str
    comm: str
    ts_ns: int


@dataclass(frozen=True, slots=True)
class ProcessExited:
    tgid: int
    comm: str
    ts_ns: int


@dataclass(frozen=True, slots=True)
class ProcessRenamed:
    tgid: int
    tid: int
    new_comm: str
    ts_ns: int


MemoryEvent = OomKill | ProcessForked | ProcessExec | ProcessExited | ProcessRenamed


@dataclass(slots=True)
class EventBatch:
    """Events drained from the ring buffer since the last tick, plus decode failures."""

    events: list[MemoryEvent] = field(default_factory=list)
    malformed: int = 0


@dataclass(frozen=True, slots=True)
class ApiCounters:
    """One CUDA API in one process: successful and failed calls, bytes, frees of unknown size."""

    ok: int = 0
    err: int = 0
    bytes: int = 0
    unknown: int = 0


# The transfer family's duration histogram: in-kernel log2 buckets of nanoseconds (the BPF
# program gets the same numbers as -D flags); bucket b holds durations < 2^(b + 10) ns (bcc's
# bpf_log2l(d) is floor(log2 d) + 1, and the program keeps max(bpf_log2l(d) - 10, 0)).
NBUCKETS = 26
FIRST_BUCKET_LOG2 = 10
BUCKET_BOUNDS = tuple(2 ** (b + FIRST_BUCKET_LOG2) / 1e9 for b in range(NBUCKETS - 1))  # seconds


def bucket_of(duration_ns: int) -> int:
    """The bucket the BPF program puts a duration in: bcc's bpf_log2l is the bit length."""
    return min(max(duration_ns.bit_length() - FIRST_BUCKET_LOG2, 0), NBUCKETS - 1)


@dataclass(frozen=True, slots=True)
class XferCounters:
    """One (library, operation) of KV transfers in one process."""

    calls: int = 0
    errors: int = 0
    bytes: int = 0
    completed: int = 0
    duration_ns: int = 0
    buckets: tuple[int, ...] = (0,) * NBUCKETS


@dataclass(frozen=True, slots=True)
class TransferDone:
    """One completed KV transfer (NIXL), timed by the kernel; sent only while someone records."""

    tgid: int
    lib: str
    op: str
    bytes: int
    start_ns: int
    end_ns: int
    status: int


# The CUDA APIs that allocate / free allocator segments (device memory and VMM handles)
SEGMENT_ALLOCS = ("cudaMalloc", "cudaMallocAsync", "cuMemAlloc", "cuMemAllocAsync", "cuMemCreate")
SEGMENT_FREES = ("cudaFree", "cudaFreeAsync", "cuMemFree", "cuMemFreeAsync", "cuMemRelease")
