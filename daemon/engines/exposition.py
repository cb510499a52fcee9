"""An engine's ``/metrics`` page read into an ``EngineSample``: the few numbers detectors join
with kvwatch's own evidence.

Parsed with prometheus-client's parser (the engines export with prometheus-client too). Names
per engine are in its module (``kinds/``, read off the engines' sources); where a release
exports an old and a new name for the same thing, the first one present in each list below is
used, never both. Its latency histograms (``engines/latency.py``) and KV tier counters
(``engines/tiers.py``) are read from the same samples.

The page is the engine's, and the engine may be hostile. Every sample kvwatch reads must be a
count or a level: finite, not negative, at most ``MAX_VALUE``; a ratio at most 1; a histogram's
bucket bound and vLLM's block count numbers. A sample that is not is dropped alone and counted by
reason (``REJECT_REASONS``); the rest of the page counts. Samples kvwatch does not read are not
looked at. A page the parser cannot read fails whole with a ``PageError`` that names the line and
the kind of error, never the text (a page may carry credentials in a label); a page still being
read at the scrape's deadline stops with ``DeadlineExceeded``.
"""

from __future__ import annotations

import io
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TextIO, cast

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_fd_to_metric_families

from kvwatch.daemon.engines import latency, tiers
from kvwatch.daemon.engines.kind import SampleNames
from kvwatch.daemon.engines.kinds import KINDS, vllm
from kvwatch.daemon.model.engines import EngineSample, TierReading


def _names(get: Callable[[SampleNames], tuple[str, ...]]) -> tuple[str, ...]:
    """Every engine's sample names of one field, in KINDS' order (each in its own preference)."""
    return tuple(n for k in KINDS for n in get(k.samples))


# field -> sample names in order of preference; declared by each engine's module (kinds/)
USAGE = _names(lambda x: x.usage)  # 0..1
PREFIX_QUERIES = _names(lambda x: x.prefix_queries)
PREFIX_HITS = _names(lambda x: x.prefix_hits)
PREEMPTIONS = _names(lambda x: x.preemptions)
GENERATION_TOKENS = _names(lambda x: x.generation_tokens)
RUNNING = _names(lambda x: x.running)
WAITING = _names(lambda x: x.waiting)
EVICTED_TOKENS = _names(lambda x: x.evicted_tokens)
EXTERNAL_QUERIES = _names(lambda x: x.external_queries)
EXTERNAL_HITS = _names(lambda x: x.external_hits)
OFFLOAD_STORE_BYTES = _names(lambda x: x.offload_store_bytes)
OFFLOAD_LOAD_BYTES = _names(lambda x: x.offload_load_bytes)
LMCACHE_EVICTED_KEYS = _names(lambda x: x.lmcache_evicted_keys)
LMCACHE_HIT_TOKENS = _names(lambda x: x.lmcache_hit_tokens)
LMCACHE_REQUESTED_TOKENS = _names(lambda x: x.lmcache_requested_tokens)
# vLLM's samples read beyond plain sums and maxima (``_Page``)
IDLE_BEFORE_EVICT, SLEEP_STATE, CACHE_CONFIG = vllm.IDLE_BEFORE_EVICT, vllm.SLEEP_STATE, vllm.CACHE_CONFIG
OFFLOAD_BY_TYPE = vllm.OFFLOAD_BY_TYPE

PLAIN = frozenset(
    (
        *USAGE,
        *PREFIX_QUERIES,
        *PREFIX_HITS,
        *PREEMPTIONS,
        *GENERATION_TOKENS,
        *RUNNING,
        *WAITING,
        *EVICTED_TOKENS,
        *EXTERNAL_QUERIES,
        *EXTERNAL_HITS,
        *OFFLOAD_STORE_BYTES,
        *OFFLOAD_LOAD_BYTES,
        *LMCACHE_EVICTED_KEYS,
        *LMCACHE_HIT_TOKENS,
        *LMCACHE_REQUESTED_TOKENS,
    )
)
IDLE_BUCKET, IDLE_COUNT = f"{IDLE_BEFORE_EVICT}_bucket", f"{IDLE_BEFORE_EVICT}_count"
SPECIAL = frozenset((SLEEP_STATE, CACHE_CONFIG, OFFLOAD_BY_TYPE, IDLE_BUCKET, IDLE_COUNT))
# gauges that are shares of a whole (a tier rule with ``over`` divides two counts: checked once divided)
RATIOS = frozenset((*USAGE, *(r.name for r in tiers.RULES if r.unit == "ratio" and not r.over)))

# Above this a count is no count (2^63: int64, what the engines' own exporters count in). It
# also keeps every sum over a page's samples finite.
MAX_VALUE = float(2**63)
REJECT_REASONS = ("nan", "infinite", "negative", "too_large", "above_one", "bad_label")
CHECK_EVERY_LINES = 2048  # how often the parse looks at the deadline
_BLOCK_COUNT = re.compile(r"[0-9]{1,18}")

