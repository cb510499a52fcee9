"""What the engine taps count of an engine's KV event stream each tick, typed.

Per medium (``GPU``, ``CPU``, a tier's name), one ``MediumCounts`` in the tapped process's ``kv``
history; the stream-wide events (caches cleared, batches lost) under ``STREAM`` in its
``kv_events`` history; and the stream's gauges as one ``KVState``. Logical counts follow each
medium's reference KV cache group (the full-attention blocks that hold a request's whole
prefix); physical counts are every group's (``docs/architecture.md``, "KV cache groups").
"""

from __future__ import annotations

from dataclasses import dataclass

STREAM = "stream"  # the kv_events history's key: every stream of the process together


@dataclass(frozen=True, slots=True)
class MediumCounts:
    """One medium's cumulative block counts over the process's streams."""

    stored: float = 0.0  # logical: blocks stored
    removed: float = 0.0  # ... evicted
    removed_young: float = 0.0  # ... evicted soon after being stored
    regretted: float = 0.0  # ... stored again after an eviction the stream remembered
    restored: float = 0.0  # ... stored again while still held
    announced: float = 0.0  # ... held blocks announced again (prefix hits)
    announced_tokens: float = 0.0  # the hit tokens those stand for
    physical_stored: float = 0.0  # physical: blocks stored, every group's
    window_regretted: float = 0.0  # a hybrid model's first window-bounded group's regrets


@dataclass(frozen=True, slots=True)
class StreamEvents:
    """Stream-wide cumulative counts."""

    cleared: float = 0.0  # AllBlocksCleared events (a prefix-cache reset, a sleep)
    batches_lost: float = 0.0  # batches missed and not replayed


@dataclass(frozen=True, slots=True)
class KVState:
    """The stream's gauges this tick."""

    resident_gpu: float = 0.0  # GPU blocks held now, every group's
    window_bounded: frozenset[str] = frozenset()  # media whose reference group keeps a window only


NO_STREAM = KVState()
# MediumCounts' fields that are the reference group's ``MediumTotals`` of the same name
LOGICAL_COUNTS = ("stored", "removed", "removed_young", "regretted", "restored", "announced", "announced_tokens")
