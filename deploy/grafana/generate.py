# ruff: noqa: E501 - a table of PromQL expressions reads better unwrapped
"""Writes kvwatch.json, the Grafana dashboard (provisionable; Grafana 9+).

    python3 deploy/grafana/generate.py     # after adding a metric family: regenerate, commit

One row per area (agent, memory and page cache, CUDA allocator, KV transfers, engine KV
events), a panel per metric family, template variables for the Prometheus data source,
node, engine and pod, and kvwatch's alerts as annotations. tests/unit/test_deploy.py
fails when a family kvwatch exports has no panel or the file is stale.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("kvwatch.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
NODE = 'instance=~"$node"'
PROC = f'{NODE},engine=~"$engine",pod=~"$pod"'
BY_PROC = "pid, engine, pod"

# (title, unit, [(expr, legend)], panel type)
Panel = tuple[str, str, list[tuple[str, str]], str]

ROWS: list[tuple[str, list[Panel]]] = [
    (
        "Agent",
        [
            (
                "Active alerts",
                "none",
                [(f"kvwatch_alert_active{{{NODE}}} == 1", "{{alert}} {{cause}} pid {{pid}} {{tier}}{{probe}}")],
                "table",
            ),
            (
                "Alert onsets",
                "short",
                [(f"sum by (alert) (increase(kvwatch_alerts_fired_total{{{NODE}}}[$__rate_interval]))", "{{alert}}")],
                "timeseries",
            ),
            (
                "Watched processes",
                "short",
                [
                    (f"sum by (engine) (kvwatch_watched_processes{{{NODE}}})", "{{engine}}"),
                    (
                        f"sum(rate(kvwatch_watched_processes_overflow_total{{{NODE}}}[$__rate_interval]))",
                        "over the cap /s",
                    ),
                ],
                "timeseries",
            ),
            (
                "Ready, build",
                "short",
                [
                    (f"kvwatch_ready{{{NODE}}}", "ready {{instance}}"),
                    (f"kvwatch_build_info{{{NODE}}}", "{{version}} bcc {{bcc_version}}"),
                ],
                "timeseries",
            ),
            (
                "Loop",
                "s",
                [
                    (f"kvwatch_loop_duration_seconds{{{NODE}}}", "tick {{instance}}"),
                    (f"kvwatch_snapshot_age_seconds{{{NODE}}}", "snapshot age {{instance}}"),
                ],
                "timeseries",
            ),
            (
                "Probes attached",
                "short",
                [
                    (f"sum by (family) (kvwatch_probe_attached{{{NODE}}})", "{{family}}"),
                    (f"sum by (pid) (kvwatch_cuda_probes_attached{{{NODE}}})", "cuda pid {{pid}}"),
                    (f"sum by (pid) (kvwatch_transfer_probes_attached{{{NODE}}})", "transfer pid {{pid}}"),
                ],
                "timeseries",
            ),
            (
                "Probe hits /s",
                "short",
                [(f"sum by (probe) (rate(kvwatch_probe_hits_total{{{NODE}}}[$__rate_interval]))", "{{probe}}")],
                "timeseries",
            ),
            (
                "Events lost /s",
                "short",
                [(f"sum by (source) (rate(kvwatch_events_lost_total{{{NODE}}}[$__rate_interval]))", "{{source}}")],
                "timeseries",
            ),
            (
                "Uprobe releases pending",
                "short",
                [(f"kvwatch_uprobe_releases_pending{{{NODE}}}", "{{instance}}")],
                "timeseries",
            ),
            (
                "Errors /s",
                "short",
                [(f"sum by (kind) (rate(kvwatch_errors_total{{{NODE}}}[$__rate_interval]))", "{{kind}}")],
                "timeseries",
            ),
            (
                "Alertmanager sink",
                "short",
                [
                    (
                        f"sum by (result) (rate(kvwatch_alertmanager_alerts_total{{{NODE}}}[$__rate_interval]))",
                        "{{result}}",
                    )
                ],
                "timeseries",
            ),
        ],
    ),
    (
        "Memory and KV-tier page cache",
        [
            (
                "Pages freed /s",
                "short",
                [
                    (
                        f"sum by ({BY_PROC}) (rate(kvwatch_page_free_pages_total{{{PROC}}}[$__rate_interval]))",
                        "{{engine}} {{pid}}",
                    )
                ],
                "timeseries",
            ),
            (
                "Reclaim stall (s/s)",
                "percentunit",
                [
                    (
                        f"sum by ({BY_PROC}) (rate(kvwatch_direct_reclaim_seconds_total{{{PROC}}}[$__rate_interval]))",
                        "{{engine}} {{pid}}",
                    )
                ],
                "timeseries",
            ),
            (
                "Reclaim stalls /s",
                "short",
                [
                    (
                        f"sum by ({BY_PROC}) (rate(kvwatch_direct_reclaim_stalls_total{{{PROC}}}[$__rate_interval]))",
                        "{{engine}} {{pid}}",
                    )
                ],
                "timeseries",
            ),
            (
                "KV-tier page cache evicted",
                "Bps",
                [
                    (
                        f"sum by (tier, cause) (rate(kvwatch_pagecache_evicted_bytes_total{{{NODE}}}[$__rate_interval]))",
                        "{{tier}} {{cause}}",
                    )
                ],
                "timeseries",
            ),
            (
                "KV-tier refaults /s",
                "short",
                [
                    (
                        f"sum by (tier) (rate(kvwatch_pagecache_refault_pages_total{{{NODE}}}[$__rate_interval]))",
                        "{{tier}}",
                    )
                ],
                "timeseries",
            ),
            ("KV-tier files", "short", [(f"kvwatch_kv_tier_files{{{NODE}}}", "{{tier}}")], "timeseries"),
            (
                "Memory pressure (PSI some avg10)",
                "percent",
                [(f"kvwatch_memory_pressure_some_avg10{{{NODE}}}", "{{instance}}")],
                "timeseries",
            ),
            (
                "OOM kills",
                "short",
                [
                    (
                        f'sum by (engine, pod) (increase(kvwatch_oom_kills_total{{{NODE},engine=~"$engine",pod=~"$pod"}}[$__rate_interval]))',
                        "{{engine}} {{pod}}",
                    )
                ],
                "timeseries",
            ),
        ],
    ),
    (
        "CUDA allocator",
        [
            (
                "Allocation calls /s",
                "short",
                [
                    (
                        f"sum by ({BY_PROC}, api, result) (rate(kvwatch_cuda_alloc_calls_total{{{PROC}}}[$__rate_interval]))",
                        "{{pid}} {{api}} {{result}}",
                    )
                ],
                "timeseries",
            ),
            (
                "Allocated bytes /s",
                "Bps",
                [
                    (
                        f"sum by ({BY_PROC}, api) (rate(kvwatch_cuda_alloc_bytes_total{{{PROC}}}[$__rate_interval]))",
                        "{{pid}} {{api}}",
                    )
                ],
                "timeseries",
            ),
            (
                "Free calls /s",
                "short",
                [
                    (
                        f"sum by ({BY_PROC}, api, result) (rate(kvwatch_cuda_free_calls_total{{{PROC}}}[$__rate_interval]))",
                        "{{pid}} {{api}} {{result}}",
                    )
                ],
                "timeseries",
            ),
            (
                "Freed bytes /s",
                "Bps",
                [
                    (
                        f"sum by ({BY_PROC}, api) (rate(kvwatch_cuda_freed_bytes_total{{{PROC}}}[$__rate_interval]))",
                        "{{pid}} {{api}}",
                    ),
                    (
                        f"sum by ({BY_PROC}) (rate(kvwatch_cuda_free_unknown_total{{{PROC}}}[$__rate_interval]))",
                        "{{pid}} frees of unknown size /s",
                    ),
                ],
                "timeseries",
            ),
            (
                "Outstanding",
                "bytes",
                [
                    (f"sum by ({BY_PROC}, kind) (kvwatch_cuda_outstanding_bytes{{{PROC}}})", "{{pid}} {{kind}}"),
                    (f"sum by ({BY_PROC}) (kvwatch_gpu_memory_used_bytes{{{PROC}}})", "{{pid}} NVML used"),
                ],
                "timeseries",
            ),
            (
                "Allocation failures /s",
                "short",
                [
                    (
                        f"sum by ({BY_PROC}, api, code) (rate(kvwatch_cuda_alloc_failures_total{{{PROC}}}[$__rate_interval]))",
                        "{{pid}} {{api}} {{code}}",
                    )
                ],
                "timeseries",
            ),
            (
                "VMM map / unmap",
                "short",
                [
                    (
                        f"sum by ({BY_PROC}, api) (rate(kvwatch_cuda_vmm_map_calls_total{{{PROC}}}[$__rate_interval]))",
                        "{{pid}} {{api}} /s",
                    ),
                    (
                        f"sum by ({BY_PROC}, api) (rate(kvwatch_cuda_vmm_mapped_bytes_total{{{PROC}}}[$__rate_interval]))",
                        "{{pid}} {{api}} B/s",
                    ),
                ],
                "timeseries",
            ),
            (
                "Host/device copies",
                "Bps",
                [
                    (
                        f"sum by ({BY_PROC}, direction) (rate(kvwatch_cuda_copy_bytes_total{{{PROC}}}[$__rate_interval]))",
                        "{{pid}} {{direction}}",
                    ),
                    (
                        f"sum by ({BY_PROC}, direction) (rate(kvwatch_cuda_copy_calls_total{{{PROC}}}[$__rate_interval]))",
                        "{{pid}} {{direction}} calls/s",
                    ),
                ],
                "timeseries",
            ),
        ],
    ),
    (
        "KV transfers",
        [
            (
                "Transfer bytes /s",
                "Bps",
                [
                    (
                        f"sum by ({BY_PROC}, lib, op) (rate(kvwatch_transfer_bytes_total{{{PROC}}}[$__rate_interval]))",
                        "{{pid}} {{lib}} {{op}}",
                    )
                ],
                "timeseries",
            ),
            (
                "Transfer calls and completions /s",
                "short",
                [
                    (
                        f"sum by ({BY_PROC}, lib) (rate(kvwatch_transfer_calls_total{{{PROC}}}[$__rate_interval]))",
                        "{{pid}} {{lib}} calls",
                    ),
                    (
                        f"sum by ({BY_PROC}, lib) (rate(kvwatch_transfer_completed_total{{{PROC}}}[$__rate_interval]))",
                        "{{pid}} {{lib}} completed",
                    ),
                ],
                "timeseries",
            ),
            (
                "Transfer latency p50 / p99",
                "s",
                [
                    (
                        f"histogram_quantile(0.5, sum by (le, pid, lib) (rate(kvwatch_transfer_duration_seconds_bucket{{{PROC}}}[$__rate_interval])))",
                        "p50 {{pid}} {{lib}}",
                    ),
                    (
                        f"histogram_quantile(0.99, sum by (le, pid, lib) (rate(kvwatch_transfer_duration_seconds_bucket{{{PROC}}}[$__rate_interval])))",
                        "p99 {{pid}} {{lib}}",
                    ),
                ],
                "timeseries",
            ),
            (
                "Effective bandwidth vs link",
                "Bps",
                [
                    (f"kvwatch_transfer_effective_bandwidth_bytes{{{PROC}}}", "{{pid}} effective"),
                    (f"kvwatch_transfer_link_bandwidth_bytes{{{NODE}}}", "link"),
                ],
                "timeseries",
            ),
            (
                "Link utilization",
                "percentunit",
                [(f"kvwatch_transfer_link_utilization_ratio{{{PROC}}}", "{{pid}}")],
                "timeseries",
            ),
            (
                "Transfers in flight",
                "short",
                [(f"kvwatch_transfer_pending{{{NODE}}}", "{{instance}} {{pid}}")],
                "timeseries",
            ),
            (
                "RDMA registered",
                "bytes",
                [
                    (f"sum by ({BY_PROC}) (kvwatch_rdma_registered_bytes{{{PROC}}})", "{{pid}}"),
                    (
                        f"sum by ({BY_PROC}, op) (rate(kvwatch_rdma_registrations_total{{{PROC}}}[$__rate_interval]))",
                        "{{pid}} {{op}} /s",
                    ),
                ],
                "timeseries",
            ),
        ],
    ),
    (
        "Engine KV events and metrics",
        [
            (
                "KV blocks stored / removed /s",
                "short",
                [
                    (
                        f"sum by ({BY_PROC}, medium) (rate(kvwatch_kv_blocks_stored_total{{{PROC}}}[$__rate_interval]))",
                        "{{pid}} stored {{medium}}",
                    ),
                    (
                        f"sum by ({BY_PROC}, medium) (rate(kvwatch_kv_blocks_removed_total{{{PROC}}}[$__rate_interval]))",
                        "{{pid}} removed {{medium}}",
                    ),
                    (
                        f"sum by ({BY_PROC}, medium) (rate(kvwatch_kv_blocks_removed_young_total{{{PROC}}}[$__rate_interval]))",
                        "{{pid}} removed young {{medium}}",
                    ),
                ],
                "timeseries",
            ),
            (
                "KV cache resets",
                "short",
                [
                    (
                        f"sum by ({BY_PROC}) (increase(kvwatch_kv_cache_resets_total{{{PROC}}}[$__rate_interval]))",
                        "{{pid}}",
                    )
                ],
                "timeseries",
            ),
            (
                "Event streams",
                "short",
                [
                    (f"kvwatch_kv_event_stream_connected{{{NODE}}}", "connected {{endpoint}} dp{{dp_rank}}"),
                    (
                        f"sum by (endpoint) (rate(kvwatch_kv_event_batches_total{{{NODE}}}[$__rate_interval]))",
                        "batches/s {{endpoint}}",
                    ),
                ],
                "timeseries",
            ),
            (
                "Event stream losses",
                "short",
                [
                    (
                        f"sum by (endpoint) (increase(kvwatch_kv_event_gaps_total{{{NODE}}}[$__rate_interval]))",
                        "gaps {{endpoint}}",
                    ),
                    (
                        f"sum by (endpoint) (increase(kvwatch_kv_event_batches_replayed_total{{{NODE}}}[$__rate_interval]))",
                        "replayed {{endpoint}}",
                    ),
                    (
                        f"sum by (endpoint) (increase(kvwatch_kv_event_batches_lost_total{{{NODE}}}[$__rate_interval]))",
                        "lost {{endpoint}}",
                    ),
                    (
                        f"sum by (endpoint, kind) (increase(kvwatch_kv_event_decode_errors_total{{{NODE}}}[$__rate_interval]))",
                        "decode errors {{kind}}",
                    ),
                    (
                        f"sum by (endpoint) (increase(kvwatch_kv_event_publisher_restarts_total{{{NODE}}}[$__rate_interval]))",
                        "publisher restarts {{endpoint}}",
                    ),
                ],
                "timeseries",
            ),
            (
                "Engine /metrics scrapes /s",
                "short",
                [(f"sum by (result) (rate(kvwatch_engine_scrapes_total{{{NODE}}}[$__rate_interval]))", "{{result}}")],
                "timeseries",
            ),
            (
                "Engine KV usage, prefix-cache hits",
                "percentunit",
                [
                    (f"kvwatch_engine_kv_usage_ratio{{{PROC}}}", "usage {{pid}}"),
                    (f"kvwatch_engine_prefix_cache_hit_ratio{{{PROC}}}", "prefix hits {{pid}}"),
                    (
                        f"sum by ({BY_PROC}, medium) (rate(kvwatch_engine_prefix_cache_hit_tokens_total{{{PROC}}}"
                        f"[$__rate_interval])) / sum by ({BY_PROC}, medium) "
                        f"(rate(kvwatch_engine_prefix_cache_queried_tokens_total{{{PROC}}}[$__rate_interval]))",
                        "hits {{medium}} {{pid}}",
                    ),
                    (f"kvwatch_engine_sleeping{{{PROC}}}", "sleeping {{pid}}"),
                ],
                "timeseries",
            ),
            (
                "Engine preemptions /s",
                "short",
                [
                    (
                        f"sum by ({BY_PROC}) (rate(kvwatch_engine_preemptions_total{{{PROC}}}[$__rate_interval]))",
                        "{{engine}} {{pid}}",
                    )
                ],
                "timeseries",
            ),
            (
                "KV offload: engine-reported vs copies seen",
                "Bps",
                [
                    (
                        f"sum by ({BY_PROC}, direction) "
                        f"(rate(kvwatch_engine_kv_offload_bytes_total{{{PROC}}}[$__rate_interval]))",
                        "engine {{direction}} {{pid}}",
                    ),
                    (
                        f'sum by (engine, pod, direction) (rate(kvwatch_cuda_copy_bytes_total{{{PROC},direction=~"d2h|h2d"}}'
                        f"[$__rate_interval]))",
                        "copies {{direction}} {{engine}}",
                    ),
                ],
                "timeseries",
            ),
        ],
    ),
]


def panel(pid: int, x: int, y: int, p: Panel) -> dict[str, Any]:
    title, unit, targets, kind = p
    out: dict[str, Any] = {
        "id": pid,
        "type": kind,
        "title": title,
        "datasource": DS,
        "gridPos": {"h": 8, "w": 12 if kind != "table" else 24, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}},
        "targets": [
            {"datasource": DS, "expr": e, "legendFormat": leg, "refId": chr(ord("A") + i)}
            | ({"instant": True, "format": "table"} if kind == "table" else {})
            for i, (e, leg) in enumerate(targets)
        ],
    }
    return out


def variable(name: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": name,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": name},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y, pid = 0, 1
    for title, row in ROWS:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid += 1
        y += 1
        x = 0
        for p in row:
            w = 24 if p[3] == "table" else 12
            if x + w > 24:
                x, y = 0, y + 8
            panels.append(panel(pid, x, y, p))
            pid += 1
            x += w
        y += 8
    return {
        "uid": "kvwatch",
        "title": "kvwatch: KV cache of LLM inference",
        "description": "Generated by deploy/grafana/generate.py; metric names are kvwatch's public contract.",
        "tags": ["kvwatch", "llm", "inference", "ebpf"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                },
                variable("node", "label_values(kvwatch_build_info, instance)"),
                variable("engine", 'label_values(kvwatch_watched_processes{instance=~"$node"}, engine)'),
                variable("pod", 'label_values(kvwatch_page_free_pages_total{instance=~"$node"}, pod)'),
            ]
        },
        "annotations": {
            "list": [
                {
                    "name": "kvwatch alerts",
                    "datasource": DS,
                    "enable": True,
                    "iconColor": "red",
                    "expr": f'changes(kvwatch_alert_active{{{NODE},engine=~"$engine"}}[1m]) > 0',
                    "step": "30s",
                    "titleFormat": "{{alert}} ({{cause}})",
                    "textFormat": "{{engine}} pid {{pid}} {{pod}} {{tier}}{{probe}} on {{instance}}",
                    "tagKeys": "alert,cause,engine",
                }
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=1) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