# the parser's error messages begin with one of these, then quote the line: only the kind is kept
_PARSE_KINDS = (
    ("invalid metric name", "metric_name"),
    ("metric name specified more than once", "metric_name"),
    ("unquoted utf-8 metric name", "metric_name"),
    ("invalid labels", "labels"),
    ("leading comma", "labels"),
    ("empty term", "labels"),
    ("multiple commas", "labels"),
    ("unexpected text after quote", "labels"),
    ("invalid line, duplicate label name", "labels"),
    ("missing close quote", "quote"),
    ("invalid value", "value"),
    ("could not convert string to float", "value"),
)


class PageError(ValueError):
    """A page the parser cannot read: where, and what kind of error (never the line's text)."""

    def __init__(self, line: int, kind: str) -> None:
        super().__init__(f"line {line}: {kind}")
        self.line = line
        self.kind = kind


class DeadlineExceeded(TimeoutError):
    """The scrape's time ran out (connecting, waiting for the engine, or reading its page)."""


def reads(name: str) -> bool:
    """Whether kvwatch reads this sample (and so checks it)."""
    return name in PLAIN or name in SPECIAL or tiers.wanted(name) or latency.wanted(name)


def reject_reason(name: str, value: float) -> str | None:
    """Why a sample kvwatch reads cannot count, or None when it can."""
    try:
        v = float(value)  # the parser keeps integers as ints, of any size
    except OverflowError:
        return "too_large"
    checks = (
        (math.isnan(v), "nan"),
        (math.isinf(v), "infinite"),
        (v < 0, "negative"),
        (v > MAX_VALUE, "too_large"),
        (v > 1 and name in RATIOS, "above_one"),
    )
    return next((reason for bad, reason in checks if bad), None)


def _keep(labels: Mapping[str, str]) -> bool:
    """SGLang exports one series per tensor-parallel rank; rank 0 speaks for the engine."""
    return labels.get("tp_rank", "0") == "0"


def _bucket_bound(labels: Mapping[str, str]) -> float | None:
    try:
        le = float(labels["le"])
    except (KeyError, ValueError):
        return None
    return None if math.isnan(le) else le


@dataclass(slots=True)
class _Page:
    """What one page holds beyond plain sums and maxima, and what it held that cannot count."""

    awake: list[float] = field(default_factory=list)
    buckets: list[tuple[float, float]] = field(default_factory=list)
    idle_count: float | None = None
    by_type: dict[str, float] = field(default_factory=dict)  # offload bytes under the older, labelled name
    pool: float | None = None
    rejected: dict[str, int] = field(default_factory=dict)

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def take(self, name: str, labels: Mapping[str, str], value: float) -> bool:
        """True when the sample is one of these (taken, or rejected for a label)."""
        if name == SLEEP_STATE:
            if labels.get("sleep_state") == "awake":
                self.awake.append(value)
        elif name == CACHE_CONFIG:
            blocks = labels.get("num_gpu_blocks")
            if blocks is not None and _BLOCK_COUNT.fullmatch(blocks):
                self.pool = (self.pool or 0.0) + float(blocks)  # one series per data-parallel engine
            elif blocks is not None:
                self.reject("bad_label")
        elif name == OFFLOAD_BY_TYPE:
            name = {"GPU_to_CPU": vllm.OFFLOAD_STORE, "CPU_to_GPU": vllm.OFFLOAD_LOAD}.get(
                labels.get("transfer_type", ""), name
            )
            self.by_type[name] = self.by_type.get(name, 0.0) + value
        elif name == IDLE_BUCKET:
            le = _bucket_bound(labels)
            if le is None:
                self.reject("bad_label")
            else:
                self.buckets.append((le, value))
        elif name == IDLE_COUNT:
            self.idle_count = (self.idle_count or 0.0) + value
        else:
            return False
        return True

    def young(self, thrash_seconds: float) -> float | None:
        """Idle-before-evict samples under thrash_seconds: the largest bucket bound not above it
        (buckets are cumulative)."""
        if self.idle_count is None:
            return None
        edge = max((le for le, _ in self.buckets if le <= thrash_seconds), default=None)
        return sum(v for le, v in self.buckets if le == edge) if edge is not None else 0.0


class _Lines:
    """The page's lines for the parser: numbered (an error names its line, the last one handed
    out), and the deadline looked at every ``CHECK_EVERY_LINES``."""

    def __init__(self, text: str, deadline: float, clock: Callable[[], float]) -> None:
        self._lines = iter(io.StringIO(text))  # split as the parser itself splits: on "\n" only
        self._deadline = deadline
        self._clock = clock
        self.number = 0

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        line = next(self._lines)
        self.number += 1
        if self.number % CHECK_EVERY_LINES == 0 and self._clock() > self._deadline:
            raise DeadlineExceeded(f"page still being read at line {self.number}")
        return line


