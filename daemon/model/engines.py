"""What the engine taps know, as plain records: the loop's snapshot and the exporters read
these, never the subscriber, scraper or planner that fill them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """One KV event stream: where to connect, and whose it is."""

    endpoint: str  # a connect address: tcp://127.0.0.1:5557
    replay: str | None = None
    topic: str = ""
    dp_rank: int = 0
    owner: str = ""  # the watched process's key


# Upper bounds (seconds) of the histogram of time from a block's removal to its store again.
REGRET_BUCKETS = (1.0, 5.0, 15.0, 60.0, 300.0, 1800.0)


@dataclass(frozen=True, slots=True)
class MediumTotals:
    stored: int = 0
    removed: int = 0
    removed_young: int = 0  # removed within thrash_seconds of being stored
    regretted: int = 0  # stored again after a removal the stream still remembered
    restored: int = 0  # stored again while still resident (remembered)
    cleared: int = 0  # resident when an AllBlocksCleared dropped them
    dropped: int = 0  # removed (GPU) without a lower tier of the stream ever holding them
    resident: int = 0  # held now, as far as the store-time memory knows
    regret_tokens: int = 0  # block_size x each of those blocks: the recomputation implied
    regret_seconds: float = 0.0  # summed time from removal to the store again
    regret_buckets: tuple[int, ...] = (0,) * (len(REGRET_BUCKETS) + 1)  # per bucket, the last +Inf
    stores_forgotten: int = 0  # store times dropped from a full memory (young removals missed)
    removals_forgotten: int = 0  # removals dropped from a full memory (regrets missed)
    announced: int = 0  # held blocks announced again as a request's prefix: prefix hits ("full" report mode)
    announced_tokens: int = 0  # block_size x each of those: the hit tokens they stand for

    def __add__(self, o: MediumTotals) -> MediumTotals:
        return MediumTotals(*(_combine(a, b, 1) for a, b in zip(_fields(self), _fields(o), strict=True)))

    def __sub__(self, o: MediumTotals) -> MediumTotals:
        """Counters since ``o`` (an earlier reading of the same blocks); ``resident`` stays ours."""
        out = MediumTotals(*(_combine(a, b, -1) for a, b in zip(_fields(self), _fields(o), strict=True)))
        return replace(out, resident=self.resident)


def _fields(m: MediumTotals) -> tuple[Any, ...]:
    return tuple(getattr(m, f) for f in MediumTotals.__slots__)


def _combine(a: Any, b: Any, sign: int) -> Any:
    if isinstance(a, tuple):
        return tuple(x + sign * y for x, y in zip(a, b, strict=True))
    return a + sign * b


# vLLM's kv_cache_spec_kind values whose groups hold every block of a request's prefix: a prefix
# hit needs all of them, so their blocks stand for the token ranges of the prompt. The other
# kinds (sliding_window, sliding_window_mla, chunked_local_attention, mamba) keep only a window
# or a state and free the rest by design. "" is an engine that does not say (vLLM < 0.26, one group).
FULL_KINDS = frozenset({"", "full_attention", "mla_attention", "sink_full_attention", "unknown"})


@dataclass(frozen=True, slots=True)
class GroupTotals:
    """One KV cache group of one medium in one stream: its physical blocks."""

    medium: str
    group: int  # vLLM's group_idx (0 without one); OTHER_GROUP past the cap
    kind: str  # vLLM's kv_cache_spec_kind, "" while the engine has not said
    sliding_window: int | None  # tokens, for the window-bounded kinds
    reference: bool  # the group the medium's logical counts follow
    totals: MediumTotals
    tenants: Mapping[str, MediumTotals] = field(default_factory=dict)  # by tenant name, where the stream has tenants

    @property
    def full(self) -> bool:
        return self.kind in FULL_KINDS


OTHER_GROUP = -1


@dataclass(frozen=True, slots=True)
class LossTotal:
    """One (tier, cause) row of an engine's KV loss ledger, cumulative."""

    blocks: int  # 0 for a disk tier (bytes of page cache, not blocks)
    bytes: float | None  # None while the engine's block size is not known


@dataclass(frozen=True, slots=True)
class LostBytes:
    """One (tier, cause) row of an engine process's KV loss ledger, in bytes, cumulative: kept in
    the process's ``losses`` history under ``loss_key(tier, cause)`` for its rate."""

    bytes: float = 0.0


def loss_key(tier: str, cause: str) -> str:
    return f"{tier}/{cause}"


@dataclass(frozen=True, slots=True)
class TenantRow:
    """One tenant's blocks in one medium of an engine (logical, summed over its streams)."""

    tenant: str  # its label: a configured name, salt-XXXXXXXX, lora:NAME, default, unknown, other
    medium: str
    stored: float
    removed: float
    removed_young: float
    regretted: float
    regret_tokens: float
    resident: float


@dataclass(frozen=True, slots=True)
class TenantCounts:
    """A tenant's cumulative counts in a process's GPU pool (its logical blocks), as the detectors judge them."""

    stored: float = 0.0
    removed: float = 0.0
    regretted: float = 0.0


