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
and ``used`` (bytes held). Names and units per engine from their sources
(tests/fixtures/engine_metrics/SOURCES.md). What an engine does not export is absent, never
zero: vLLM 0.26.0's ``kv_offload_cpu_cache_usage_perc`` is the share pinned by transfers in
flight, not how full the tier is, so it is not read as usage.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvwatch.daemon.model.engines import TierReading

SUM, RANK0 = "sum", "rank0"  # every rank counts its own share / every rank reports the same number


@dataclass(frozen=True, slots=True)
class Rule:
    source: str
    tier: str
    quantity: str
    unit: str
    name: str
    match: tuple[tuple[str, str], ...] = ()  # label filters
    ranks: str = SUM
    over: str = ""  # a ratio: divided by this sample (same filters)
    when: tuple[str, ...] = ()  # read only when one of these samples is present too
    unless: tuple[str, ...] = ()  # ... when none is (a newer name of the same number)


def _r(source: str, tier: str, quantity: str, unit: str, name: str, **kw: object) -> Rule:
    return Rule(source, tier, quantity, unit, name, **kw)  # type: ignore[arg-type]


D2H, H2D = (("direction", "d2h"), ("phase", "staging")), (("direction", "h2d"), ("phase", "staging"))
VLLM_STORE, VLLM_LOAD, VLLM_OLD = (
    "vllm:kv_offload_store_bytes_total",
    "vllm:kv_offload_load_bytes_total",
    "vllm:kv_offload_total_bytes_total",
)
OFFLOADING = (VLLM_STORE, VLLM_OLD)  # vLLM's KV connector is the OffloadingConnector (CPU tier)
RULES = (
    # vLLM 0.26.0 OffloadingConnector (the labelled name is the older one of the same numbers)
    _r("vllm", "cpu", "stored", "bytes", VLLM_STORE),
    _r("vllm", "cpu", "stored", "bytes", VLLM_OLD, match=(("transfer_type", "GPU_to_CPU"),), unless=(VLLM_STORE,)),
    _r("vllm", "cpu", "loaded", "bytes", VLLM_LOAD),
    _r("vllm", "cpu", "loaded", "bytes", VLLM_OLD, match=(("transfer_type", "CPU_to_GPU"),), unless=(VLLM_LOAD,)),
    _r("vllm", "cpu", "queried", "tokens", "vllm:external_prefix_cache_queries_total", when=OFFLOADING),
    _r("vllm", "cpu", "hit", "tokens", "vllm:external_prefix_cache_hits_total", when=OFFLOADING),
    _r("vllm", "external", "queried", "tokens", "vllm:external_prefix_cache_queries_total", unless=OFFLOADING),
    _r("vllm", "external", "hit", "tokens", "vllm:external_prefix_cache_hits_total", unless=OFFLOADING),
    # LMCache 0.5.6, in process
    _r("lmcache", "remote", "stored", "bytes", "lmcache:num_remote_write_bytes_total"),
    _r("lmcache", "remote", "loaded", "bytes", "lmcache:num_remote_read_bytes_total"),
    _r("lmcache", "cpu", "evicted", "chunks", "lmcache:local_cpu_evict_keys_count_total"),
    _r("lmcache", "cpu", "used", "bytes", "lmcache:local_cache_usage"),
    _r("lmcache", "disk", "used", "bytes", "lmcache:local_storage_usage"),
    _r("lmcache", "all", "queried", "tokens", "lmcache:num_requested_tokens_total"),
    _r("lmcache", "all", "hit", "tokens", "lmcache:num_hit_tokens_total"),
    # LMCache 0.5.6 multiprocess server: L1 is host memory, L2 a store it names by adapter; its
    # transfer bytes are counted per phase (staging through host memory, and the kernel's), the
    # staging phase being the tier's own traffic
    _r("lmcache_mp", "cpu", "stored", "bytes", "lmcache_mp_transfer_phase_bytes_total", match=D2H),
    _r("lmcache_mp", "cpu", "loaded", "bytes", "lmcache_mp_transfer_phase_bytes_total", match=H2D),
    _r("lmcache_mp", "cpu", "stored", "chunks", "lmcache_mp_l1_write_chunks_total"),
    _r("lmcache_mp", "cpu", "loaded", "chunks", "lmcache_mp_l1_read_chunks_total"),
    _r("lmcache_mp", "cpu", "evicted", "chunks", "lmcache_mp_l1_evicted_chunks_total"),
    _r("lmcache_mp", "cpu", "usage", "ratio", "lmcache_mp_l1_usage_ratio"),
    _r("lmcache_mp", "cpu", "used", "bytes", "lmcache_mp_l1_memory_usage_bytes"),
    _r("lmcache_mp", "cpu", "queried", "tokens", "lmcache_mp_lookup_requested_tokens_total"),
    _r("lmcache_mp", "cpu", "hit", "tokens", "lmcache_mp_lookup_hit_l1_tokens_total"),
    _r("lmcache_mp", "storage", "stored", "chunks", "lmcache_mp_l2_store_completed_objects_chunks_total"),
    _r("lmcache_mp", "storage", "loaded", "chunks", "lmcache_mp_l2_prefetch_load_completed_chunks_total"),
    _r("lmcache_mp", "storage", "evicted", "chunks", "lmcache_mp_l2_evicted_objects_chunks_total"),
    _r("lmcache_mp", "storage", "used", "bytes", "lmcache_mp_l2_usage_bytes"),
    _r("lmcache_mp", "storage", "queried", "tokens", "lmcache_mp_lookup_requested_tokens_total"),
    _r("lmcache_mp", "storage", "hit", "tokens", "lmcache_mp_lookup_hit_l2_tokens_total"),
    # SGLang 0.5.23 HiCache: each rank backs up and loads its own shard's bytes; token counts
    # and the host pool's size are the same on every rank
    _r("sglang", "cpu", "stored", "bytes", "sglang:hicache_backup_bytes_total"),
    _r("sglang", "cpu", "loaded", "bytes", "sglang:load_back_bytes_total"),
    _r(
        "sglang",
        "cpu",
        "usage",
        "ratio",
        "sglang:hicache_host_used_tokens",
        ranks=RANK0,
        over="sglang:hicache_host_total_tokens",
    ),
    _r(
        "sglang",
        "cpu",
        "queried",
        "tokens",
        "sglang:prompt_tokens_total",
        ranks=RANK0,
        when=("sglang:hicache_host_total_tokens",),
    ),
    _r(
        "sglang",
        "cpu",
        "hit",
        "tokens",
        "sglang:cached_tokens_total",
        match=(("cache_source", "host"),),
        ranks=RANK0,
        when=("sglang:hicache_host_total_tokens",),
    ),
    _r("sglang", "storage", "stored", "tokens", "sglang:backuped_tokens_total", ranks=RANK0),
    _r("sglang", "storage", "loaded", "tokens", "sglang:prefetched_tokens_total", ranks=RANK0),
    _r(
        "sglang",
        "storage",
        "queried",
        "tokens",
        "sglang:prompt_tokens_total",
        ranks=RANK0,
        when=("sglang:backuped_tokens_total",),
    ),
    _r(
        "sglang",
        "storage",
        "hit",
        "tokens",
        "sglang:cached_tokens_total",
        match=(("cache_source", "storage"),),
        ranks=RANK0,
        when=("sglang:backuped_tokens_total",),
    ),
    # Dynamo KVBM 1.6.1 (its Rust exporter writes counters without _total; prometheus-client's
    # parser names their samples with it). Directions name the move:
    # offload d2h device->host, h2d host->disk, d2d device->disk, d2o device->object;
    # onboard h2d host->device, d2d disk->device, o2d object->device
    _r("kvbm", "cpu", "stored", "blocks", "kvbm_offload_blocks_d2h_total"),
    _r("kvbm", "cpu", "loaded", "blocks", "kvbm_onboard_blocks_h2d_total"),
    _r("kvbm", "cpu", "hit_ratio", "ratio", "kvbm_host_cache_hit_rate"),
    _r("kvbm", "disk", "stored", "blocks", "kvbm_offload_blocks_h2d_total"),
    _r("kvbm", "disk", "stored", "blocks", "kvbm_offload_blocks_d2d_total"),
    _r("kvbm", "disk", "loaded", "blocks", "kvbm_onboard_blocks_d2d_total"),
    _r("kvbm", "disk", "hit_ratio", "ratio", "kvbm_disk_cache_hit_rate"),
    _r("kvbm", "remote", "stored", "blocks", "kvbm_offload_blocks_d2o_total"),
    _r("kvbm", "remote", "loaded", "blocks", "kvbm_onboard_blocks_o2d_total"),
    _r("kvbm", "remote", "hit_ratio", "ratio", "kvbm_object_cache_hit_rate"),
)
WANTED = frozenset(n for r in RULES for n in (r.name, r.over, *r.when, *r.unless) if n)

Sample = tuple[str, Mapping[str, str], float]


def wanted(name: str) -> bool:
    return name in WANTED


def _rank0(labels: Mapping[str, str]) -> bool:
    return labels.get("tp_rank", "0") == "0" and labels.get("dp_rank", "0") == "0"


def _value(samples: Mapping[str, list[Sample]], name: str, rule: Rule) -> float | None:
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
