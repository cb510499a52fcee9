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


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, body in {
        "vllm-0.33.0.txt": vllm(True),
        "vllm-0.11.0.txt": vllm(False),
        "sglang-0.5.23.txt": sglang(),
        "lmcache-0.5.6.txt": lmcache(),
    }.items():
        (OUT / name).write_bytes(body)
        print(OUT / name)


if __name__ == "__main__":
    main()
