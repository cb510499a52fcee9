"""What the kernel-memory family observes each tick, typed: a watched process's counters and a
KV tier's page cache (and who reclaimed it).

A process's ``MemoryCounters`` go into its ``memory`` history under ``MEMORY``; a tier's
``TierCounters`` into the tier's history under ``PAGES``, and the bytes each reclaimer row took
from it (``families/reclaimers.py``) into another, by the row's key. Read by KVHostTierEviction,
the loss ledger and the snapshot, which shows these same records.
"""

from __future__ import annotations

from dataclasses import dataclass

MEMORY = "memory"  # a process's history key: its kernel-memory counters
PAGES = "pages"  # a tier's history key: its page cache


@dataclass(frozen=True, slots=True)
class MemoryCounters:
    """A process's kernel-memory counters, cumulative since kvwatch began watching it."""

    page_free_pages: float = 0.0
    direct_reclaim_seconds: float = 0.0  # stalled in global direct reclaim
    direct_reclaim_count: float = 0.0
    memcg_reclaim_seconds: float = 0.0  # stalled reclaiming against its memory cgroup's limit
    memcg_reclaim_count: float = 0.0


@dataclass(frozen=True, slots=True)
class TierCounters:
    """A KV tier's page cache, cumulative: bytes and pages dropped by reclaim or by the engine
    deleting its files, pages read back after reclaim, pages added."""

    reclaim_bytes: float = 0.0
    policy_bytes: float = 0.0
    reclaim_pages: float = 0.0
    policy_pages: float = 0.0
    refault_pages: float = 0.0
    added_pages: float = 0.0


@dataclass(frozen=True, slots=True)
class Reclaimed:
    """Bytes of a tier's page cache one reclaimer row took, cumulative."""

    bytes: float = 0.0
