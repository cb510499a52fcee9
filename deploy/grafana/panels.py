"""The dashboard's contents: a row per area, a panel per metric family, as data for generate.py.

Each Graph is a title, a unit and its queries as (PromQL, legend) pairs. Every query follows the
node picker; per-process families follow the engine and pod pickers too. tests/unit/test_deploy.py
fails when a family kvwatch exports appears in no query.
"""

from __future__ import annotations

from typing import NamedTuple

NODE = 'instance=~"$node"'
PROC = f'{NODE},engine=~"$engine",pod=~"$pod"'
BY_PROC = "pid, engine, pod"


def sel(metric: str, where: str = NODE) -> str:
    """A series selector; every query follows the node picker, per-process ones engine and pod too."""
    return f"{metric}{{{where}}}"


def total(metric: str, by: str, where: str = PROC) -> str:
    return f"sum by ({by}) ({sel(metric, where)})"


def rate(metric: str, by: str, where: str = PROC, fn: str = "rate") -> str:
    """A counter's per-second rate, summed by labels."""
    return f"sum by ({by}) ({fn}({sel(metric, where)}[$__rate_interval]))"


def increase(metric: str, by: str, where: str = PROC) -> str:
    """A counter's count per step, summed by labels: for rare events (alerts, resets, losses)."""
    return rate(metric, by, where, "increase")


def quantile(q: float, histogram: str, by: str = "pid, lib") -> str:
    return f"histogram_quantile({q}, {rate(f'{histogram}_bucket', f'le, {by}')})"


class Graph(NamedTuple):
    """A panel: its queries as (PromQL, legend) pairs, drawn over time or, as a table, at the instant."""

    title: str
    unit: str
    queries: list[tuple[str, str]]
    table: bool = False


