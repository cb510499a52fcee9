"""KVEvictionBurst: the engine evicting its KV blocks far faster than usual, and it hurts.

Per process and KV medium, over a trailing window:

* eviction rate — blocks removed per second from vLLM's KV event stream
  (``MediumCounts.removed``); without a stream, the engine's own counters
  (SGLang ``evicted_tokens`` → GPU, in tokens; LMCache CPU evicted keys → CPU);
* hot when the rate is at least max(factor x baseline, floor) — or, for the GPU pool, the
  engine's preemptions at least max(factor x their baseline, ``thrash_preemptions_per_second``):
  a preempted request's KV is thrown out to be recomputed, with no BlockRemoved — now or at
  any evaluation within the last window — **and** the prefix-hit ratio of that medium (vLLM
  prefix-cache hits / queries in tokens for GPU; LMCache hit / requested tokens, or vLLM's
  external prefix cache, for CPU) fell at least ``hit_drop`` below its reference with
  ``min_queried_tokens`` queried in the window. The hit ratio lags the evictions (a lost
  prefix misses only when it is asked for again), hence the burst is remembered for a
  window. The reference is the higher of the learnt baseline and the hit ratio measured
  just before the burst: a baseline learnt while the cache was still filling sits far
  below what the engine achieves now. Where the engine exports no hit ratio for any
  medium, the rate alone decides; where it is exported but too little was queried to
  judge, or only for another medium, nothing fires (an idle engine cannot burst). Rates are
  judged only once the baselines are learnt (``warmup_seconds`` + ``baseline_min_seconds``): a
  full pool turning over evicts steadily above the floor, and that is normal to learn.
* cause: ``thrash`` when preemptions run at ≥ ``thrash_preemptions_per_second``
  (requests thrown out and recomputed); else ``pressure`` when KV usage ≥
  ``usage_pressure`` (the root cause of what comes with it); else ``thrash`` when most
  removed blocks were stored less than ``thrash_seconds`` before (hot blocks evicted;
  from the stream's own timestamps, or vLLM's sampled idle-before-evict histogram); else
  ``unexpected`` (usage is low: a reset, a policy bug, pollution), or ``unknown`` without
  a usage figure.
* intentional: an ``AllBlocksCleared`` event (prefix-cache reset; vLLM sleep resets it
  too) or the engine reporting sleep — no alert, baselines held, and the process
  re-learns for ``baseline_min_seconds`` after ``quiet_after_reset_seconds``.

Without any engine data (no stream, no engine counters, and no tapped engine process above
it — a vLLM engine core is covered by its API server's taps) the OS-side view stands in: the
process's host↔device copy bytes (CUDA copy probes), device→host *and* host→device both
at ≥ max(factor x baseline, ``floor_copy_bytes_per_second``) — KV stored to host and
loaded back, the churn of evicted hot blocks — fires with cause ``thrash``, medium CPU.

KV cache groups (hybrid models): the stream's counts are each medium's reference group's, the
full-attention blocks that hold a request's whole prefix; the sliding-window groups free what
leaves their window by design, and that churn is neither a burst nor thrash. A model whose only
group keeps a window (sliding-window attention throughout) is judged on its removals with the
hit-ratio guard as any other, but a window's blocks are evicted young by design: young
removals are no evidence of thrash there, and its usage counts the running requests' windows
only (a full cache of freed blocks reads low): a burst there is pressure, or thrash when it
preempts.

One finding per process. The alert's ``medium`` label is the first medium that is hot in a
fixed order — the engine's own pool (GPU) first, then CPU, then the rest by name — and it
stays while the alert fires: which medium a tick happened to see first never decides. The
engine's KV usage and preemptions describe its GPU pool and are joined to that medium only;
a CPU tier is judged by its own hit ratio (LMCache's, or vLLM's external prefix cache).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvwatch.daemon.config import EvictionBurstConfig
from kvwatch.daemon.detectors.base import Baseline, Hysteresis, cleared_on_purpose, threshold
from kvwatch.daemon.detectors.per_process import ProcessDetector
from kvwatch.daemon.model.alerts import AlertSpec
from kvwatch.daemon.model.cuda import CUDA, CopyCounts
from kvwatch.daemon.model.engine_scrape import ENGINE, ScrapeCounts, exports
from kvwatch.daemon.model.findings import Finding, Subject
from kvwatch.daemon.model.history import History, Obs
from kvwatch.daemon.model.kv_counts import MediumCounts
from kvwatch.daemon.model.windows import ProcessWindow

ALERT = "KVEvictionBurst"
SPECS = (
    AlertSpec(
        name=ALERT,
        fires_when="KV evictions ≥ 5 × baseline while prefix hits fall ≥ 30 points",
        severities=("warning",),
        causes=("thrash", "pressure", "unexpected"),
        labels=("medium",),
        summary=(
            "KV cache blocks evicted in a burst ({{ $labels.cause }}): {{ $labels.engine }} pid {{ "
            "$labels.pid }} on {{ $labels.instance }}"
        ),
        description=(
            "{{ $labels.engine }} {{ $labels.role }} pid {{ $labels.pid }} (pod {{ $labels.pod }}) "
            "is evicting KV blocks from {{ $labels.medium }} far above its baseline; cause {{ "
            "$labels.cause }}. Blocks removed now: {{ with printf "
            "\"sum(rate(kvwatch_kv_blocks_removed_total{instance='%s',pid='%s',medium='%s'}[2m]))\" "
            "$labels.instance $labels.pid $labels.medium | query }}{{ . | first | value | humanize "
            "}}/s{{ else }}unknown{{ end }}; requests preempted: {{ with printf "
            "\"sum(rate(kvwatch_engine_preemptions_total{instance='%s',pid='%s'}[2m]))\" "
            "$labels.instance $labels.pid | query }}{{ . | first | value | humanize }}/s{{ else "
            "}}unknown{{ end }}. Hot prefixes are being recomputed: expect TTFT to rise."
        ),
    ),
)
MEDIUM_ORDER = {"GPU": 0, "CPU": 1}  # the engine's own pool first, then its first offload tier


Count = Callable[[ProcessWindow, float], tuple[float, float]]  # a counter's increase over a window, and its seconds


def _count(history: Callable[[ProcessWindow], History[Obs]], key: str, get: Callable[[Obs], float]) -> Count:
    """One field of one key of one of the process's histories, as a ``Count``."""

    def count(p: ProcessWindow, window: float) -> tuple[float, float]:
        d, seconds = history(p).delta(key, window)
        return get(d), seconds

    return count


