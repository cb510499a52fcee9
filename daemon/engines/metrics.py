"""Engine ``/metrics`` reader: the few numbers detectors join with kvwatch's own evidence.

Parsed with prometheus-client's parser (the engines export with prometheus-client
too). Names per engine (read off vLLM 0.9.2 / 0.11.0 / 0.33.0, SGLang
0.5.23, LMCache 0.5.6 sources); where a release exports an old and a new name for
the same thing, the first one present in each list below is used, never both.

Re-exported on kvwatch's /metrics, as the last scrape read them: the numbers its alerts
join with (KV usage, prefix-cache queries and hits per medium, preemptions, sleep, the
engine's own offload byte counts beside the copy probes'); nothing else of the engine's.
Its latency histograms (``engines/latency.py``) travel in the snapshot for ``kvwatch record``.
"""

from __future__ import annotations

import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import structlog
from kvwatch.daemon.engines import latency
from kvwatch.daemon.engines.tiers import read_tiers, wanted
from kvwatch.daemon.engines.views import EngineSample, ScrapeTarget, TargetState
from prometheus_client.parser import text_string_to_metric_families

log = structlog.get_logger("kvwatch.engine_metrics")

MAX_BODY = 16 << 20

# field -> sample names in order of preference (counters as exposed, with _total)
USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")  # 0..1
PREFIX_QUERIES = (
    "vllm:prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_queries_total",
    "sglang:prompt_tokens_total",
)
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total", "sglang:cached_tokens_total")
PREEMPTIONS = ("vllm:num_preemptions_total", "sglang:num_retracted_requests_total")
GENERATION_TOKENS = ("vllm:generation_tokens_total", "sglang:generation_tokens_total")
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
EVICTED_TOKENS = ("sglang:evicted_tokens_total",)
IDLE_BEFORE_EVICT = "vllm:kv_block_idle_before_evict_seconds"
SLEEP_STATE = "vllm:engine_sleep_state"
CACHE_CONFIG = "vllm:cache_config_info"  # label num_gpu_blocks: the GPU pool, per engine
EXTERNAL_QUERIES = ("vllm:external_prefix_cache_queries_total",)  # tokens asked of a KV connector (CPU tier)
EXTERNAL_HITS = ("vllm:external_prefix_cache_hits_total",)
OFFLOAD_STORE_BYTES = ("vllm:kv_offload_store_bytes_total",)  # OffloadingConnector: GPU -> CPU
OFFLOAD_LOAD_BYTES = ("vllm:kv_offload_load_bytes_total",)  # CPU -> GPU
OFFLOAD_BY_TYPE = "vllm:kv_offload_total_bytes_total"  # the same, by transfer_type (older name, kept in 0.26)
LMCACHE_EVICTED_KEYS = ("lmcache:local_cpu_evict_keys_count_total",)
LMCACHE_HIT_TOKENS = ("lmcache:num_hit_tokens_total",)
LMCACHE_REQUESTED_TOKENS = ("lmcache:num_requested_tokens_total",)


def _keep(labels: Mapping[str, str]) -> bool:
    """SGLang exports one series per tensor-parallel rank; rank 0 speaks for the engine."""
    return labels.get("tp_rank", "0") == "0"


@dataclass(slots=True)
class _Page:
    """What one page holds beyond plain sums and maxima."""

    awake: list[float] = field(default_factory=list)
    buckets: list[tuple[float, float]] = field(default_factory=list)
    idle_count: float | None = None
    by_type: dict[str, float] = field(default_factory=dict)  # offload bytes under the older, labelled name
    pool: float | None = None

    def take(self, name: str, labels: Mapping[str, str], value: float) -> bool:
        """True when the sample is one of these (and taken)."""
        if name == SLEEP_STATE:
            if labels.get("sleep_state") == "awake":
                self.awake.append(value)
        elif name == CACHE_CONFIG:
            blocks = labels.get("num_gpu_blocks", "")
            if blocks.isdigit():
                self.pool = (self.pool or 0.0) + float(blocks)  # one series per data-parallel engine
        elif name == OFFLOAD_BY_TYPE:
            name = {"GPU_to_CPU": OFFLOAD_STORE_BYTES[0], "CPU_to_GPU": OFFLOAD_LOAD_BYTES[0]}.get(
                labels.get("transfer_type", ""), name
            )
            self.by_type[name] = self.by_type.get(name, 0.0) + value
        elif name.startswith(IDLE_BEFORE_EVICT):
            if name.endswith("_bucket"):
                self.buckets.append((float(labels.get("le", "inf")), value))
            elif name.endswith("_count"):
                self.idle_count = (self.idle_count or 0.0) + value
        else:
            return False
        return True


