"""What the engine taps observe of an engine's own /metrics, typed.

The scraped counters go into the tapped process's ``History`` under ``ENGINE`` at each new
scrape's time; the engine's tier counters under one key per (source, tier, unit); the gauges
(fresh, usage, pool, sleeping) and whether a watched ancestor is tapped are one ``EngineState``
per process per tick. Detectors, the loss ledger, the audit and the snapshot read these fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvwatch.daemon.model.engines import EngineSample, TierReading

ENGINE = "engine"  # the history's key: the engine's /metrics


@dataclass(frozen=True, slots=True)
class ScrapeCounts:
    """Cumulative counters of one scrape; 0 where the engine does not export one (which it does
    is the last scrape's: ``EngineState.scrape``)."""

    prefix_queries: float = 0.0  # tokens looked up in the prefix cache
    prefix_hits: float = 0.0  # ... found
    preemptions: float = 0.0  # requests preempted (vLLM) / retracted (SGLang)
    generation_tokens: float = 0.0  # tokens generated
    evicted_tokens: float = 0.0  # SGLang radix-cache evictions
    idle_evict_samples: float = 0.0  # vLLM's idle-before-evict histogram: samples
    idle_evict_young: float = 0.0  # ... of which idle less than thrash_seconds
    lmcache_evicted_keys: float = 0.0  # LMCache CPU evictions
    lmcache_hit_tokens: float = 0.0
    lmcache_requested_tokens: float = 0.0
    external_queries: float = 0.0  # tokens looked up in a KV connector's tier
    external_hits: float = 0.0  # ... found there
    offload_store_bytes: float = 0.0  # bytes the engine says it offloaded
    offload_load_bytes: float = 0.0  # ... and loaded back


def scrape_counts(x: EngineSample) -> ScrapeCounts:
    """The sample's counters (each field of ``ScrapeCounts`` is the sample's of that name), 0 where absent."""
    values = {name: getattr(x, name) for name in ScrapeCounts.__slots__}
    return ScrapeCounts(**{name: 0.0 if v is None else float(v) for name, v in values.items()})


@dataclass(frozen=True, slots=True)
class TierCounts:
    """One engine tier's cumulative counters, in its unit (a reading's other quantities are gauges)."""

    stored: float = 0.0
    loaded: float = 0.0
    evicted: float = 0.0
    queried: float = 0.0
    hit: float = 0.0


def tier_key(source: str, tier: str, unit: str) -> str:
    return f"{source}:{tier}:{unit}"


def tier_counts(tiers: tuple[TierReading, ...]) -> dict[str, TierCounts]:
    """The scrape's tier counters, by ``tier_key``."""
    got: dict[str, dict[str, float]] = {}
    names = TierCounts.__slots__
    for r in tiers:
        if r.quantity in names:
            got.setdefault(tier_key(r.source, r.tier, r.unit), {})[r.quantity] = r.value
    return {k: TierCounts(**v) for k, v in got.items()}


@dataclass(frozen=True, slots=True)
class EngineState:
    """The engine's gauges as one watched process sees them this tick."""

    tapped: bool = False  # the process, or a watched ancestor, has engine taps
    sleeping: bool = False  # the engine reports sleep mode (its KV pool discarded on purpose), freshly
    fresh: bool = False  # (the tapped process) its last scrape is recent
    usage: float | None = None  # the engine's KV pool usage, 0..1, when fresh
    pool_blocks: float = 0.0  # GPU blocks the engine allocated, when fresh
    scrape: EngineSample | None = None  # (the tapped process) its last scrape: None fields are not exported


NO_ENGINE = EngineState()


def exports(state: EngineState, *counters: Callable[[EngineSample], float | None]) -> bool:
    """The process's engine exports every one of these counters (read from its last scrape)."""
    x = state.scrape
    return x is not None and all(get(x) is not None for get in counters)