def _kv(get: Callable[[MediumCounts], float], medium: str) -> Count:
    return _count(lambda p: p.kv, medium, get)


def _copies(get: Callable[[CopyCounts], float]) -> Count:
    return _count(lambda p: p.copies, CUDA, get)


def _engine(get: Callable[[ScrapeCounts], float]) -> Count:
    return _count(lambda p: p.engine, ENGINE, get)


def _rate(count: Count, p: ProcessWindow, window: float) -> float:
    inc, seconds = count(p, window)
    return inc / seconds if seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Source:
    medium: str
    removed: Count  # the eviction counter
    unit: str  # blocks / tokens / keys
    young: Count | None  # removals of recently stored blocks
    young_of: Count | None  # ... out of this many
    hits: Count | None  # prefix hits (tokens found, tokens looked up) on this medium
    queries: Count | None
    also: Count | None = None  # a second counter that must burst too (the rate is the smaller of the two)
    window_bounded: bool = False  # the medium's blocks (its reference group) keep a window only


def _hit_counts(p: ProcessWindow, medium: str) -> tuple[Count | None, Count | None]:
    """The prefix-hit counters that measure reuse on ``medium``: the engine's own prefix cache
    for GPU; for CPU, LMCache's hit tokens, else vLLM's external (KV connector) prefix cache."""
    state = p.engine_state
    if medium == "GPU" and exports(state, lambda x: x.prefix_queries):
        return _engine(lambda d: d.prefix_hits), _engine(lambda d: d.prefix_queries)
    if medium == "CPU" and exports(state, lambda x: x.lmcache_requested_tokens):
        return _engine(lambda d: d.lmcache_hit_tokens), _engine(lambda d: d.lmcache_requested_tokens)
    if medium == "CPU" and exports(state, lambda x: x.external_queries):
        return _engine(lambda d: d.external_hits), _engine(lambda d: d.external_queries)
    return None, None