def parse_exposition(text: str, *, at: float, thrash_seconds: float = 10.0) -> EngineSample:
    """Raises ValueError on text that is not the Prometheus exposition format."""
    sums: dict[str, float] = {}
    maxes: dict[str, float] = {}
    page = _Page()
    # every rank and label set: engines/tiers.py and engines/latency.py decide (each skips the other's)
    picked: list[tuple[str, dict[str, str], float]] = []
    families = 0
    for fam in text_string_to_metric_families(text):
        families += 1
        for s in fam.samples:
            if math.isnan(s.value):
                continue
            if wanted(s.name) or latency.wanted(s.name):
                picked.append((s.name, s.labels, s.value))
            if not _keep(s.labels) or page.take(s.name, s.labels, s.value):
                continue
            sums[s.name] = sums.get(s.name, 0.0) + s.value
            maxes[s.name] = max(maxes.get(s.name, -math.inf), s.value)
    awake, buckets, idle_count, by_type = page.awake, page.buckets, page.idle_count, page.by_type

    def first(names: Iterable[str], table: Mapping[str, float]) -> float | None:
        for n in names:
            if n in table:
                return table[n]
        return None

    young: float | None = None
    if idle_count is not None:  # cumulative buckets: the largest edge not above thrash_seconds
        edge = max((le for le, _ in buckets if le <= thrash_seconds), default=None)
        young = sum(v for le, v in buckets if le == edge) if edge is not None else 0.0
    return EngineSample(
        at=at,
        usage=first(USAGE, maxes),
        prefix_queries=first(PREFIX_QUERIES, sums),
        prefix_hits=first(PREFIX_HITS, sums),
        preemptions=first(PREEMPTIONS, sums),
        running=first(RUNNING, sums),
        waiting=first(WAITING, sums),
        sleeping=(min(awake) == 0.0) if awake else None,
        evicted_tokens=first(EVICTED_TOKENS, sums),
        idle_evict_samples=idle_count,
        idle_evict_young=young,
        lmcache_evicted_keys=first(LMCACHE_EVICTED_KEYS, sums),
        lmcache_hit_tokens=first(LMCACHE_HIT_TOKENS, sums),
        lmcache_requested_tokens=first(LMCACHE_REQUESTED_TOKENS, sums),
        external_queries=first(EXTERNAL_QUERIES, sums),
        external_hits=first(EXTERNAL_HITS, sums),
        offload_store_bytes=first(OFFLOAD_STORE_BYTES, {**by_type, **sums}),  # the flat name when both
        offload_load_bytes=first(OFFLOAD_LOAD_BYTES, {**by_type, **sums}),
        generation_tokens=first(GENERATION_TOKENS, sums),
        pool_blocks=page.pool,
        tiers=read_tiers(picked),
        latencies=latency.read_latencies(picked),
        families=families,
    )


def fetch(url: str, timeout: float) -> str:
    req = urllib.request.Request(url, headers={"Accept": "text/plain;version=0.0.4"})  # noqa: S310 - http(s) only
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - scheme checked by the caller
        body: bytes = resp.read(MAX_BODY + 1)
    if len(body) > MAX_BODY:
        raise ValueError(f"body larger than {MAX_BODY} bytes")
    return body.decode("utf-8", errors="replace")


def _reason(err: BaseException) -> str:
    if isinstance(err, urllib.error.HTTPError):
        return f"http_{err.code}"
    if isinstance(err, TimeoutError) or "timed out" in str(err):
        return "timeout"
    if isinstance(err, urllib.error.URLError | ConnectionError | OSError):
        return "connect"
    if isinstance(err, ValueError):
        return "parse"
    return "other"


@dataclass(slots=True)
class _Target:
    """The scraper thread's own, mutable account of a target (``TargetState`` is its copy)."""

    ok: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # reason -> count
    last: EngineSample | None = None
    last_error: str = ""


class EngineScraper:
    """Scrapes every target each ``interval`` seconds on its own thread (a few workers,
    each request bounded by ``timeout``); the agent reads ``states()``."""

    def __init__(
        self,
        *,
        interval: float = 5.0,
        timeout: float = 2.0,
        thrash_seconds: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        fetcher: Callable[[str, float], str] = fetch,
    ) -> None:
        self.interval = interval
        self.timeout = timeout
        self.thrash_seconds = thrash_seconds
        self.clock = clock
        self.fetcher = fetcher
        self._lock = threading.Lock()
        self._states: dict[ScrapeTarget, _Target] = {}
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvwatch-scrape")

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvwatch-engine-metrics", daemon=True)
            self._thread.start()

    def set_targets(self, targets: Iterable[ScrapeTarget]) -> None:
        wanted = set(targets)
        with self._lock:
            new = wanted - self._states.keys()
            for t in list(self._states):
                if t not in wanted:
                    del self._states[t]
            for t in new:
                self._states[t] = _Target()
        if new:
            self._kick.set()  # scrape a new engine at once

    def states(self) -> dict[ScrapeTarget, TargetState]:
        with self._lock:
            return {t: TargetState(t, s.ok, dict(s.failures), s.last, s.last_error) for t, s in self._states.items()}

    def close(self) -> None:
        self._stop.set()
        self._kick.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout + 5)
            self._thread = None
        self._pool.shutdown(wait=False, cancel_futures=True)

    def scrape_once(self) -> None:
        with self._lock:
            targets = list(self._states)
        results = list(self._pool.map(self._scrape, targets))
        with self._lock:
            for target, (sample, err) in zip(targets, results, strict=True):
                st = self._states.get(target)
                if st is None:
                    continue
                if sample is not None:
                    st.ok += 1
                    st.last = sample
                    st.last_error = ""
                elif err is not None:
                    reason = _reason(err)
                    if not st.failures:
                        log.warning("engine metrics scrape failed", url=target.url, reason=reason, error=str(err))
                    st.failures[reason] = st.failures.get(reason, 0) + 1
                    st.last_error = f"{reason}: {err}"

    def _scrape(self, target: ScrapeTarget) -> tuple[EngineSample | None, BaseException | None]:
        try:
            text = self.fetcher(target.url, self.timeout)
            return parse_exposition(text, at=self.clock(), thrash_seconds=self.thrash_seconds), None
        except Exception as err:  # any failure of a peer is a counted scrape failure
            return None, err

    def _run(self) -> None:
        while not self._stop.is_set():
            self._kick.clear()
            try:
                self.scrape_once()
            except Exception as err:
                log.warning("engine metrics round failed", error=str(err))
            self._kick.wait(self.interval)
