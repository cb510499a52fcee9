"""vLLM: its processes, its command line, its /metrics and its connectors' tiers.

* Processes: ``vllm serve`` / ``python -m vllm.entrypoints...`` (the API server) and the
  ``VLLM::*`` titles of its engine cores, workers and DP coordinator; a disaggregated role from
  ``--kv-transfer-config``'s ``kv_role``.
* Command line (the API server, and any watched process carrying ``--kv-events-config``: a wrapper
  that launches vLLM with vLLM's own argument parser): ``--kv-events-config`` (JSON, or the
  dotted ``--kv-events-config.endpoint X`` form) with publisher zmq → one stream per local
  data-parallel rank on endpoint port + rank (the global rank: ``--data-parallel-start-rank`` ..
  + ``--data-parallel-size-local``, or the single ``--data-parallel-rank``); ``--host``/``--port``
  (default 8000) → ``/metrics``.
* /metrics: names read off vLLM 0.9.2 / 0.11.0 / 0.26.0 / 0.33.0; the OffloadingConnector's CPU
  tier (the labelled ``kv_offload_total_bytes`` is the older name of the same numbers, kept in
  0.26); its latency histograms, and the NixlConnector's (decode side, one per KV transfer).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvwatch.daemon.config import EngineRule, EnginesConfig
from kvwatch.daemon.engines.kind import PY_M, SCRIPT, EngineKind, LatencyRule, SampleNames, TierRule
from kvwatch.daemon.engines.planning import (
    MAX_DATA_PARALLEL_RANKS,
    Planning,
    first_flag,
    is_number,
    offset_port,
    rank_flag,
)
from kvwatch.daemon.model.engines import EnginePlan, StreamSpec

KV_EVENTS_DEFAULT = "tcp://*:5557"
PORT = 8000

# /metrics beyond the plain fields (exposition.py reads these by what they are)
IDLE_BEFORE_EVICT = "vllm:kv_block_idle_before_evict_seconds"  # histogram: idle time of evicted blocks
SLEEP_STATE = "vllm:engine_sleep_state"  # label sleep_state
CACHE_CONFIG = "vllm:cache_config_info"  # label num_gpu_blocks: the GPU pool, per engine
OFFLOAD_STORE, OFFLOAD_LOAD = "vllm:kv_offload_store_bytes_total", "vllm:kv_offload_load_bytes_total"
OFFLOAD_BY_TYPE = "vllm:kv_offload_total_bytes_total"  # the same, by transfer_type (older name, kept in 0.26)
GPU_TO_CPU, CPU_TO_GPU = (("transfer_type", "GPU_to_CPU"),), (("transfer_type", "CPU_to_GPU"),)  # its labels
OFFLOADING = (OFFLOAD_STORE, OFFLOAD_BY_TYPE)  # vLLM's KV connector is the OffloadingConnector (CPU tier)
EXTERNAL_QUERIES, EXTERNAL_HITS = "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total"


def kv_events(flags: Mapping[str, str]) -> tuple[dict[str, Any] | None, str]:
    """vLLM's KVEventsConfig from the command line → (config, problem)."""
    cfg: dict[str, Any] = {}
    raw = flags.get("--kv-events-config")
    if raw is not None:
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError as err:
            return None, f"--kv-events-config is not JSON: {err}"
        if not isinstance(parsed, dict):
            return None, "--kv-events-config is not a JSON object"
        cfg.update(parsed)
    for name, value in flags.items():
        if name.startswith("--kv-events-config."):
            key = name.split(".", 1)[1].replace("-", "_")
            cfg[key] = json.loads(value) if value in ("true", "false", "null") or is_number(value) else value
    if not cfg:
        return None, ""
    enabled = cfg.get("enable_kv_cache_events") in (True, "true", "True", 1)
    publisher = cfg.get("publisher") or ("zmq" if enabled else "null")
    if not enabled or publisher != "zmq":
        return None, ""
    return cfg, ""


def rank_span(flags: Mapping[str, str]) -> range:
    """The global DP ranks whose engines run under this API server, as the command line asks."""
    explicit = first_flag(flags, "--data-parallel-rank", "-dpn")
    if explicit is not None:
        rank = rank_flag(explicit, 0)
        return range(rank, rank + 1)
    size = rank_flag(first_flag(flags, "--data-parallel-size", "-dp"), 1)
    local = rank_flag(first_flag(flags, "--data-parallel-size-local", "-dpl"), size)
    start = rank_flag(first_flag(flags, "--data-parallel-start-rank", "-dpr"), 0)
    if "--headless" not in flags and start == 0 and local == size:
        return range(size)
    return range(start, start + local)


def data_parallel_ranks(flags: Mapping[str, str]) -> list[int]:
    """Those ranks, the first MAX_DATA_PARALLEL_RANKS of them."""
    return list(rank_span(flags)[:MAX_DATA_PARALLEL_RANKS])