ROWS: list[tuple[str, list[Graph]]] = [
    (
        "Agent",
        [
            Graph(
                "Active alerts",
                "none",
                [(f"{sel('kvwatch_alert_active')} == 1", "{{alert}} {{cause}} pid {{pid}} {{tier}}{{probe}}")],
                table=True,
            ),
            Graph("Alert onsets", "short", [(increase("kvwatch_alerts_fired_total", "alert", NODE), "{{alert}}")]),
            Graph(
                "Watched processes",
                "short",
                [
                    (total("kvwatch_watched_processes", "engine", NODE), "{{engine}}"),
                    (
                        f"sum(rate({sel('kvwatch_watched_processes_overflow_total')}[$__rate_interval]))",
                        "over the cap /s",
                    ),
                ],
            ),
            Graph(
                "Ready, build",
                "short",
                [
                    (sel("kvwatch_ready"), "ready {{instance}}"),
                    (sel("kvwatch_build_info"), "{{version}} bcc {{bcc_version}}"),
                ],
            ),
            Graph(
                "Loop",
                "s",
                [
                    (sel("kvwatch_loop_duration_seconds"), "tick {{instance}}"),
                    (sel("kvwatch_snapshot_age_seconds"), "snapshot age {{instance}}"),
                ],
            ),
            Graph(
                "Probes attached",
                "short",
                [
                    (total("kvwatch_probe_attached", "family", NODE), "{{family}}"),
                    (total("kvwatch_cuda_probes_attached", "pid", NODE), "cuda pid {{pid}}"),
                    (total("kvwatch_transfer_probes_attached", "pid", NODE), "transfer pid {{pid}}"),
                ],
            ),
            Graph("Probe hits /s", "short", [(rate("kvwatch_probe_hits_total", "probe", NODE), "{{probe}}")]),
            Graph("Events lost /s", "short", [(rate("kvwatch_events_lost_total", "source", NODE), "{{source}}")]),
            Graph("Uprobe releases pending", "short", [(sel("kvwatch_uprobe_releases_pending"), "{{instance}}")]),
            Graph(
                "What kvwatch's uprobes cost each process (share of its CPU), shed by the budget",
                "percentunit",
                [
                    (total("kvwatch_uprobe_cost_ratio", BY_PROC), "{{pid}} cost"),
                    (rate("kvwatch_uprobe_cost_seconds_total", f"{BY_PROC}, family"), "{{pid}} {{family}} s/s"),
                    (total("kvwatch_uprobes_shed", f"{BY_PROC}, family"), "{{pid}} {{family}} shed"),
                    (increase("kvwatch_uprobe_sheds_total", "family", NODE), "sheds {{family}}"),
                ],
            ),
            Graph(
                "Per-call cost of a probed call; BPF program time per run (live, BPF statistics)",
                "s",
                [
                    (sel("kvwatch_uprobe_call_cost_seconds"), "call {{family}} ({{source}})"),
                    (sel("kvwatch_uprobe_canary_call_seconds"), "canary"),
                    (
                        f"{rate('kvwatch_probe_run_seconds_total', 'family, program', NODE)} / "
                        f"{rate('kvwatch_probe_runs_total', 'family, program', NODE)}",
                        "{{family}} {{program}}",
                    ),
                    (sel("kvwatch_bpf_stats_enabled"), "BPF statistics on"),
                ],
            ),
            Graph("Errors /s", "short", [(rate("kvwatch_errors_total", "kind", NODE), "{{kind}}")]),
            Graph(
                "Alertmanager sink",
                "short",
                [(rate("kvwatch_alertmanager_alerts_total", "result", NODE), "{{result}}")],
            ),
        ],
    ),
    (
        "Memory and KV-tier page cache",
        [
            Graph("Pages freed /s", "short", [(rate("kvwatch_page_free_pages_total", BY_PROC), "{{engine}} {{pid}}")]),
            Graph(
                "Reclaim stall (s/s)",
                "percentunit",
                [(rate("kvwatch_direct_reclaim_seconds_total", BY_PROC), "{{engine}} {{pid}}")],
            ),
            Graph(
                "Reclaim stalls /s",
                "short",
                [(rate("kvwatch_direct_reclaim_stalls_total", BY_PROC), "{{engine}} {{pid}}")],
            ),
            Graph(
                "KV-tier page cache evicted",
                "Bps",
                [(rate("kvwatch_pagecache_evicted_bytes_total", "tier, cause", NODE), "{{tier}} {{cause}}")],
            ),
            Graph(
                "KV-tier page cache reclaimed, by whom",
                "Bps",
                [
                    (
                        rate(
                            "kvwatch_pagecache_reclaimed_bytes_total",
                            "tier, reclaimer, scope, reclaimer_cgroup, reclaimer_pod_uid",
                            NODE,
                        ),
                        "{{tier}} {{reclaimer}} {{scope}} {{reclaimer_cgroup}}",
                    )
                ],
            ),
            Graph(
                "KV-tier refaults /s",
                "short",
                [(rate("kvwatch_pagecache_refault_pages_total", "tier", NODE), "{{tier}}")],
            ),
            Graph("KV-tier files", "short", [(sel("kvwatch_kv_tier_files"), "{{tier}}")]),
            Graph(
                "Memory pressure (PSI some avg10)",
                "percent",
                [(sel("kvwatch_memory_pressure_some_avg10"), "{{instance}}")],
            ),
            Graph(
                "OOM kills",
                "short",
                [(increase("kvwatch_oom_kills_total", "engine, pod"), "{{engine}} {{pod}}")],
            ),
        ],
    ),
    (
        "CUDA allocator",
        [
            Graph(
                "Allocation calls /s",
                "short",
                [(rate("kvwatch_cuda_alloc_calls_total", f"{BY_PROC}, api, result"), "{{pid}} {{api}} {{result}}")],
            ),
            Graph(
                "Allocated bytes /s",
                "Bps",
                [(rate("kvwatch_cuda_alloc_bytes_total", f"{BY_PROC}, api"), "{{pid}} {{api}}")],
            ),
            Graph(
                "Free calls /s",
                "short",
                [(rate("kvwatch_cuda_free_calls_total", f"{BY_PROC}, api, result"), "{{pid}} {{api}} {{result}}")],
            ),
            Graph(
                "Freed bytes /s",
                "Bps",
                [
                    (rate("kvwatch_cuda_freed_bytes_total", f"{BY_PROC}, api"), "{{pid}} {{api}}"),
                    (rate("kvwatch_cuda_free_unknown_total", BY_PROC), "{{pid}} frees of unknown size /s"),
                ],
            ),
            Graph(
                "Outstanding",
                "bytes",
                [
                    (total("kvwatch_cuda_outstanding_bytes", f"{BY_PROC}, kind"), "{{pid}} {{kind}}"),
                    (total("kvwatch_gpu_memory_used_bytes", BY_PROC), "{{pid}} NVML used"),
                ],
            ),
            Graph(
                "Allocation failures /s",
                "short",
                [(rate("kvwatch_cuda_alloc_failures_total", f"{BY_PROC}, api, code"), "{{pid}} {{api}} {{code}}")],
            ),
            Graph(
                "VMM map / unmap",
                "short",
                [
                    (rate("kvwatch_cuda_vmm_map_calls_total", f"{BY_PROC}, api"), "{{pid}} {{api}} /s"),
                    (rate("kvwatch_cuda_vmm_mapped_bytes_total", f"{BY_PROC}, api"), "{{pid}} {{api}} B/s"),
                ],
            ),
            Graph(
                "Host/device copies",
                "Bps",
                [
                    (rate("kvwatch_cuda_copy_bytes_total", f"{BY_PROC}, direction"), "{{pid}} {{direction}}"),
                    (rate("kvwatch_cuda_copy_calls_total", f"{BY_PROC}, direction"), "{{pid}} {{direction}} calls/s"),
                ],
            ),
        ],
    ),
    (
        "KV transfers",
        [
            Graph(
                "Transfer bytes /s",
                "Bps",
                [(rate("kvwatch_transfer_bytes_total", f"{BY_PROC}, lib, op"), "{{pid}} {{lib}} {{op}}")],
            ),
            Graph(
                "Transfer calls and completions /s",
                "short",
                [
                    (rate("kvwatch_transfer_calls_total", f"{BY_PROC}, lib"), "{{pid}} {{lib}} calls"),
                    (rate("kvwatch_transfer_completed_total", f"{BY_PROC}, lib"), "{{pid}} {{lib}} completed"),
                ],
            ),
            Graph(
                "Transfer latency p50 / p99",
                "s",
                [
                    (quantile(0.5, "kvwatch_transfer_duration_seconds"), "p50 {{pid}} {{lib}}"),
                    (quantile(0.99, "kvwatch_transfer_duration_seconds"), "p99 {{pid}} {{lib}}"),
                ],
            ),
            Graph(
                "Effective bandwidth vs link",
                "Bps",
                [
                    (sel("kvwatch_transfer_effective_bandwidth_bytes", PROC), "{{pid}} effective"),
                    (sel("kvwatch_transfer_link_bandwidth_bytes"), "link"),
                ],
            ),
            Graph(
                "Link utilization", "percentunit", [(sel("kvwatch_transfer_link_utilization_ratio", PROC), "{{pid}}")]
            ),
            Graph("Transfers in flight", "short", [(sel("kvwatch_transfer_pending"), "{{instance}} {{pid}}")]),
            Graph(
                "RDMA registered",
                "bytes",
                [
                    (total("kvwatch_rdma_registered_bytes", BY_PROC), "{{pid}}"),
                    (rate("kvwatch_rdma_registrations_total", f"{BY_PROC}, op"), "{{pid}} {{op}} /s"),
                ],
            ),
        ],
    ),
    (
        "Engine KV events and metrics",
        [
            Graph(
                "KV blocks stored / removed /s",
                "short",
                [
                    (rate("kvwatch_kv_blocks_stored_total", f"{BY_PROC}, medium"), "{{pid}} stored {{medium}}"),
                    (rate("kvwatch_kv_blocks_removed_total", f"{BY_PROC}, medium"), "{{pid}} removed {{medium}}"),
                    (
                        rate("kvwatch_kv_blocks_removed_young_total", f"{BY_PROC}, medium"),
                        "{{pid}} removed young {{medium}}",
                    ),
                ],
            ),
            Graph(
                "Eviction regret: removed blocks stored again",
                "short",
                [
                    (rate("kvwatch_kv_blocks_regretted_total", f"{BY_PROC}, medium"), "{{pid}} regretted/s {{medium}}"),
                    (
                        rate("kvwatch_kv_blocks_restored_total", f"{BY_PROC}, medium"),
                        "{{pid}} stored while held/s {{medium}}",
                    ),
                    (
                        rate("kvwatch_kv_regret_recomputed_tokens_total", f"{BY_PROC}, medium"),
                        "{{pid}} recomputed tokens/s {{medium}}",
                    ),
                ],
            ),
            Graph(
                "KV cache groups (hybrid models): blocks /s per group",
                "short",
                [
                    (
                        rate("kvwatch_kv_group_blocks_stored_total", f"{BY_PROC}, medium, group, kind"),
                        "{{pid}} stored {{medium}} g{{group}} {{kind}}",
                    ),
                    (
                        rate("kvwatch_kv_group_blocks_removed_total", f"{BY_PROC}, medium, group, kind"),
                        "{{pid}} removed {{medium}} g{{group}} {{kind}}",
                    ),
                    (
                        rate("kvwatch_kv_group_blocks_removed_young_total", f"{BY_PROC}, medium, group, kind"),
                        "{{pid}} removed young {{medium}} g{{group}} {{kind}}",
                    ),
                    (
                        rate("kvwatch_kv_group_blocks_regretted_total", f"{BY_PROC}, medium, group, kind"),
                        "{{pid}} regretted {{medium}} g{{group}} {{kind}}",
                    ),
                    (
                        rate("kvwatch_kv_group_blocks_restored_total", f"{BY_PROC}, medium, group, kind"),
                        "{{pid}} stored while held {{medium}} g{{group}} {{kind}}",
                    ),
                ],
            ),
            Graph(
                "KV cache groups: blocks held, group kinds",
                "short",
                [
                    (
                        total("kvwatch_kv_group_blocks_resident", f"{BY_PROC}, medium, group, kind"),
                        "{{pid}} held {{medium}} g{{group}} {{kind}}",
                    ),
                    (
                        total("kvwatch_kv_cache_group_info", f"{BY_PROC}, medium, kind, sliding_window, reference"),
                        "{{pid}} {{medium}} groups of {{kind}} {{sliding_window}} (reference {{reference}})",
                    ),
                ],
            ),
            Graph(
                "Prefix hits announced, blocks stored with extra keys /s",
                "short",
                [
                    (
                        rate("kvwatch_kv_blocks_announced_total", f"{BY_PROC}, medium"),
                        "{{pid}} hit blocks announced {{medium}}",
                    ),
                    (
                        rate("kvwatch_kv_group_blocks_announced_total", f"{BY_PROC}, medium, group, kind"),
                        "{{pid}} hit blocks announced {{medium}} g{{group}} {{kind}}",
                    ),
                    (
                        rate("kvwatch_kv_blocks_stored_extra_keys_total", f"{BY_PROC}, key"),
                        "{{pid}} stored with {{key}}",
                    ),
                ],
            ),
            Graph(
                "Regret ratio, time to store again, seconds of removals remembered",
                "short",
                [
                    (total("kvwatch_kv_regret_ratio", f"{BY_PROC}, medium"), "{{pid}} regretted/removed {{medium}}"),
                    (quantile(0.5, "kvwatch_kv_regret_seconds", "pid, medium"), "p50 s {{pid}} {{medium}}"),
                    (quantile(0.99, "kvwatch_kv_regret_seconds", "pid, medium"), "p99 s {{pid}} {{medium}}"),
                    (
                        total("kvwatch_kv_regret_horizon_seconds", f"{BY_PROC}, medium"),
                        "horizon s {{pid}} {{medium}}",
                    ),
                ],
            ),
            Graph(
                "Why did the hit rate drop: KV lost by tier and cause",
                "Bps",
                [
                    (rate("kvwatch_kv_lost_bytes_total", "engine, tier, cause"), "{{engine}} {{tier}} {{cause}}"),
                ],
            ),
            Graph(
                "KV blocks lost /s by tier and cause, block size",
                "short",
                [
                    (rate("kvwatch_kv_lost_blocks_total", "engine, tier, cause"), "{{engine}} {{tier}} {{cause}}"),
                    (total("kvwatch_kv_block_bytes", f"{BY_PROC}, source"), "{{pid}} bytes/block ({{source}})"),
                ],
            ),
            Graph("KV cache resets", "short", [(increase("kvwatch_kv_cache_resets_total", BY_PROC), "{{pid}}")]),
            Graph(
                "Event streams",
                "short",
                [
                    (sel("kvwatch_kv_event_stream_connected"), "connected {{endpoint}} dp{{dp_rank}}"),
                    (rate("kvwatch_kv_event_batches_total", "endpoint", NODE), "batches/s {{endpoint}}"),
                ],
            ),
            Graph(
                "Event stream losses",
                "short",
                [
                    (increase("kvwatch_kv_event_gaps_total", "endpoint", NODE), "gaps {{endpoint}}"),
                    (
                        increase("kvwatch_kv_event_batches_replayed_total", "endpoint", NODE),
                        "replayed {{endpoint}}",
                    ),
                    (increase("kvwatch_kv_event_batches_lost_total", "endpoint", NODE), "lost {{endpoint}}"),
                    (
                        increase("kvwatch_kv_event_batches_abandoned_total", "endpoint", NODE),
                        "of them abandoned {{endpoint}}",
                    ),
                    (
                        increase("kvwatch_kv_event_decode_errors_total", "endpoint, kind", NODE),
                        "decode errors {{kind}}",
                    ),
                    (
                        increase("kvwatch_kv_event_publisher_restarts_total", "endpoint", NODE),
                        "publisher restarts {{endpoint}}",
                    ),
                ],
            ),
            Graph(
                "Engine /metrics scrapes /s, samples rejected, taps refused",
                "short",
                [
                    (rate("kvwatch_engine_scrapes_total", "result", NODE), "{{result}}"),
                    (rate("kvwatch_engine_samples_rejected_total", "reason", NODE), "rejected {{reason}}"),
                    (total("kvwatch_engine_taps_refused", "reason", NODE), "refused {{reason}}"),
                ],
            ),
            Graph(
                "Engine KV usage, prefix-cache hits",
                "percentunit",
                [
                    (sel("kvwatch_engine_kv_usage_ratio", PROC), "usage {{pid}}"),
                    (sel("kvwatch_engine_prefix_cache_hit_ratio", PROC), "prefix hits {{pid}}"),
                    (
                        f"{rate('kvwatch_engine_prefix_cache_hit_tokens_total', f'{BY_PROC}, medium')} / "
                        f"{rate('kvwatch_engine_prefix_cache_queried_tokens_total', f'{BY_PROC}, medium')}",
                        "hits {{medium}} {{pid}}",
                    ),
                    (sel("kvwatch_engine_sleeping", PROC), "sleeping {{pid}}"),
                ],
            ),
            Graph(
                "Engine preemptions /s and tokens generated /s (a livelock: the first up, the second to 0)",
                "short",
                [
                    (rate("kvwatch_engine_preemptions_total", BY_PROC), "preempted {{engine}} {{pid}}"),
                    (rate("kvwatch_engine_generation_tokens_total", BY_PROC), "tokens {{engine}} {{pid}}"),
                ],
            ),
            Graph(
                "KV offload: engine-reported vs copies seen",
                "Bps",
                [
                    (
                        rate("kvwatch_engine_kv_offload_bytes_total", f"{BY_PROC}, direction"),
                        "engine {{direction}} {{pid}}",
                    ),
                    (
                        rate("kvwatch_cuda_copy_bytes_total", "engine, pod, direction", f'{PROC},direction=~"d2h|h2d"'),
                        "copies {{direction}} {{engine}}",
                    ),
                ],
            ),
            Graph(
                "Can the engine's KV counters be trusted: engine vs kvwatch, last audit window",
                "short",
                [
                    (
                        total("kvwatch_engine_metric_audit_value", f"{BY_PROC}, pair, source, unit"),
                        "{{pid}} {{pair}} {{source}} ({{unit}})",
                    ),
                    (
                        total("kvwatch_engine_metric_divergence_ratio", f"{BY_PROC}, pair"),
                        "{{pid}} {{pair}} divergence",
                    ),
                    (
                        increase("kvwatch_engine_metric_audit_windows_total", f"{BY_PROC}, pair, result"),
                        "{{pid}} {{pair}} windows {{result}}",
                    ),
                ],
            ),
            Graph(
                "KV tiers as the engines count them: bytes /s stored, loaded, evicted",
                "Bps",
                [
                    (
                        rate(f"kvwatch_engine_kv_tier_{m}_bytes_total", "engine, tier, source"),
                        f"{m} {{{{tier}}}} ({{{{source}}}})",
                    )
                    for m in ("stored", "loaded", "evicted")
                ],
            ),
            Graph(
                "KV tiers in the engines' own units /s (blocks, chunks, tokens)",
                "short",
                [
                    (
                        rate(f"kvwatch_engine_kv_tier_{m}_units_total", "engine, tier, source, unit"),
                        f"{m} {{{{tier}}}} {{{{unit}}}} ({{{{source}}}})",
                    )
                    for m in ("stored", "loaded", "evicted")
                ],
            ),
            Graph(
                "KV tiers: hit ratio, usage",
                "percentunit",
                [
                    (
                        total("kvwatch_engine_kv_tier_hit_ratio", f"{BY_PROC}, tier, source"),
                        "hits {{tier}} ({{source}})",
                    ),
                    (
                        total("kvwatch_engine_kv_tier_usage_ratio", f"{BY_PROC}, tier, source"),
                        "usage {{tier}} ({{source}})",
                    ),
                    (
                        f"{rate('kvwatch_engine_kv_tier_hit_tokens_total', 'engine, tier, source')} / "
                        f"{rate('kvwatch_engine_kv_tier_queried_tokens_total', 'engine, tier, source')}",
                        "hits/queried tokens {{tier}} ({{source}})",
                    ),
                ],
            ),
            Graph(
                "KV tiers: bytes held",
                "bytes",
                [
                    (
                        total("kvwatch_engine_kv_tier_used_bytes", f"{BY_PROC}, tier, source"),
                        "{{pid}} {{tier}} ({{source}})",
                    )
                ],
            ),
        ],
    ),
    (
        "Tenants: whose KV cache was evicted, and by whom",
        [
            Graph(
                "Who fills the pool: blocks stored /s by tenant",
                "short",
                [(rate("kvwatch_kv_tenant_blocks_stored_total", "engine, medium, tenant"), "{{tenant}} {{medium}}")],
            ),
            Graph(
                "Whose blocks are evicted /s (young: hot ones)",
                "short",
                [
                    (rate("kvwatch_kv_tenant_blocks_removed_total", "engine, medium, tenant"), "{{tenant}} {{medium}}"),
                    (
                        rate("kvwatch_kv_tenant_blocks_removed_young_total", "engine, medium, tenant"),
                        "young {{tenant}} {{medium}}",
                    ),
                ],
            ),
            Graph(
                "Who recomputes: regretted evictions /s and tokens recomputed /s by tenant",
                "short",
                [
                    (rate("kvwatch_kv_tenant_blocks_regretted_total", "engine, medium, tenant"), "{{tenant}} blocks"),
                    (
                        rate("kvwatch_kv_tenant_regret_recomputed_tokens_total", "engine, medium, tenant"),
                        "{{tenant}} tokens",
                    ),
                ],
            ),
            Graph(
                "Each tenant's share of the pool (blocks held)",
                "short",
                [(total("kvwatch_kv_tenant_blocks_resident", "engine, medium, tenant"), "{{tenant}} {{medium}}")],
            ),
            Graph(
                "KV lost by tenant, tier and cause",
                "Bps",
                [
                    (
                        rate("kvwatch_kv_tenant_lost_bytes_total", "engine, tenant, tier, cause"),
                        "{{tenant}} {{tier}} {{cause}}",
                    ),
                    (
                        rate("kvwatch_kv_tenant_lost_blocks_total", "engine, tenant, tier, cause"),
                        "blocks {{tenant}} {{tier}} {{cause}}",
                    ),
                ],
            ),
            Graph(
                "Noisy neighbours now (KVTenantThrash) and tenants labelled / folded",
                "short",
                [
                    (
                        total("kvwatch_alert_active", "pid, tenant, aggressor", f'{PROC},alert="KVTenantThrash"'),
                        "{{aggressor}} -> {{tenant}}",
                    ),
                    (total("kvwatch_kv_tenants", f"{BY_PROC}, state"), "{{pid}} {{state}}"),
                ],
            ),
        ],
    ),
]
