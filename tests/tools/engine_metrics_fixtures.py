"""Write engine /metrics fixtures in each engine's real exposition format.

The engines export with prometheus-client; so does this script, declaring each
metric as the engine's source does (name, type, documentation, label names — read
off vLLM 0.11.0 / 0.33.0, SGLang 0.5.23 and LMCache 0.5.6) and setting known
values. The tests serve these files over HTTP and check what kvwatch reads.

    .venv/bin/python tests/tools/engine_metrics_fixtures.py
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "engine_metrics"
RESIDENCY = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800]


def vllm(new: bool) -> bytes:
    """0.33.0 (new=True): kv_cache_usage_perc, KV residency histograms, sleep state, two DP engines.
    0.11.0: the deprecated gpu_* names beside the new ones, same values."""
    r = CollectorRegistry()
    lab = ["model_name", "engine"]
    engines = [("llama", "0"), ("llama", "1")] if new else [("llama", "0")]
    usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lab, registry=r)
    q = Counter(
        "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", lab, registry=r
    )
    h = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", lab, registry=r)
    pre = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", lab, registry=r)
    run = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", lab, registry=r)
    wait = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lab, registry=r)
    for i, lv in enumerate(engines):
        usage.labels(*lv).set(0.42 + 0.5 * i)  # max: 0.92 with two engines
        q.labels(*lv).inc(100_000 + i)
        h.labels(*lv).inc(61_000 + i)
        pre.labels(*lv).inc(7)
        run.labels(*lv).set(12)
        wait.labels(*lv).set(3)
    if not new:
        Gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
            lab,
            registry=r,
        ).labels("llama", "0").set(0.42)
        Counter(
            "vllm:gpu_prefix_cache_queries",
            "GPU prefix cache queries, in terms of number of queried tokens.DEPRECATED: Use vllm:prefix_cache_queries instead.",
            lab,
            registry=r,
        ).labels("llama", "0").inc(100_000)
        Counter(
            "vllm:gpu_prefix_cache_hits",
            "GPU prefix cache hits, in terms of number of cached tokens.DEPRECATED: Use vllm:prefix_cache_hits instead.",
            lab,
            registry=r,
        ).labels("llama", "0").inc(61_000)
    else:
        sleep = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            [*lab, "sleep_state"],
            registry=r,
        )
        for lv in engines:
            sleep.labels(*lv, "awake").set(1)
            sleep.labels(*lv, "weights_offloaded").set(0)
            sleep.labels(*lv, "discard_all").set(0)
        idle = Histogram(
            "vllm:kv_block_idle_before_evict_seconds",
            "Histogram of idle time before KV cache block eviction. Sampled metrics (controlled by --kv-cache-metrics-sample).",
            lab,
            buckets=RESIDENCY,
            registry=r,
        )
        for v in [0.5] * 30 + [4.0] * 20 + [45.0] * 50:  # 50 of 100 sampled evictions idle <= 10 s
            idle.labels("llama", "0").observe(v)
    return generate_latest(r)


def sglang() -> bytes:
    r = CollectorRegistry()
    lab = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"]
    ranks = [("qwen", "unified", str(tp), "0", "0") for tp in (0, 1)]
    token_usage = Gauge("sglang:token_usage", "The token usage.", lab, registry=r)
    hit_rate = Gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", lab, registry=r)
    running = Gauge("sglang:num_running_reqs", "The number of running requests.", lab, registry=r)
    queue = Gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", lab, registry=r)
    retracted = Counter("sglang:num_retracted_requests_total", "Total number of retracted requests.", lab, registry=r)
    evicted = Counter(
        "sglang:evicted_tokens_total",
        "The number of device KV token slots freed by eviction, regardless of whether the data was backed up to host "
        "(see sglang:hicache_backup_tokens_total) or destroyed (see sglang:hicache_dropped_tokens_total).",
        lab,
        registry=r,
    )
    prompt = Counter(
        "sglang:prompt_tokens_total", "Number of prefill tokens processed.", [*lab, "is_streaming"], registry=r
    )
    cached = Counter(
        "sglang:cached_tokens_total",
        "Number of cached prompt tokens by source (device/host/storage).",
        [*lab, "cache_source"],
        registry=r,
    )
    for i, lv in enumerate(ranks):  # rank 1 repeats rank 0's engine-wide numbers, doubled to catch double counting
        k = i + 1
        token_usage.labels(*lv).set(0.97)
        hit_rate.labels(*lv).set(0.35)
        running.labels(*lv).set(30 * k)
        queue.labels(*lv).set(5 * k)
        retracted.labels(*lv).inc(11 * k)
        evicted.labels(*lv).inc(123_456 * k)
        prompt.labels(*lv, "true").inc(40_000 * k)
        prompt.labels(*lv, "false").inc(60_000 * k)
        cached.labels(*lv, "device").inc(30_000 * k)
        cached.labels(*lv, "host").inc(5_000 * k)
    return generate_latest(r)


def lmcache() -> bytes:
    r = CollectorRegistry()
    lab = ["model_name", "worker_id", "role", "served_model_name"]
    lv = ("llama", "0", "worker", "")
    Counter("lmcache:num_requested_tokens", "Total number of tokens requested from lmcache", lab, registry=r).labels(
        *lv
    ).inc(50_000)
    Counter("lmcache:num_hit_tokens", "Total number of tokens hit in lmcache", lab, registry=r).labels(*lv).inc(20_000)
    Counter("lmcache:local_cpu_evict_count", "Total number of evict in local cpu backend", lab, registry=r).labels(
        *lv
    ).inc(9)
    Counter(
        "lmcache:local_cpu_evict_keys_count", "Total number of evict keys in local cpu backend", lab, registry=r
    ).labels(*lv).inc(257)
    Gauge("lmcache:retrieve_hit_rate", "Hit rate of lmcache retrieve requests since last log", lab, registry=r).labels(
        *lv
    ).set(1.0)
    return generate_latest(r)


# ---------------------------------------------------------------------------
# KV tier (offload / host / disk / remote) metrics. Sources, units and the mapping
# onto kvwatch_engine_kv_tier_* are in tests/fixtures/engine_metrics/SOURCES.md.
# Every sample value a test may check is in TIER_VALUES.
# ---------------------------------------------------------------------------

_VLLM_BLOCK = 524_288  # bytes per CPU block of the offload tier (the real 0.26.0 run's)
TIER_VALUES: dict[str, dict[str, float]] = {
    "vllm-offload-0.26.0": {
        "cpu_block_bytes": _VLLM_BLOCK,
        "store_ops": 509,  # each of 16 CPU blocks (8,388,608 bytes)
        "store_blocks": 509 * 16,  # 8144
        "store_bytes": 509 * 16 * _VLLM_BLOCK,  # 4,269,801,472
        "load_ops": 97,  # 96 of 8 blocks (4,194,304 bytes) and 1 of 3 blocks (1,572,864 bytes)
        "load_blocks": 96 * 8 + 3,  # 771
        "load_bytes": (96 * 8 + 3) * _VLLM_BLOCK,  # 404,226,048
        "store_time": 3.761,
        "load_time": 0.2711,
        "cpu_cache_usage_perc": 0.1373,
        "cpu_cache_write_usage_perc": 0.0419,
        "cpu_cache_read_usage_perc": 0.0954,
        "allocation_failure": 13,
        "stores_skipped": 211,
        "external_prefix_cache_queries": 1_000_003,
        "external_prefix_cache_hits": 12_368,
    },
    "lmcache-0.5.6-tiers": {
        "num_requested_tokens": 65_537,
        "num_hit_tokens": 31_013,
        "num_stored_tokens": 98_347,
        "num_lookup_tokens": 70_001,
        "num_lookup_hits": 33_331,
        "num_remote_read_requests": 149,
        "num_remote_read_bytes": 1_207_959_559,
        "num_remote_write_requests": 263,
        "num_remote_write_bytes": 2_013_265_921,
        "local_cpu_evict_count": 41,
        "local_cpu_evict_keys_count": 1_031,
        "local_cpu_evict_failed_count": 3,
        "retrieve_hit_rate": 0.4729,
        "lookup_hit_rate": 0.4762,
        "local_cache_usage": 3_221_225_473,
        "remote_cache_usage": 0,  # declared and logged, but nothing in 0.5.6 ever updates it
        "local_storage_usage": 8_589_934_597,
    },
    "lmcache-mp-0.5.6": {
        "l1_read_chunks": 6_151,
        "l1_write_chunks": 9_173,
        "l1_evicted_chunks": 2_339,
        "l2_store_completed_requests": 613,
        "l2_store_completed_objects_chunks": 4_877,
        "l2_load_completed_requests": 271,
        "l2_prefetch_lookup_objects_chunks": 5_419,
        "l2_prefetch_load_completed_chunks": 1_879,
        "l2_evicted_objects_chunks": 409,
        "l2_usage_bytes": 34_359_738_421,
        "lookup_requested_tokens": 917_504,
        "lookup_hit_tokens": 412_672,
        "lookup_hit_l1_tokens": 352_256,
        "lookup_hit_l2_tokens": 60_416,
        "lookup_hit_l1_keys": 11_008,
        "lookup_hit_l2_keys": 1_888,
        "transfer_phase_bytes_h2d": 29_527_900_160,
        "transfer_phase_bytes_d2h": 48_103_633_920,
        "l1_memory_usage_bytes": 12_884_901_893,
        "l1_usage_ratio": 0.7489,
    },
    "sglang-hicache-0.5.23": {
        # token counters: every TP rank reports the same logical count (SGLang's HELP)
        "evicted_tokens": 123_457,
        "hicache_backup_tokens_kv": 104_729,
        "hicache_dropped_tokens_host_pressure": 18_728,  # backup + dropped == evicted
        "load_back_tokens_kv": 52_201,
        # byte counters: each TP rank reports its own KV shard (sum ranks)
        "hicache_backup_bytes_rank0": 104_729 * 32_768,  # 3,431,759,872
        "hicache_backup_bytes_rank1": 104_729 * 32_768 + 458_752,  # 3,432,218,624
        "load_back_bytes_rank0": 52_201 * 32_768,  # 1,710,522,368
        "load_back_bytes_rank1": 52_201 * 32_768 + 229_376,  # 1,710,751,744
        "hicache_host_used_tokens": 1_310_719,
        "hicache_host_total_tokens": 2_097_152,
        "page_size": 64,
        "prefetched_tokens": 40_896,
        "backuped_tokens": 77_824,
        "storage_prefetch_hit_tokens": 45_056,
        "storage_prefetch_unfulfilled_host_capacity": 4_160,
        "hicache_backup_dropped_tokens": 2_944,
        "cached_tokens_device": 30_011,
        "cached_tokens_host": 5_003,
        "cached_tokens_storage": 2_017,
        "prompt_tokens_streaming": 40_009,
        "prompt_tokens_not_streaming": 60_013,
    },
    "dynamo-kvbm-1.6.1": {
        "offload_blocks_d2h": 7_919,
        "offload_blocks_h2d": 3_571,
        "offload_blocks_d2d": 241,
        "offload_blocks_d2o": 577,
        "onboard_blocks_h2d": 4_513,
        "onboard_blocks_d2d": 1_693,
        "onboard_blocks_o2d": 389,
        "matched_tokens": 98_731,
        "host_cache_hit_rate": 0.6875,  # exact in f32, as KVBM sets it (f32 -> f64)
        "disk_cache_hit_rate": 0.3125,
        "object_cache_hit_rate": 0.140625,
        "object_read_failures": 7,
        "object_write_failures": 11,
    },
}

# vLLM 0.26.0 distributed/kv_transfer/kv_connector/v1/offloading/metrics.py TRANSFER_SIZE_BUCKETS
_VLLM_TRANSFER_SIZE_BUCKETS = [1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6]
# vLLM 0.26.0 v1/kv_offload/cpu/spec.py, vllm:kv_offload_cpu_allocation_size
_VLLM_ALLOCATION_BUCKETS = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144]


def vllm_offload() -> bytes:
    """vLLM 0.26.0 OffloadingConnector with the native CPU spec (OffloadPromMetrics): the
    deprecated transfer_type metrics beside the flat ones, registered in vLLM's order, and
    the KV-connector external prefix cache counters that give the tier's hit ratio."""
    v = TIER_VALUES["vllm-offload-0.26.0"]
    r = CollectorRegistry()
    lab = ["model_name", "engine"]
    lv = ("llama", "0")
    store_sizes = [16 * _VLLM_BLOCK] * int(v["store_ops"])
    load_sizes = [8 * _VLLM_BLOCK] * 96 + [3 * _VLLM_BLOCK]
    tt = [*lab, "transfer_type"]
    dep_bytes = Counter("vllm:kv_offload_total_bytes", "Number of bytes offloaded by KV connector", tt, registry=r)
    dep_time = Counter(
        "vllm:kv_offload_total_time", "Total time measured by all KV offloading operations", tt, registry=r
    )
    dep_size = Histogram(
        "vllm:kv_offload_size",
        "Histogram of KV offload transfer size, in bytes.",
        tt,
        buckets=_VLLM_TRANSFER_SIZE_BUCKETS,
        registry=r,
    )
    for t in ("CPU_to_GPU", "GPU_to_CPU"):  # vLLM binds both children at start-up
        dep_bytes.labels(*lv, t)
        dep_time.labels(*lv, t)
        dep_size.labels(*lv, t)
    usage = Gauge(
        "vllm:kv_offload_cpu_cache_usage_perc",
        "Fraction of CPU KV-cache space currently pinned by active transfers (0.0 = idle, 1.0 = saturated). "
        "Sustained high values indicate transfers (stores or promotions) may be dropped due to insufficient capacity.",
        lab,
        registry=r,
    )
    w_usage = Gauge(
        "vllm:kv_offload_cpu_cache_write_usage_perc",
        "Fraction of CPU KV-cache space currently pinned by in-flight stores that have not yet completed "
        "(0.0 = idle, 1.0 = saturated).",
        lab,
        registry=r,
    )
    r_usage = Gauge(
        "vllm:kv_offload_cpu_cache_read_usage_perc",
        "Fraction of CPU KV-cache space currently pinned by in-flight loads that have not yet completed "
        "(0.0 = idle, 1.0 = saturated).",
        lab,
        registry=r,
    )
    alloc = Histogram(
        "vllm:kv_offload_cpu_allocation_size",
        "Histogram of the number of CPU blocks requested by each KV offload prepare_store call.",
        lab,
        buckets=_VLLM_ALLOCATION_BUCKETS,
        registry=r,
    )
    skipped = Counter(  # only registered when kv_connector_extra_config store_threshold >= 2
        "vllm:kv_offload_stores_skipped",
        "Number of KV offload stores skipped because the reuse threshold was not reached.",
        lab,
        registry=r,
    )
    load_bytes = Counter(
        "vllm:kv_offload_load_bytes", "Total bytes loaded from offload storage to GPU.", lab, registry=r
    )
    load_time = Counter(
        "vllm:kv_offload_load_time", "Total load time from offload storage to GPU, in seconds.", lab, registry=r
    )
    load_size = Histogram(
        "vllm:kv_offload_load_size",
        "Histogram of KV offload load operation size, in bytes.",
        lab,
        buckets=_VLLM_TRANSFER_SIZE_BUCKETS,
        registry=r,
    )
    store_bytes = Counter(
        "vllm:kv_offload_store_bytes", "Total bytes stored from GPU to offload storage.", lab, registry=r
    )
    store_time = Counter(
        "vllm:kv_offload_store_time", "Total store time from GPU to offload storage, in seconds.", lab, registry=r
    )
    store_size = Histogram(
        "vllm:kv_offload_store_size",
        "Histogram of KV offload store operation size, in bytes.",
        lab,
        buckets=_VLLM_TRANSFER_SIZE_BUCKETS,
        registry=r,
    )
    alloc_fail = Counter(
        "vllm:kv_offload_allocation_failure",
        "Number of KV offload store allocation attempts that failed.",
        lab,
        registry=r,
    )
    ext_q = Counter(
        "vllm:external_prefix_cache_queries",
        "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
        "queried tokens.",
        lab,
        registry=r,
    )
    ext_h = Counter(
        "vllm:external_prefix_cache_hits",
        "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
        "cached tokens.",
        lab,
        registry=r,
    )
    usage.labels(*lv).set(v["cpu_cache_usage_perc"])
    w_usage.labels(*lv).set(v["cpu_cache_write_usage_perc"])
    r_usage.labels(*lv).set(v["cpu_cache_read_usage_perc"])
    for s in store_sizes:
        alloc.labels(*lv).observe(s // _VLLM_BLOCK)
        store_size.labels(*lv).observe(s)
        dep_size.labels(*lv, "GPU_to_CPU").observe(s)
    for s in load_sizes:
        load_size.labels(*lv).observe(s)
        dep_size.labels(*lv, "CPU_to_GPU").observe(s)
    skipped.labels(*lv).inc(v["stores_skipped"])
    store_bytes.labels(*lv).inc(v["store_bytes"])
    dep_bytes.labels(*lv, "GPU_to_CPU").inc(v["store_bytes"])
    load_bytes.labels(*lv).inc(v["load_bytes"])
    dep_bytes.labels(*lv, "CPU_to_GPU").inc(v["load_bytes"])
    store_time.labels(*lv).inc(v["store_time"])
    dep_time.labels(*lv, "GPU_to_CPU").inc(v["store_time"])
    load_time.labels(*lv).inc(v["load_time"])
    dep_time.labels(*lv, "CPU_to_GPU").inc(v["load_time"])
    alloc_fail.labels(*lv).inc(v["allocation_failure"])
    ext_q.labels(*lv).inc(v["external_prefix_cache_queries"])
    ext_h.labels(*lv).inc(v["external_prefix_cache_hits"])
    return generate_latest(r)


def lmcache_tiers() -> bytes:
    """LMCache 0.5.6 lmcache/observability.py PrometheusLogger: the tier-related subset, in
    declaration order (CPU = local_cpu / local_cache, disk = local_storage, remote = remote_*)."""
    v = TIER_VALUES["lmcache-0.5.6-tiers"]
    r = CollectorRegistry()
    lab = ["model_name", "worker_id", "role", "served_model_name"]
    lv = ("llama", "0", "worker", "")
    for name, doc in [
        ("num_requested_tokens", "Total number of tokens requested from lmcache"),
        ("num_hit_tokens", "Total number of tokens hit in lmcache"),
        ("num_stored_tokens", "Total number of tokens stored in lmcache including evicted ones"),
        ("num_lookup_tokens", "Total number of tokens requested in lookup from lmcache"),
        ("num_lookup_hits", "Total number of tokens hit in lookup from lmcache"),
        ("num_remote_read_requests", "Total number of requests read from remote backends in lmcache"),
        ("num_remote_read_bytes", "Total number of bytes read from remote backends in lmcache"),
        ("num_remote_write_requests", "Total number of requests write to remote backends in lmcache"),
        ("num_remote_write_bytes", "Total number of bytes write to remote backends in lmcache"),
        ("local_cpu_evict_count", "Total number of evict in local cpu backend"),
        ("local_cpu_evict_keys_count", "Total number of evict keys in local cpu backend"),
        ("local_cpu_evict_failed_count", "Total number of failed eviction in local cpu backend"),
    ]:
        Counter(f"lmcache:{name}", doc, lab, registry=r).labels(*lv).inc(v[name])
    for name, doc, mode in [
        ("retrieve_hit_rate", "Hit rate of lmcache retrieve requests since last log", "livemostrecent"),
        ("lookup_hit_rate", "Hit rate of lmcache lookup requests since last log", "livemostrecent"),
        ("local_cache_usage", "Local cache usage (bytes) of lmcache", "sum"),
        ("remote_cache_usage", "Remote cache usage (bytes) of lmcache", "sum"),
        ("local_storage_usage", "Local storage usage (bytes) of lmcache", "sum"),
    ]:
        Gauge(f"lmcache:{name}", doc, lab, multiprocess_mode=mode, registry=r).labels(*lv).set(v[name])
    return generate_latest(r)


def lmcache_mp() -> bytes:
    """LMCache 0.5.6 multiprocess server (lmcache/v1/mp_observability): OpenTelemetry instruments
    named lmcache_mp.*, exposed through opentelemetry-exporter-prometheus (the server's pull
    fallback), which turns '.' into '_', appends the unit (chunks, requests, tokens, keys;
    'By' -> bytes, not repeated) and '_total' to counters, and writes no _created samples.
    prometheus_client's own Counter cannot produce these names, so this is the exporter's
    text, as produced by opentelemetry-sdk 1.40.0 + opentelemetry-exporter-prometheus 0.61b0 +
    prometheus_client 0.24.1 (the newest LMCache 0.5.6 allows) from the instruments declared
    as in LMCache's source; values from TIER_VALUES (prometheus_client's float format)."""
    v = TIER_VALUES["lmcache-mp-0.5.6"]

    def f(d: float) -> str:
        """prometheus_client 0.24.1's floatToGoString (newer releases write e+10, not e+010)."""
        s = repr(float(d))
        dot = s.find(".")
        if d > 0 and dot > 6:
            return f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.") + f"e+0{dot - 1}"
        return s

    l1 = 'l1_tag="_default"'
    l1g = 'backend="dram",l1_tag="_default"'
    l2 = 'l2_name="FSNativeL2Adapter"'
    mdl = 'model_name="llama"'

    def fam(name: str, typ: str, doc: str, *samples: tuple[str, float]) -> str:
        out = f"# HELP {name} {doc}\n# TYPE {name} {typ}\n"
        for labels, value in samples:
            out += f"{name}{{{labels}}} {f(value)}\n" if labels else f"{name} {f(value)}\n"
        return out

    text = (
        "# HELP target_info Target metadata\n# TYPE target_info gauge\n"
        'target_info{service_name="unknown_service",telemetry_sdk_language="python",'
        'telemetry_sdk_name="opentelemetry",telemetry_sdk_version="1.40.0"} 1.0\n'
        + fam("lmcache_mp_l1_read_chunks_total", "counter", "Total chunks read from L1", (l1, v["l1_read_chunks"]))
        + fam("lmcache_mp_l1_write_chunks_total", "counter", "Total chunks written to L1", (l1, v["l1_write_chunks"]))
        + fam(
            "lmcache_mp_l1_evicted_chunks_total",
            "counter",
            "Total chunks evicted from L1",
            (l1, v["l1_evicted_chunks"]),
        )
        + fam(
            "lmcache_mp_l2_store_completed_requests_total",
            "counter",
            "Total L2 store requests completed",
            (l2, v["l2_store_completed_requests"]),
        )
        + fam(
            "lmcache_mp_l2_store_completed_objects_chunks_total",
            "counter",
            "Total chunks successfully stored to L2",
            ("", v["l2_store_completed_objects_chunks"]),
        )
        + fam(
            "lmcache_mp_l2_load_completed_requests_total",
            "counter",
            "Total L2 load tasks completed (per-adapter)",
            (l2, v["l2_load_completed_requests"]),
        )
        + fam(
            "lmcache_mp_l2_prefetch_lookup_objects_chunks_total",
            "counter",
            "Total chunks submitted for L2 prefetch lookup",
            ("", v["l2_prefetch_lookup_objects_chunks"]),
        )
        + fam(
            "lmcache_mp_l2_prefetch_load_completed_chunks_total",
            "counter",
            "Total chunks successfully loaded from L2",
            ("", v["l2_prefetch_load_completed_chunks"]),
        )
        + fam(
            "lmcache_mp_l2_evicted_objects_chunks_total",
            "counter",
            "Total chunks evicted from L2",
            ("", v["l2_evicted_objects_chunks"]),
        )
        + fam(
            "lmcache_mp_l2_usage_bytes",
            "gauge",
            "Bytes currently held in each L2 adapter, tagged by ``l2_name`` (one observation per adapter).",
            (l2, v["l2_usage_bytes"]),
        )
        + fam(
            "lmcache_mp_lookup_requested_tokens_total",
            "counter",
            "Total tokens submitted for lookup (denominator of the L1+L2 token-level hit rate). "
            "Only chunk-aligned tokens are counted.",
            (mdl, v["lookup_requested_tokens"]),
        )
        + fam(
            "lmcache_mp_lookup_hit_tokens_total",
            "counter",
            "Total tokens found in L1+L2 during lookup (numerator of the L1+L2 token-level hit rate). "
            "Counts the contiguous prefix hit only.",
            (mdl, v["lookup_hit_tokens"]),
        )
        + fam(
            "lmcache_mp_lookup_hit_l1_tokens_total",
            "counter",
            "Of lookup_hit: tokens served from objects L1 already held "
            "(from the storage manager's per-tier hit counts).",
            (mdl, v["lookup_hit_l1_tokens"]),
        )
        + fam(
            "lmcache_mp_lookup_hit_l2_tokens_total",
            "counter",
            "Of lookup_hit: tokens L2 added beyond the L1-servable prefix. "
            "lookup_hit_l1 + lookup_hit_l2 == lookup_hit.",
            (mdl, v["lookup_hit_l2_tokens"]),
        )
        + fam(
            "lmcache_mp_lookup_hit_l1_keys_total",
            "counter",
            "Hit keys (one per object group, kv rank and chunk) that L1 already held.",
            (mdl, v["lookup_hit_l1_keys"]),
        )
        + fam(
            "lmcache_mp_lookup_hit_l2_keys_total",
            "counter",
            "Hit keys loaded from L2 into L1.",
            (mdl, v["lookup_hit_l2_keys"]),
        )
        + fam(
            "lmcache_mp_transfer_phase_bytes_total",
            "counter",
            "Cumulative bytes moved per transfer phase (label 'phase'). Divide its rate by "
            "transfer_phase_elapsed's rate for the byte-weighted DMA rate -- for phase='staging' only; "
            "see that metric's description for why the kernel ratio is not one.",
            ('device_index="0",direction="h2d",phase="staging"', v["transfer_phase_bytes_h2d"]),
            ('device_index="0",direction="d2h",phase="staging"', v["transfer_phase_bytes_d2h"]),
        )
        + fam(
            "lmcache_mp_l1_memory_usage_bytes",
            "gauge",
            "Bytes currently held in L1 cache",
            (l1g, v["l1_memory_usage_bytes"]),
        )
        + fam("lmcache_mp_l1_usage_ratio", "gauge", "L1 used/total ratio (0.0\u20131.0)", (l1g, v["l1_usage_ratio"]))
    )
    return text.encode()


def sglang_hicache() -> bytes:
    """SGLang 0.5.23 HiCache metrics from its three collectors, each with its own label set:
    SchedulerMetricsCollector (host pool gauges, page size), RadixCacheMetricsCollector
    (device<->host L2 traffic and eviction), StorageMetricsCollector (host<->L3 storage), and
    TokenizerMetricsCollector (cached tokens by source). Two TP ranks: token counters carry
    the same logical count on both ranks, byte counters each rank's own shard."""
    v = TIER_VALUES["sglang-hicache-0.5.23"]
    r = CollectorRegistry()
    sched_lab = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"]
    used = Gauge(
        "sglang:hicache_host_used_tokens",
        "Number of tokens currently used in the host KV cache.",
        sched_lab,
        multiprocess_mode="mostrecent",
        registry=r,
    )
    total = Gauge(
        "sglang:hicache_host_total_tokens",
        "Total capacity of the host KV cache in tokens.",
        sched_lab,
        multiprocess_mode="mostrecent",
        registry=r,
    )
    page = Gauge(
        "sglang:page_size", "KV cache page size in tokens.", sched_lab, multiprocess_mode="mostrecent", registry=r
    )
    for tp in ("0", "1"):
        lv = ("qwen", "unified", tp, "0", "0")
        used.labels(*lv).set(v["hicache_host_used_tokens"])
        total.labels(*lv).set(v["hicache_host_total_tokens"])
        page.labels(*lv).set(v["page_size"])

    radix_lab = ["cache_type", "tp_rank", "pp_rank", "dp_rank"]
    evicted = Counter(
        "sglang:evicted_tokens_total",
        "The number of device KV token slots freed by eviction, regardless of whether the data was backed up to host "
        "(see sglang:hicache_backup_tokens_total) or destroyed (see sglang:hicache_dropped_tokens_total).",
        radix_lab,
        registry=r,
    )
    load_back = Counter(
        "sglang:load_back_tokens_total",
        "The number of tokens loaded back from local host DRAM (L2) to GPU, by host pool (kv, swa, mamba, ...). "
        "Every TP rank reports the same logical count under its own rank labels; read one rank rather than summing "
        "ranks.",
        [*radix_lab, "pool"],
        registry=r,
    )
    backup_bytes = Counter(
        "sglang:hicache_backup_bytes_total",
        "Bytes backed up from GPU to local host DRAM (L2), all pools combined, including draft/sidecar transfers "
        "that the token counter excludes. Each rank reports its own KV shard; sum ranks for the physical total. "
        "A window's byte delta divided by the same window's hicache_backup_duration_seconds sum is the "
        "bytes-weighted active bandwidth; the plain rate is wall-clock payload traffic that includes idle time.",
        radix_lab,
        registry=r,
    )
    load_back_bytes = Counter(
        "sglang:load_back_bytes_total",
        "Bytes loaded back from local host DRAM (L2) to GPU, all pools combined, including draft/sidecar transfers "
        "that the token counter excludes. Each rank reports its own KV shard; sum ranks for the physical total. "
        "A window's byte delta divided by the same window's load_back_duration_seconds sum is the bytes-weighted "
        "active bandwidth; the plain rate is wall-clock payload traffic that includes idle time.",
        radix_lab,
        registry=r,
    )
    backup = Counter(
        "sglang:hicache_backup_tokens_total",
        "The number of tokens backed up from GPU to local host DRAM (L2), by host pool (kv, swa, mamba, ...). "
        "Covers all D->H backups regardless of --hicache-write-policy. Distinct from the host-to-storage (L3) "
        "sglang:backuped_tokens_total. Every TP rank reports the same logical count under its own rank labels; "
        "read one rank rather than summing ranks.",
        [*radix_lab, "pool"],
        registry=r,
    )
    dropped = Counter(
        "sglang:hicache_dropped_tokens_total",
        "The number of logical device KV tokens destroyed without a host backup. The pool label is always kv; "
        "reason is host_pressure for write-back failure, or write_through_unbacked_eviction when eager "
        "write-through did not complete before eviction.",
        [*radix_lab, "reason", "pool"],
        registry=r,
    )
    for tp in ("0", "1"):
        lv = ("UnifiedRadixCache", tp, "0", "0")
        evicted.labels(*lv).inc(v["evicted_tokens"])
        load_back.labels(*lv, "kv").inc(v["load_back_tokens_kv"])
        backup_bytes.labels(*lv).inc(v[f"hicache_backup_bytes_rank{tp}"])
        load_back_bytes.labels(*lv).inc(v[f"load_back_bytes_rank{tp}"])
        backup.labels(*lv, "kv").inc(v["hicache_backup_tokens_kv"])
        dropped.labels(*lv, "host_pressure", "kv").inc(v["hicache_dropped_tokens_host_pressure"])

    st_lab = ["storage_backend", "tp_rank", "dp_rank", "pp_rank", "pp_size", "attn_cp_rank", "attn_cp_size"]
    prefetched = Counter(
        "sglang:prefetched_tokens_total",
        "Prompt tokens successfully transferred from L3 storage into host memory, before admission-time reuse or "
        "discard.",
        st_lab,
        registry=r,
    )
    backuped = Counter("sglang:backuped_tokens_total", "Number of backuped tokens.", st_lab, registry=r)
    st_hit = Counter(
        "sglang:storage_prefetch_hit_tokens_total",
        "Storage-hit tokens returned by an L3 query before host allocation, transfer, or cache insertion.",
        st_lab,
        registry=r,
    )
    unfulfilled = Counter(
        "sglang:storage_prefetch_unfulfilled_tokens_total",
        "Attempt-level storage-hit tokens that did not become a usable prefetch result, by diagnostic reason. "
        "This is not a final prefill cache-miss counter. anchor_lost means the original device prefix was no "
        "longer present when the prefetch needed it; aux_window_trim means a staged aux trailing window could not "
        "be trimmed to the shorter splice, so the loaded span was released; device_overlap means the live device "
        "prefix diverged from the request's view at splice time, so the span beyond it was released; "
        "cache_admission_shortfall means an L3-loaded L2 span was no longer reusable when cache-mode admission "
        "ran; deadline means the storage prefetch stop policy ended the read before it completed.",
        [*st_lab, "reason"],
        registry=r,
    )
    deferred = Counter(
        "sglang:storage_prefetch_deferred_tokens_total",
        "Storage-prefetch token-attempts deferred for later reuse, by transient capacity reason.",
        [*st_lab, "reason"],
        registry=r,
    )
    backup_dropped = Counter(
        "sglang:hicache_backup_dropped_tokens_total",
        "Buffer-mode backup tokens that never reached L3 because admission rejected them or the source became "
        "stale before the D2H staging launched; the write path lagging device churn is the common cause, and the "
        "span rewrites only on a later recompute.",
        st_lab,
        registry=r,
    )
    reasons = (
        "below_threshold",
        "host_capacity",
        "device_capacity",
        "device_covered",
        "storage_transfer",
        "deadline",
        "anchor_lost",
        "aux_window_trim",
        "device_overlap",
        "cache_admission_shortfall",
        "dropped",
    )
    for tp in ("0", "1"):
        lv = ("file", tp, "0", "0", "1", "0", "1")
        for reason in reasons:  # SGLang binds every reason child at start-up
            unfulfilled.labels(*lv, reason)
        for reason in ("host_capacity", "device_capacity"):
            deferred.labels(*lv, reason)
        prefetched.labels(*lv).inc(v["prefetched_tokens"])
        backuped.labels(*lv).inc(v["backuped_tokens"])
        st_hit.labels(*lv).inc(v["storage_prefetch_hit_tokens"])
        unfulfilled.labels(*lv, "host_capacity").inc(v["storage_prefetch_unfulfilled_host_capacity"])
        backup_dropped.labels(*lv).inc(v["hicache_backup_dropped_tokens"])

    tok_lab = ["model_name", "engine_type"]
    prompt = Counter(
        "sglang:prompt_tokens_total", "Number of prefill tokens processed.", [*tok_lab, "is_streaming"], registry=r
    )
    cached = Counter(
        "sglang:cached_tokens_total",
        "Number of cached prompt tokens by source (device/host/storage).",
        [*tok_lab, "cache_source"],
        registry=r,
    )
    prompt.labels("qwen", "unified", "true").inc(v["prompt_tokens_streaming"])
    prompt.labels("qwen", "unified", "false").inc(v["prompt_tokens_not_streaming"])
    for source in ("device", "host", "storage"):
        cached.labels("qwen", "unified", source).inc(v[f"cached_tokens_{source}"])
    return generate_latest(r)


def _rust_f64(x: float) -> str:
    """Rust's f64 Display (the prometheus crate's TextEncoder writes value.to_string()):
    no '.0' on whole numbers, never an exponent (the values here stay in 1e-4..1e15)."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


# (name without the kvbm_ prefix, type, HELP) as lib/llm/src/block_manager/metrics_kvbm.rs declares them
_KVBM_METRICS = [
    ("offload_blocks_d2h", "counter", "The number of offload blocks from device to host"),
    ("offload_blocks_h2d", "counter", "The number of offload blocks from host to disk"),
    ("offload_blocks_d2d", "counter", "The number of offload blocks from device to disk (bypassing host memory)"),
    ("offload_blocks_d2o", "counter", "The number of offload blocks from device to object storage"),
    ("onboard_blocks_h2d", "counter", "The number of onboard blocks from host to device"),
    ("onboard_blocks_d2d", "counter", "The number of onboard blocks from disk to device"),
    ("onboard_blocks_o2d", "counter", "The number of onboard blocks from object storage to device"),
    ("matched_tokens", "counter", "The number of matched tokens"),
    ("host_cache_hit_rate", "gauge", "Host cache hit rate (0.0-1.0) from the sliding window"),
    ("disk_cache_hit_rate", "gauge", "Disk cache hit rate (0.0-1.0) from the sliding window"),
    ("object_cache_hit_rate", "gauge", "Object storage cache hit rate (0.0-1.0) from the sliding window"),
    ("object_read_failures", "counter", "The number of failed object storage read operations (blocks)"),
    ("object_write_failures", "counter", "The number of failed object storage write operations (blocks)"),
]


def dynamo_kvbm() -> bytes:
    """NVIDIA Dynamo KVBM 1.6.1: Rust prometheus-crate IntCounters and Gauges on KVBM's own
    registry (prefix kvbm_, no labels, served on DYN_KVBM_METRICS_PORT). Written as the crate's
    TextEncoder writes it: families sorted by name (Registry::gather), counters with no _total
    suffix and no _created sample, integers without '.0', no blank lines."""
    v = TIER_VALUES["dynamo-kvbm-1.6.1"]
    out = []
    for name, typ, doc in sorted(_KVBM_METRICS):
        full = f"kvbm_{name}"
        out.append(f"# HELP {full} {doc}\n# TYPE {full} {typ}\n{full} {_rust_f64(v[name])}\n")
    return "".join(out).encode()


TIER_FIXTURES = {
    "vllm-offload-0.26.0.txt": vllm_offload,
    "lmcache-0.5.6-tiers.txt": lmcache_tiers,
    "lmcache-mp-0.5.6.txt": lmcache_mp,
    "sglang-hicache-0.5.23.txt": sglang_hicache,
    "dynamo-kvbm-1.6.1.txt": dynamo_kvbm,
}


def _without_created(body: bytes) -> list[bytes]:
    """The page less its _created series, which carry the wall-clock time of the run."""
    keep, out = True, []
    for line in body.splitlines():
        if line.startswith((b"# HELP ", b"# TYPE ")):
            keep = not line.split()[2].endswith(b"_created")
        if keep and not line.split(b"{")[0].split(b" ")[0].endswith(b"_created"):
            out.append(line)
    return out


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    pages = {
        "vllm-0.33.0.txt": vllm(True),
        "vllm-0.11.0.txt": vllm(False),
        "sglang-0.5.23.txt": sglang(),
        "lmcache-0.5.6.txt": lmcache(),
    }
    pages.update({name: build() for name, build in TIER_FIXTURES.items()})
    for name, body in pages.items():
        path = OUT / name
        # A file that differs only in its _created timestamps is left as it is, so that
        # running this again changes no fixture unless a declaration or value changed.
        if path.exists() and _without_created(path.read_bytes()) == _without_created(body):
            print(path, "(unchanged)")
            continue
        path.write_bytes(body)
        print(path)


if __name__ == "__main__":
    main()