@dataclass(frozen=True, slots=True)
class TenantsView:
    """An engine's tenants, folded to its top-K labels (``tenant_view.py``)."""

    rows: tuple[TenantRow, ...]
    losses: Mapping[tuple[str, str, str], LossTotal]  # (tenant, tier, cause)
    labelled: int  # tenants with their own label
    folded: int  # tenants counted under other
    overflow: int  # tenants past a stream's cap (counted under other too)


@dataclass(frozen=True, slots=True)
class StreamStats:
    spec: StreamSpec
    connected: bool
    batches: int
    events: int
    media: Mapping[str, MediumTotals]  # logical: per medium, its reference group's blocks
    cleared: int  # AllBlocksCleared: prefix cache reset / sleep
    gaps: int  # times the sequence jumped
    missed: int  # batches missing when gaps were seen
    replayed: int  # of those, recovered through the replay endpoint
    lost: int  # not recovered
    decode_errors: Mapping[str, int]  # kind -> messages (or events) dropped; "field": events kept undescribed
    restarts: int  # the publisher's sequence began again
    replay_requests: int
    last_seq: int | None
    last_batch_ts: float  # engine wall clock of the newest batch
    last_message_at: float  # our monotonic clock
    tracked_blocks: int  # blocks whose store time is remembered
    groups: tuple[GroupTotals, ...] = ()  # physical: per medium and KV cache group
    localities: Mapping[str, str] = field(default_factory=dict)  # medium -> LOCAL / REMOTE, where the engine says
    # blocks stored with extra keys in their hash: lora, cache_salt, multimodal, prompt_embeds
    extras: Mapping[str, int] = field(default_factory=dict)
    # logical, per medium and tenant (``tenants.py``), once the stream has named one
    tenants: Mapping[str, Mapping[str, MediumTotals]] = field(default_factory=dict)
    tenants_overflow: int = 0  # distinct tenants past the stream's cap, counted as other
    abandoned: int = 0  # of the lost, given up unasked: more awaited replay than the replay buffer holds
    # medium -> seconds of removals remembered back from the last batch (none: regret memory off)
    regret_horizon: Mapping[str, float] = field(default_factory=dict)


def media_of(streams: Iterable[StreamStats]) -> dict[str, MediumTotals]:
    """Per medium, the logical blocks' totals summed over a process's streams (its data-parallel
    ranks): the one sum that the detectors' KV counts and the exporters' views both read."""
    out: dict[str, MediumTotals] = {}
    for s in streams:
        for name, m in s.media.items():
            out[name] = out.get(name, MediumTotals()) + m
    return out


def groups_of(streams: Iterable[StreamStats]) -> list[GroupTotals]:
    """Per medium and KV cache group, the physical blocks summed over a process's streams."""
    out: dict[tuple[str, int], GroupTotals] = {}
    for s in streams:
        for g in s.groups:
            had = out.get((g.medium, g.group))
            out[(g.medium, g.group)] = g if had is None else replace(had, totals=had.totals + g.totals)
    return [out[k] for k in sorted(out)]


def tenants_by_medium(streams: Iterable[StreamStats]) -> dict[str, dict[str, MediumTotals]]:
    """Per medium and tenant name, the streams' logical counts summed (an engine's data-parallel ranks)."""
    out: dict[str, dict[str, MediumTotals]] = {}
    for s in streams:
        for medium, by in s.tenants.items():
            into = out.setdefault(medium, {})
            for name, m in by.items():
                into[name] = into.get(name, MediumTotals()) + m
    return out


@dataclass(frozen=True, slots=True)
class TierReading:
    """One number of an engine's KV tier, as the engine counts it (``engines/tiers.py``)."""

    source: str  # vllm, lmcache, lmcache_mp, sglang, kvbm: whose metric names
    tier: str  # cpu, disk, remote, storage, external, all
    quantity: str  # stored, loaded, evicted, queried, hit (counters); hit_ratio, usage, used (gauges)
    unit: str  # bytes, blocks, chunks, tokens, ratio
    value: float


@dataclass(frozen=True, slots=True)
class LatencyReading:
    """One of an engine's latency histograms, cumulative, as the engine counts it
    (``engines/latency.py``): a mean over any span is Δsum / Δcount."""

    name: str  # one of LATENCY_NAMES
    sum_seconds: float
    count: float


