"""SGLang: its processes, its command line, its /metrics, its HiCache tiers.

* Processes: ``sglang serve`` / ``python -m sglang.launch_server`` (the server) and the
  ``sglang::*`` titles of its scheduler, detokenizer and tokenizer; a disaggregated role from
  ``--disaggregation-mode``.
* Command line (the server): ``--enable-metrics`` with ``--host`` (default 127.0.0.1) /
  ``--port`` (default 30000) → ``/metrics``.
* /metrics: names read off SGLang 0.5.23 (one series per tensor-parallel rank: rank 0 speaks
  for the engine); HiCache's host pool (``cpu``) and L3 (``storage``): each rank backs up and
  loads its own shard's bytes, token counts and the host pool's size are the same on every rank.
* Disk KV tier: HiCache's file backend (``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``, else
  /tmp/hicache when ``--hicache-storage-backend file``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from kvwatch.daemon.config import EngineRule, EnginesConfig
from kvwatch.daemon.engines.kind import PY_M, RANK0, SCRIPT, EngineKind, LatencyRule, SampleNames, TierRule
from kvwatch.daemon.engines.planning import Planning
from kvwatch.daemon.model.engines import EnginePlan

PORT = 30000
HICACHE_DEFAULT_DIR = "/tmp/hicache"
HICACHE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
_HICACHE_FILE = re.compile(r"--hicache-storage-backend[=\s]+file\b")
PROMPT, CACHED = "sglang:prompt_tokens_total", "sglang:cached_tokens_total"
HOST_TOTAL, BACKED_UP = "sglang:hicache_host_total_tokens", "sglang:backuped_tokens_total"


def plan(p: Planning, flags: Mapping[str, str], cfg: EnginesConfig) -> EnginePlan:
    """The server's taps: its /metrics, when it serves them."""
    url = None
    if cfg.metrics and flags.get("--enable-metrics") == "true":
        url = p.metrics_url("http", flags.get("--host", "127.0.0.1"), flags.get("--port"), PORT)
    return p.plan((), url)


def hicache_dirs(env: Mapping[str, str], cmdline: str, _read: Callable[[str], str | None]) -> list[str]:
    if env.get(HICACHE_DIR_ENV):
        return [env[HICACHE_DIR_ENV]]
    if _HICACHE_FILE.search(cmdline):
        return [HICACHE_DEFAULT_DIR]
    return []


KIND = EngineKind(
    name="sglang",
    rules=(
        EngineRule(engine="sglang", comm=r"^sglang::"),
        EngineRule(engine="sglang", cmdline=r"^sglang::"),
        EngineRule(engine="sglang", cmdline=SCRIPT + r"sglang\s+serve\b|" + PY_M + r"sglang\.launch_server\b"),
    ),
    components=(
        (r"sglang::scheduler", "scheduler"),
        (r"sglang::detokenizer", "detokenizer"),
        (r"sglang::(tokenizer|http)", "tokenizer"),
    ),
    late_components=((r"sglang\.launch_server|sglang\s+serve", "server"),),
    roles=((r"--disaggregation-mode[=\s]+(prefill|decode)\b", {"prefill": "prefill", "decode": "decode"}),),
    environ=(HICACHE_DIR_ENV,),
    plans={"server": plan},
    samples=SampleNames(
        usage=("sglang:token_usage",),
        prefix_queries=(PROMPT,),
        prefix_hits=(CACHED,),
        preemptions=("sglang:num_retracted_requests_total",),
        generation_tokens=("sglang:generation_tokens_total",),
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
        evicted_tokens=("sglang:evicted_tokens_total",),
    ),
    tiers=(
        TierRule("sglang", "cpu", "stored", "bytes", "sglang:hicache_backup_bytes_total"),
        TierRule("sglang", "cpu", "loaded", "bytes", "sglang:load_back_bytes_total"),
        TierRule("sglang", "cpu", "usage", "ratio", "sglang:hicache_host_used_tokens", ranks=RANK0, over=HOST_TOTAL),
        TierRule("sglang", "cpu", "queried", "tokens", PROMPT, ranks=RANK0, when=(HOST_TOTAL,)),
        TierRule(
            "sglang", "cpu", "hit", "tokens", CACHED, match=(("cache_source", "host"),), ranks=RANK0, when=(HOST_TOTAL,)
        ),
        TierRule("sglang", "storage", "stored", "tokens", BACKED_UP, ranks=RANK0),
        TierRule("sglang", "storage", "loaded", "tokens", "sglang:prefetched_tokens_total", ranks=RANK0),
        TierRule("sglang", "storage", "queried", "tokens", PROMPT, ranks=RANK0, when=(BACKED_UP,)),
        TierRule(
            "sglang",
            "storage",
            "hit",
            "tokens",
            CACHED,
            match=(("cache_source", "storage"),),
            ranks=RANK0,
            when=(BACKED_UP,),
        ),
    ),
    latencies=(
        LatencyRule("ttft", "sglang:time_to_first_token_seconds"),
        LatencyRule("e2e", "sglang:e2e_request_latency_seconds"),
    ),
    kv_tier=("hicache", hicache_dirs),
)