def _streams(flags: Mapping[str, str], kv: Mapping[str, Any], cfg: EnginesConfig, p: Planning) -> list[StreamSpec]:
    endpoint = str(kv.get("endpoint") or KV_EVENTS_DEFAULT)
    replay = kv.get("replay_endpoint") if cfg.kv_events_replay else None
    topic = str(kv.get("topic") or "")
    span = rank_span(flags)
    if len(span) > MAX_DATA_PARALLEL_RANKS:
        first = MAX_DATA_PARALLEL_RANKS
        p.note(f"{len(span)} data-parallel ranks asked for: KV event streams of the first {first} only")
        p.note("", "kv_event_streams", len(span) - first)
    streams: list[StreamSpec] = []
    for rank in span[:MAX_DATA_PARALLEL_RANKS]:
        addr = p.connect(offset_port(endpoint, rank))
        if addr is None:
            continue
        raddr = p.connect(offset_port(str(replay), rank)) if replay else None
        streams.append(StreamSpec(addr, raddr, topic, rank, p.key))
    return streams


def plan(p: Planning, flags: Mapping[str, str], cfg: EnginesConfig) -> EnginePlan:
    """The API server's taps: its KV event streams and its /metrics."""
    kv, problem = kv_events(flags)
    p.note(problem)
    streams = _streams(flags, kv, cfg, p) if kv is not None and cfg.kv_events else []
    url = None
    if cfg.metrics and "--uds" not in flags:
        scheme = "https" if "--ssl-keyfile" in flags else "http"
        url = p.metrics_url(scheme, flags.get("--host"), flags.get("--port"), PORT)
    return p.plan(streams, url)


def carries_kv_events(flags: Mapping[str, str]) -> bool:
    return any(f == "--kv-events-config" or f.startswith("--kv-events-config.") for f in flags)


def wrapper_plan(p: Planning, flags: Mapping[str, str], cfg: EnginesConfig) -> EnginePlan | None:
    """A process launching vLLM with vLLM's own argument parser: planned as the API server."""
    return plan(p, flags, cfg) if carries_kv_events(flags) else None


KIND = EngineKind(
    name="vllm",
    rules=(
        EngineRule(engine="vllm", comm=r"^VLLM::"),
        EngineRule(engine="vllm", cmdline=r"^VLLM::"),
        EngineRule(engine="vllm", cmdline=SCRIPT + r"vllm\s+serve\b|" + PY_M + r"vllm(\.entrypoints\S*)?(\s|$)"),
    ),
    components=(
        (r"VLLM::APIServer", "api_server"),
        (r"VLLM::EngineCore", "engine_core"),
        (r"VLLM::Worker", "worker"),
        (r"VLLM::DPCoordinator", "dp_coordinator"),
    ),
    late_components=((r"\bvllm\s+serve\b|vllm\.entrypoints", "api_server"),),
    roles=(
        (
            r"""["']?kv_role["']?\s*[:=]\s*["']?(kv_producer|kv_consumer|kv_both)""",
            {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"},
        ),
    ),
    environ=("VLLM_PROCESS_NAME_PREFIX",),
    plans={"api_server": plan},
    any_process_plan=wrapper_plan,
    samples=SampleNames(
        usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        prefix_queries=("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        prefix_hits=("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        preemptions=("vllm:num_preemptions_total",),
        generation_tokens=("vllm:generation_tokens_total",),
        running=("vllm:num_requests_running",),
        waiting=("vllm:num_requests_waiting",),
        external_queries=(EXTERNAL_QUERIES,),  # tokens asked of a KV connector (CPU tier)
        external_hits=(EXTERNAL_HITS,),
        offload_store_bytes=(OFFLOAD_STORE,),  # OffloadingConnector: GPU -> CPU
        offload_load_bytes=(OFFLOAD_LOAD,),  # CPU -> GPU
    ),
    tiers=(
        TierRule("vllm", "cpu", "stored", "bytes", OFFLOAD_STORE),
        TierRule("vllm", "cpu", "stored", "bytes", OFFLOAD_BY_TYPE, match=GPU_TO_CPU, unless=(OFFLOAD_STORE,)),
        TierRule("vllm", "cpu", "loaded", "bytes", OFFLOAD_LOAD),
        TierRule("vllm", "cpu", "loaded", "bytes", OFFLOAD_BY_TYPE, match=CPU_TO_GPU, unless=(OFFLOAD_LOAD,)),
        TierRule("vllm", "cpu", "queried", "tokens", EXTERNAL_QUERIES, when=OFFLOADING),
        TierRule("vllm", "cpu", "hit", "tokens", EXTERNAL_HITS, when=OFFLOADING),
        TierRule("vllm", "external", "queried", "tokens", EXTERNAL_QUERIES, unless=OFFLOADING),
        TierRule("vllm", "external", "hit", "tokens", EXTERNAL_HITS, unless=OFFLOADING),
    ),
    latencies=(
        LatencyRule("ttft", "vllm:time_to_first_token_seconds"),
        LatencyRule("e2e", "vllm:e2e_request_latency_seconds"),
        LatencyRule("nixl_xfer", "vllm:nixl_xfer_time_seconds"),  # the NixlConnector, decode side
        LatencyRule("nixl_post", "vllm:nixl_post_time_seconds"),
    ),
)