def sources(p: ProcessWindow) -> list[Source]:
    """Every medium this process reports evictions for, in a fixed order (GPU, CPU, the rest
    by name): the order, not the timing of a tick, decides which medium names an alert."""
    out: list[Source] = []
    for m in p.kv:
        bounded = m in p.kv_state.window_bounded
        removed = _kv(lambda d: d.removed, m)
        young = None if bounded else _kv(lambda d: d.removed_young, m)
        out.append(Source(m, removed, "blocks", young, removed, *_hit_counts(p, m), window_bounded=bounded))
    media = {x.medium for x in out}
    if "GPU" not in media and exports(p.engine_state, lambda x: x.evicted_tokens):
        out.append(Source("GPU", _engine(lambda d: d.evicted_tokens), "tokens", None, None, *_hit_counts(p, "GPU")))
    if "CPU" not in media and exports(p.engine_state, lambda x: x.lmcache_evicted_keys):
        out.append(Source("CPU", _engine(lambda d: d.lmcache_evicted_keys), "keys", None, None, *_hit_counts(p, "CPU")))
    if not out and CUDA in p.copies and not p.engine_state.tapped:
        # no engine data at all: the OS-side view — KV stored to host and loaded back, both
        # far above their baseline, is the store-then-reload churn of evicted hot blocks
        d2h, h2d = _copies(lambda d: d.d2h_bytes), _copies(lambda d: d.h2d_bytes)
        out.append(Source("CPU", d2h, "bytes", None, None, None, None, h2d))
    return sorted(out, key=lambda x: (MEDIUM_ORDER.get(x.medium, len(MEDIUM_ORDER)), x.medium))


@dataclass(slots=True)
class _Medium:
    rate: Baseline
    hit: Baseline
    preempt: Baseline
    burst_at: float | None = None  # last evaluation that saw the rate above the threshold
    hit_before: float | None = None  # hit ratio at the last evaluation with no burst in the window


@dataclass(frozen=True, slots=True)
class _Judged:
    source: Source
    values: dict[str, float]
    hot: bool
    cool: bool


@dataclass(slots=True)
class _State:
    hysteresis: Hysteresis
    media: dict[str, _Medium] = field(default_factory=dict)
    learning_since: float | None = None
    quiet_until: float = 0.0
    medium: str = ""
    cause: str = ""