def _parse_kind(err: BaseException) -> str:
    text = str(err).lower() if isinstance(err, ValueError) else ""
    for prefix, kind in _PARSE_KINDS:
        if text.startswith(prefix):
            return kind
    return "syntax"


def families(text: str, deadline: float = math.inf, clock: Callable[[], float] = time.monotonic) -> Iterator[Metric]:
    """The page's metric families; raises PageError where the parser cannot read it."""
    lines = _Lines(text, deadline, clock)
    parsed = iter(text_fd_to_metric_families(cast(TextIO, lines)))
    while True:
        try:
            fam = next(parsed)
        except StopIteration:
            return
        except DeadlineExceeded:
            raise
        except Exception as err:  # the parser's own errors quote the line: kept out of the chain
            raise PageError(lines.number, _parse_kind(err)) from None
        yield fam


def parse_exposition(
    text: str,
    *,
    at: float,
    thrash_seconds: float = 10.0,
    deadline: float = math.inf,
    clock: Callable[[], float] = time.monotonic,
) -> EngineSample:
    """One page read into a sample. Raises PageError (a ValueError) on text that is not the
    Prometheus exposition format, DeadlineExceeded when ``clock`` passes ``deadline`` first."""
    sums: dict[str, float] = {}
    maxes: dict[str, float] = {}
    page = _Page()
    # every rank and label set: engines/tiers.py and engines/latency.py decide (each skips the other's)
    picked: list[tuple[str, dict[str, str], float]] = []
    count = 0
    for fam in families(text, deadline, clock):
        count += 1
        for s in fam.samples:
            if not reads(s.name):
                continue
            reason = reject_reason(s.name, s.value)
            if reason is not None:
                page.reject(reason)
                continue
            value = float(s.value)
            if tiers.wanted(s.name) or latency.wanted(s.name):
                picked.append((s.name, s.labels, value))
            if not _keep(s.labels) or page.take(s.name, s.labels, value):
                continue
            sums[s.name] = sums.get(s.name, 0.0) + value
            maxes[s.name] = max(maxes.get(s.name, 0.0), value)
    return _sample(at, page, sums=sums, maxes=maxes, picked=picked, count=count, thrash_seconds=thrash_seconds)


def _first(names: Iterable[str], table: Mapping[str, float]) -> float | None:
    for n in names:
        if n in table:
            return table[n]
    return None


def _tiers(page: _Page, picked: list[tuple[str, dict[str, str], float]]) -> tuple[TierReading, ...]:
    """The tier readings, a ratio of two counts above 1 rejected like a ratio sample."""
    out = []
    for r in tiers.read_tiers(picked):
        if r.unit == "ratio" and r.value > 1:
            page.reject("above_one")
        else:
            out.append(r)
    return tuple(out)


def _sample(
    at: float,
    page: _Page,
    *,
    sums: Mapping[str, float],
    maxes: Mapping[str, float],
    picked: list[tuple[str, dict[str, str], float]],
    count: int,
    thrash_seconds: float,
) -> EngineSample:
    offload = {**page.by_type, **sums}  # the flat name when both
    readings = _tiers(page, picked)
    return EngineSample(
        at=at,
        usage=_first(USAGE, maxes),
        prefix_queries=_first(PREFIX_QUERIES, sums),
        prefix_hits=_first(PREFIX_HITS, sums),
        preemptions=_first(PREEMPTIONS, sums),
        running=_first(RUNNING, sums),
        waiting=_first(WAITING, sums),
        sleeping=(min(page.awake) == 0.0) if page.awake else None,
        evicted_tokens=_first(EVICTED_TOKENS, sums),
        idle_evict_samples=page.idle_count,
        idle_evict_young=page.young(thrash_seconds),
        lmcache_evicted_keys=_first(LMCACHE_EVICTED_KEYS, sums),
        lmcache_hit_tokens=_first(LMCACHE_HIT_TOKENS, sums),
        lmcache_requested_tokens=_first(LMCACHE_REQUESTED_TOKENS, sums),
        external_queries=_first(EXTERNAL_QUERIES, sums),
        external_hits=_first(EXTERNAL_HITS, sums),
        offload_store_bytes=_first(OFFLOAD_STORE_BYTES, offload),
        offload_load_bytes=_first(OFFLOAD_LOAD_BYTES, offload),
        generation_tokens=_first(GENERATION_TOKENS, sums),
        pool_blocks=page.pool,
        tiers=readings,
        latencies=latency.read_latencies(picked),
        families=count,
        rejected=page.rejected,
    )
