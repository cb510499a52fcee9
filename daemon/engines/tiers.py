"""One KV-tier schema across engines: their own tier counters read into (source, tier,
quantity, unit) readings, exported as ``kvwatch_engine_kv_tier_*`` (docs/architecture.md,
"KV tiers as the engines count them"; docs/engines.md says which engine feeds which).

Tiers: ``cpu`` (host DRAM: vLLM's OffloadingConnector, LMCache local CPU / L1, SGLang HiCache
host pool, Dynamo KVBM host), ``disk`` (Dynamo KVBM disk, LMCache local disk), ``remote``
(LMCache remote, Dynamo KVBM object store), ``storage`` (a lower tier the engine does not
say is disk or remote: SGLang HiCache L3, LMCache's L2), ``external`` (vLLM's KV connector
when it is not the OffloadingConnector), ``all`` (an engine's tiers together: LMCache's
hit tokens).

Quantities: ``stored`` / ``loaded`` / ``evicted`` (counters, in bytes where the engine counts
bytes, else in its own unit: blocks, chunks, tokens), ``queried`` / ``hit`` (tokens looked up
and found, counters), ``hit_ratio`` (where the engine exports only a ratio), ``usage`` (0..1)
and ``used`` (bytes held). Each engine's rules are in its module (``kinds/``), names and units
from its sources (tests/fixtures/engine_metrics/SOURCES.md). What an engine does not export is absent, never
zero: vLLM 0.26.0's ``kv_offload_cpu_cache_usage_perc`` is the share pinned by transfers in
flight, not how full the tier is, so it is not read as usage.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvwatch.daemon.engines.kind import SUM, TierRule
from kvwatch.daemon.engines.kinds import KINDS
from kvwatch.daemon.model.engines import TierReading

RULES: tuple[TierRule, ...] = tuple(r for k in KINDS for r in k.tiers)  # each engine's, in its module
WANTED = frozenset(n for r in RULES for n in (r.name, r.over, *r.when, *r.unless) if n)

Sample = tuple[str, Mapping[str, str], float]


def wanted(name: str) -> bool:
    return name in WANTED


def _rank0(labels: Mapping[str, str]) -> bool:
    return labels.get("tp_rank", "0") == "0" and labels.get("dp_rank", "0") == "0"


def _value(samples: Mapping[str, list[Sample]], name: str, rule: TierRule) -> float | None:
    rows = [
        v
        for _, labels, v in samples.get(name, [])
        if all(labels.get(k) == w for k, w in rule.match) and (rule.ranks == SUM or _rank0(labels))
    ]
    return sum(rows) if rows else None


def read_tiers(samples: Iterable[Sample]) -> tuple[TierReading, ...]:
    """Every rule whose metric the page has; two rules of one (source, tier, quantity, unit)
    add up (Dynamo's disk tier is written from the host and from the device)."""
    by_name: dict[str, list[Sample]] = {}
    for s in samples:
        by_name.setdefault(s[0], []).append(s)
    out: dict[tuple[str, str, str, str], float] = {}
    for rule in RULES:
        if rule.when and not any(n in by_name for n in rule.when):
            continue
        if any(n in by_name for n in rule.unless):
            continue
        value = _value(by_name, rule.name, rule)
        if value is None:
            continue
        if rule.over:
            den = _value(by_name, rule.over, rule)
            if not den:
                continue
            value /= den
        key = (rule.source, rule.tier, rule.quantity, rule.unit)
        out[key] = out.get(key, 0.0) + value
    return tuple(TierReading(*k, v) for k, v in out.items())
