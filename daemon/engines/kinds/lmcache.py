"""LMCache: in a vLLM process (its numbers on vLLM's /metrics, its disk tier in that process's
environment) or as its own server.

* Processes: ``lmcache_server`` / ``python -m lmcache...server``.
* /metrics: names read off LMCache 0.5.6, in process and its multiprocess server (L1 is host
  memory, L2 a store it names by adapter; its transfer bytes are counted per phase, staging
  through host memory and the kernel's, the staging phase being the tier's own traffic); its
  retrieve and store times.
* Disk KV tier: ``LMCACHE_LOCAL_DISK`` or ``local_disk`` in the file ``LMCACHE_CONFIG_FILE``
  names: one path or several, comma-separated, each with or without ``file://``; normalised
  (``/x/`` and ``/x`` name one tier).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping

from kvwatch.daemon.config import EngineRule
from kvwatch.daemon.engines.kind import PY_M, SCRIPT, EngineKind, LatencyRule, SampleNames, TierRule

DISK_ENV, CONFIG_ENV = "LMCACHE_LOCAL_DISK", "LMCACHE_CONFIG_FILE"
_DISK_KEY = re.compile(r"^[ \t]*local_disk[ \t]*:[ \t]*([^#\n]*)", re.MULTILINE)
_OFF = ("", "none", "null", "false", "~")
EVICTED_KEYS = "lmcache:local_cpu_evict_keys_count_total"
REQUESTED, HIT = "lmcache:num_requested_tokens_total", "lmcache:num_hit_tokens_total"
PHASE_BYTES = "lmcache_mp_transfer_phase_bytes_total"
D2H, H2D = (("direction", "d2h"), ("phase", "staging")), (("direction", "h2d"), ("phase", "staging"))


def lmcache_dirs(env: Mapping[str, str], _cmdline: str, read_file: Callable[[str], str | None]) -> list[str]:
    """LMCache local-disk directories from ``LMCACHE_LOCAL_DISK`` or its YAML config file."""
    value = env.get(DISK_ENV, "")
    if not value and env.get(CONFIG_ENV):
        text = read_file(env[CONFIG_ENV])
        if text:
            m = _DISK_KEY.search(text)
            value = m.group(1) if m else ""
    out: list[str] = []
    for part in value.strip().strip("\"'").split(","):
        path = part.strip().strip("\"'").removeprefix("file://")
        if path.lower() not in _OFF and os.path.normpath(path) not in out:
            out.append(os.path.normpath(path))
    return out


def _mp(tier: str, quantity: str, unit: str, name: str, match: tuple[tuple[str, str], ...] = ()) -> TierRule:
    return TierRule("lmcache_mp", tier, quantity, unit, name, match=match)


KIND = EngineKind(
    name="lmcache",
    rules=(EngineRule(engine="lmcache", cmdline=SCRIPT + r"lmcache_server\b|" + PY_M + r"lmcache[\w.]*\.server\b"),),
    environ=(DISK_ENV, CONFIG_ENV),
    samples=SampleNames(
        lmcache_evicted_keys=(EVICTED_KEYS,), lmcache_hit_tokens=(HIT,), lmcache_requested_tokens=(REQUESTED,)
    ),
    tiers=(
        # in process
        TierRule("lmcache", "remote", "stored", "bytes", "lmcache:num_remote_write_bytes_total"),
        TierRule("lmcache", "remote", "loaded", "bytes", "lmcache:num_remote_read_bytes_total"),
        TierRule("lmcache", "cpu", "evicted", "chunks", EVICTED_KEYS),
        TierRule("lmcache", "cpu", "used", "bytes", "lmcache:local_cache_usage"),
        TierRule("lmcache", "disk", "used", "bytes", "lmcache:local_storage_usage"),
        TierRule("lmcache", "all", "queried", "tokens", REQUESTED),
        TierRule("lmcache", "all", "hit", "tokens", HIT),
        # the multiprocess server
        _mp("cpu", "stored", "bytes", PHASE_BYTES, match=D2H),
        _mp("cpu", "loaded", "bytes", PHASE_BYTES, match=H2D),
        _mp("cpu", "stored", "chunks", "lmcache_mp_l1_write_chunks_total"),
        _mp("cpu", "loaded", "chunks", "lmcache_mp_l1_read_chunks_total"),
        _mp("cpu", "evicted", "chunks", "lmcache_mp_l1_evicted_chunks_total"),
        _mp("cpu", "usage", "ratio", "lmcache_mp_l1_usage_ratio"),
        _mp("cpu", "used", "bytes", "lmcache_mp_l1_memory_usage_bytes"),
        _mp("cpu", "queried", "tokens", "lmcache_mp_lookup_requested_tokens_total"),
        _mp("cpu", "hit", "tokens", "lmcache_mp_lookup_hit_l1_tokens_total"),
        _mp("storage", "stored", "chunks", "lmcache_mp_l2_store_completed_objects_chunks_total"),
        _mp("storage", "loaded", "chunks", "lmcache_mp_l2_prefetch_load_completed_chunks_total"),
        _mp("storage", "evicted", "chunks", "lmcache_mp_l2_evicted_objects_chunks_total"),
        _mp("storage", "used", "bytes", "lmcache_mp_l2_usage_bytes"),
        _mp("storage", "queried", "tokens", "lmcache_mp_lookup_requested_tokens_total"),
        _mp("storage", "hit", "tokens", "lmcache_mp_lookup_hit_l2_tokens_total"),
    ),
    latencies=(
        LatencyRule("lmcache_retrieve", "lmcache:time_to_retrieve"),
        LatencyRule("lmcache_store", "lmcache:time_to_store"),
    ),
    kv_tier=("lmcache", lmcache_dirs),
)