# time to first token, end to end, LMCache's retrieve and store, vLLM's NIXL transfers (post to done, and
# the post call itself: NixlConnector's decode side observes one per KV transfer it pulls)
LATENCY_NAMES = ("ttft", "e2e", "lmcache_retrieve", "lmcache_store", "nixl_xfer", "nixl_post")


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One scrape. Counters are cumulative as the engine reports them; None: not exported."""

    at: float  # monotonic time of the scrape
    usage: float | None = None  # KV pool in use, 0..1 (max over engines / ranks)
    prefix_queries: float | None = None  # tokens looked up in the prefix cache
    prefix_hits: float | None = None  # of those, found
    preemptions: float | None = None  # requests preempted (vLLM) / retracted (SGLang)
    running: float | None = None
    waiting: float | None = None
    sleeping: bool | None = None  # vLLM sleep mode (KV pool discarded on purpose)
    evicted_tokens: float | None = None  # SGLang radix cache evictions
    idle_evict_samples: float | None = None  # vLLM's sampled idle-before-evict histogram: count
    idle_evict_young: float | None = None  # ... of which idle less than thrash_seconds
    lmcache_evicted_keys: float | None = None
    lmcache_hit_tokens: float | None = None
    lmcache_requested_tokens: float | None = None
    external_queries: float | None = None  # vLLM: tokens looked up in a KV connector's tier (CPU offload)
    external_hits: float | None = None
    offload_store_bytes: float | None = None  # vLLM OffloadingConnector: bytes copied GPU -> CPU
    offload_load_bytes: float | None = None  # ... CPU -> GPU
    generation_tokens: float | None = None  # tokens generated (decoded)
    pool_blocks: float | None = None  # GPU KV blocks the engine allocated (vLLM cache_config_info, summed over DP)
    tiers: tuple[TierReading, ...] = ()  # the engine's own KV tier counters, in one schema
    latencies: tuple[LatencyReading, ...] = ()  # the engine's latency histograms it exports
    families: int = 0
    rejected: Mapping[str, int] = field(default_factory=dict)  # samples of this page dropped, by reason


@dataclass(frozen=True, slots=True)
class AuditRow:
    """One pair of the KV metric-truth audit (``daemon/engines/audit.py``) for one engine process:
    what the engine's counter and kvwatch's own evidence said over the last judged window."""

    pair: str  # offload_store_copies, offload_load_copies, offload_store_blocks, resident_blocks
    unit: str  # bytes / blocks
    engine_source: str  # the engine's metric
    kvwatch_source: str  # kvwatch's evidence
    engine: float  # over the last judged window (a gauge pair: its value at the window's end)
    kvwatch: float
    divergence: float  # (engine - kvwatch) / max(engine, kvwatch): < 0, the engine reports less
    diverged: bool  # beyond the tolerance, in the direction the pair judges
    window: int  # judged windows so far (the detector counts consecutive ones by this)
    windows_diverged: int
    window_seconds: float


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    url: str
    owner: str  # the watched process's key


@dataclass(frozen=True, slots=True)
class TargetState:
    """How one engine's /metrics scrapes fared, as of the tick (the scraper's copy)."""

    target: ScrapeTarget
    ok: int = 0
    failures: Mapping[str, int] = field(default_factory=dict)  # reason -> count
    last: EngineSample | None = None
    last_error: str = ""  # the reason, and where in the page or the exchange: never the engine's text
    rejected: Mapping[str, int] = field(default_factory=dict)  # samples dropped from good pages, by reason


@dataclass(frozen=True, slots=True)
class EnginePlan:
    owner: str
    pid: int
    streams: tuple[StreamSpec, ...] = ()
    metrics_url: str | None = None
    notes: tuple[str, ...] = ()  # what could not be tapped, and why
    source: str = "cmdline"  # cmdline / config
    refused: Mapping[str, int] = field(default_factory=dict)  # taps the command line asked for, refused by reason


@dataclass(frozen=True, slots=True)
class EngineView:
    """What the taps know about one watched process, for the snapshot."""

    plan: EnginePlan
    streams: tuple[StreamStats, ...]
    scrape: TargetState | None
    scrape_age: float | None  # seconds since the last good scrape
    hit_ratio: float | None  # prefix-cache hits / queries over the rate window (tokens)
    regret_ratio: Mapping[str, float] = field(default_factory=dict)  # medium -> regretted / removed, same window
    block_bytes: int | None = None  # bytes of one KV block, where known
    block_bytes_source: str = ""  # config / offload
    tiers: tuple[TierReading, ...] = ()  # the engine's KV tier counters, last scrape
    latencies: tuple[LatencyReading, ...] = ()  # the engine's latency histograms, last scrape
    tier_hit_ratio: Mapping[tuple[str, str], float] = field(default_factory=dict)  # (source, tier), same window

    @property
    def media(self) -> dict[str, MediumTotals]:
        """Per medium, the logical blocks' totals summed over data-parallel ranks."""
        return media_of(self.streams)

    @property
    def regret_horizon(self) -> dict[str, float]:
        """Per medium, the shortest of its streams' regret horizons: regrets of removals younger
        than this are all counted, on every data-parallel rank."""
        out: dict[str, float] = {}
        for s in self.streams:
            for name, h in s.regret_horizon.items():
                out[name] = min(out.get(name, h), h)
        return out

    @property
    def groups(self) -> list[GroupTotals]:
        """Per medium and KV cache group, the physical blocks summed over data-parallel ranks."""
        return groups_of(self.streams)

    @property
    def tenants(self) -> dict[str, dict[str, MediumTotals]]:
        """Per medium and tenant, the logical blocks' totals summed over data-parallel ranks."""
        return tenants_by_medium(self.streams)

    @property
    def extras(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.streams:
            for k, n in s.extras.items():
                out[k] = out.get(k, 0) + n
        return out

    @property
    def localities(self) -> dict[str, str]:
        return {k: v for s in self.streams for k, v in s.localities.items()}