class EvictionBurst(ProcessDetector[EvictionBurstConfig, _State]):
    name = ALERT

    def new_state(self) -> _State:
        return _State(Hysteresis(self.config.confirm_windows, self.config.clear_windows))

    def applies(self, p: ProcessWindow) -> bool:
        return bool(sources(p))

    def _medium_state(self, st: _State, medium: str) -> _Medium:
        m = st.media.get(medium)
        if m is None:
            h = self.config.baseline_half_life_seconds
            m = st.media[medium] = _Medium(Baseline(h), Baseline(h), Baseline(h))
        return m

    def measure(self, p: ProcessWindow, src: Source) -> dict[str, float]:
        c = self.config
        w = c.window_seconds
        evicted, seconds = src.removed(p, w)
        out = {"eviction_rate": evicted / seconds if seconds > 0 else 0.0, "evicted": evicted}
        if src.also is not None:
            out["d2h_bytes_per_second"], out["h2d_bytes_per_second"] = out["eviction_rate"], _rate(src.also, p, w)
            out["eviction_rate"] = min(out["eviction_rate"], out["h2d_bytes_per_second"])
            out["evicted"] = min(out["evicted"], src.also(p, w)[0])
        engine = p.engine_state
        if src.young and src.young_of:
            removed = src.young_of(p, w)[0]
            out["young_fraction"] = src.young(p, w)[0] / removed if removed > 0 else 0.0
        elif src.medium == "GPU" and not src.window_bounded and exports(engine, lambda x: x.idle_evict_samples):
            d, _ = p.engine.delta(ENGINE, w)
            out["young_fraction"] = d.idle_evict_young / d.idle_evict_samples if d.idle_evict_samples > 0 else 0.0
        if src.hits and src.queries:
            q = src.queries(p, w)[0]
            out["queried_tokens"] = q
            if q >= c.min_queried_tokens and q > 0:
                out["hit_ratio"] = src.hits(p, w)[0] / q
        if src.window_bounded:
            out["window_bounded"] = 1.0
        if src.medium == "GPU":  # the engine's usage and preemptions are about its own (GPU) pool
            if engine.usage is not None:
                out["kv_usage"] = engine.usage
            if exports(engine, lambda x: x.preemptions):
                out["preemptions_per_second"] = _rate(_engine(lambda d: d.preemptions), p, w)
        return out

    def _cause(self, m: dict[str, float], evidence: bool) -> str:
        """Preemptions first: requests thrown out and recomputed are thrash whatever the
        usage (vLLM preempts only with a full pool). Then a full pool (pressure), the root
        cause of the hot-block evictions that come with it; below it, hot blocks evicted
        are thrash."""
        c = self.config
        if m.get("preemptions_per_second", 0.0) >= max(c.thrash_preemptions_per_second, 1e-9):
            return "thrash"
        if m.get("kv_usage", 0.0) >= c.usage_pressure or m.get("window_bounded"):
            return "pressure"
        if evidence and m.get("young_fraction", 0.0) >= c.thrash_fraction:
            return "thrash"
        return "unexpected" if "kv_usage" in m else "unknown"

    def judge(self, key: str, st: _State, p: ProcessWindow, now: float) -> Finding:
        c = self.config
        srcs = sources(p)
        if cleared_on_purpose(p, max(c.window_seconds, 1.0)):
            st.quiet_until = now + c.quiet_after_reset_seconds
            st.learning_since = None
        quiet = now < st.quiet_until
        if not quiet and st.learning_since is None and p.age >= c.warmup_seconds:
            st.learning_since = now
        warm = st.learning_since is not None and now - st.learning_since >= c.baseline_min_seconds

        rate_alone = not any(x.queries for x in srcs)  # this engine measures reuse on no medium
        judged = [self._judge(st, p, src, now, warm=warm, quiet=quiet, rate_alone=rate_alone) for src in srcs]
        hot = [j for j in judged if j.hot]
        firing, changed = st.hysteresis.step(bool(hot), all(j.cool for j in judged), now)
        if firing and not changed:  # an alert keeps the medium it fired on
            best = next((j for j in judged if j.source.medium == st.medium), judged[0])
        else:  # the first hot medium in the fixed order (GPU first), else the first
            best = hot[0] if hot else judged[0]
        src, m = best.source, best.values
        if firing and changed:
            st.medium = src.medium
            st.cause = "thrash" if src.also else self._cause(m, m["evicted"] >= c.floor_blocks_per_second)
        elif not firing:
            st.medium, st.cause = src.medium, ""
        labels = {**p.subject.labels, "medium": st.medium}
        hit = f", prefix hits {m['hit_ratio']:.0%} (were {m['reference_hit_ratio']:.0%})" if "hit_ratio" in m else ""
        usage = f", KV usage {m['kv_usage']:.0%}" if "kv_usage" in m else ""
        young = f", {m['young_fraction']:.0%} of them recently stored" if "young_fraction" in m else ""
        return Finding(
            alert=ALERT,
            subject=Subject(key, labels),
            firing=firing,
            cause=st.cause if firing else "",
            values=m,
            summary=(
                f"{src.medium} KV evictions of pid {p.subject.labels.get('pid', '?')} at "
                f"{m['eviction_rate']:.0f} {src.unit}/s (baseline {m['baseline_rate']:.1f}/s){hit}{usage}{young}"
            ),
            severity="warning",
        )

    def _limits(self, ms: _Medium, src: Source, m: dict[str, float]) -> tuple[float, float | None]:
        """The eviction-rate threshold, and (GPU) the preemption-rate one."""
        c = self.config
        floor = {"tokens": c.floor_tokens_per_second, "bytes": c.floor_copy_bytes_per_second}.get(
            src.unit, c.floor_blocks_per_second
        )
        limit = threshold(ms.rate.value, c.factor, floor)
        if "preemptions_per_second" not in m or c.thrash_preemptions_per_second <= 0:
            return limit, None
        return limit, threshold(ms.preempt.value, c.factor, c.thrash_preemptions_per_second)

    @staticmethod
    def _bursting(m: dict[str, float], limit: float, pre_limit: float | None) -> bool:
        """Blocks evicted far above normal, or (GPU) requests preempted far above normal: a
        preempted request's KV is thrown out of the pool to be recomputed, and vLLM announces
        no BlockRemoved for it (its blocks stay cached, free)."""
        if 0 < m["eviction_rate"] >= limit:
            return True
        pre = m.get("preemptions_per_second", 0.0)
        return pre_limit is not None and 0 < pre >= pre_limit

    def _judge(
        self, st: _State, p: ProcessWindow, src: Source, now: float, *, warm: bool, quiet: bool, rate_alone: bool
    ) -> _Judged:
        """One medium: hot (burst and the medium's hit ratio fell), cool, and learning. A medium
        without a hit ratio of its own is judged on its rate alone only when the engine exports
        no hit ratio for any medium: where it measures reuse, that is where reuse is judged."""
        c = self.config
        ms = self._medium_state(st, src.medium)
        m = self.measure(p, src)
        limit, pre_limit = self._limits(ms, src, m)
        # judged against a learnt baseline only: an engine evicting steadily above the floor
        # (a full pool turning over) would otherwise be "bursting" from its first second and
        # never learn what normal is
        if warm and self._bursting(m, limit, pre_limit):
            ms.burst_at = now
        recent = ms.burst_at is not None and now - ms.burst_at <= c.window_seconds
        if not recent and not st.hysteresis.firing and "hit_ratio" in m:
            ms.hit_before = m["hit_ratio"]
        known = [v for v in (ms.hit.value if ms.hit.weight > 0 else None, ms.hit_before) if v is not None]
        reference = max(known, default=0.0)
        if src.queries is None:
            hit_ok = rate_alone
        else:
            hit_ok = "hit_ratio" in m and bool(known) and m["hit_ratio"] <= reference - c.hit_drop
        hot = warm and not quiet and recent and hit_ok
        m.update(
            threshold=limit,
            baseline_rate=ms.rate.value,
            baseline_hit_ratio=ms.hit.value,
            reference_hit_ratio=reference,
            ratio_to_baseline=m["eviction_rate"] / ms.rate.value if ms.rate.value > 0 else 0.0,
        )
        if pre_limit is not None:
            m.update(preemption_threshold=pre_limit, baseline_preemptions_per_second=ms.preempt.value)
        calm = not self._bursting(m, 0.5 * limit, None if pre_limit is None else 0.5 * pre_limit)
        cool = quiet or (calm and not recent) or not hit_ok
        if st.hysteresis.firing or recent or quiet:  # a burst is not learnt as normal, hit drop or not (yet)
            for b in (ms.rate, ms.hit, ms.preempt):
                b.hold(now)
        elif st.learning_since is not None:
            ms.rate.update(m["eviction_rate"], now)
            if "hit_ratio" in m:
                ms.hit.update(m["hit_ratio"], now)
            if "preemptions_per_second" in m:
                ms.preempt.update(m["preemptions_per_second"], now)
        return _Judged(src, m, hot, cool)
