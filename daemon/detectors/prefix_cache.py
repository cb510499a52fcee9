"""KVPrefixCacheIneffective: the engine looks up substantial prompt tokens in its prefix cache
and finds almost none, while its KV event stream shows blocks being stored.

From the engine's /metrics (prefix-cache queried and hit tokens, its GPU pool) and its KV
event stream (GPU blocks stored; of them, those stored again while the engine still held
them, and those stored again after their eviction). Per engine process, over
``window_seconds``: hot when at least ``min_queried_tokens`` were queried, the hit ratio is
at most ``max_hit_ratio`` and at least ``min_stored_blocks`` blocks were stored; cool when
the hit ratio is back above twice that or the queries stop. The cause tells two apart:

* ``not_hit``: at least ``recur_fraction`` of the stored blocks were stored again while the
  engine held them. The same prefixes come back and the cache it has does not serve them:
  prefix caching off, a cache salt or LoRA id that differs per request, an engine bug. A
  warning.
* ``not_shared``: no block recurs at all. The workload has no shared prefixes, and a prefix
  cache cannot help it: severity info, for the record. Only where that is the engine's normal:
  its hit ratio learnt over ``baseline_half_life_seconds`` is at most twice ``max_hit_ratio``.
  A drop from hits it had (a flood of unique prompts, a workload that changed) is no statement
  about the workload, and evictions that come with it are KVEvictionBurst's.

Blocks that come back only after their eviction are the pool too small for the working set:
KVEvictionBurst's case, not judged here. Nor is a window with a prefix-cache reset or sleep
(AllBlocksCleared, vLLM's sleep state): both are intentional.

On a hybrid model the counts are the reference group's (full attention), and a hit needs the
sliding-window groups' blocks too: a prefix the full-attention group still holds is computed
again when a window group lost its tail, and those window blocks come back as regrets. Blocks
stored again while held, up to the window group's regrets in the window, are counted as
evictions, not as a cache that does not serve. Blocks announced again for a prefix hit (vLLM's
``kv_cache_report_mode`` full) are not stores at all (``engines/stream_counts.py``), as far as
the engine's hit tokens in the window cover them: an engine that looks its prefixes up and
always misses stores them again from the first block, in the same shape, without the hits.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwatch.daemon.config import PrefixCacheIneffectiveConfig
from kvwatch.daemon.detectors.base import Baseline, Hysteresis, cleared_on_purpose
from kvwatch.daemon.detectors.per_process import ProcessDetector
from kvwatch.daemon.model.alerts import AlertSpec
from kvwatch.daemon.model.engine_scrape import ENGINE, exports
from kvwatch.daemon.model.findings import Finding, Subject
from kvwatch.daemon.model.windows import ProcessWindow

ALERT = "KVPrefixCacheIneffective"
SPECS = (
    AlertSpec(
        name=ALERT,
        fires_when="≤ 2 % of ≥ 20,000 prompt tokens/min hit the prefix cache",
        severities=("warning", "info"),
        causes=("not_hit", "not_shared"),
        labels=(),
        summary=(
            "Prefix cache not serving repeated prefixes: {{ $labels.engine }} pid {{ $labels.pid }} "
            "on {{ $labels.instance }}"
        ),
        description=(
            "{{ $labels.engine }} {{ $labels.role }} pid {{ $labels.pid }} (pod {{ $labels.pod }}) "
            "stores the same KV blocks again while its prefix cache hits almost nothing. Prefix hits "
            "now: {{ with printf \"sum(rate(kvwatch_engine_prefix_cache_hit_tokens_total{instance='%s'"
            ",pid='%s',medium='GPU'}[5m])) / sum(rate(kvwatch_engine_prefix_cache_queried_tokens_tota"
            "l{instance='%s',pid='%s',medium='GPU'}[5m]))\" $labels.instance $labels.pid "
            "$labels.instance $labels.pid | query }}{{ . | first | value | humanizePercentage }}{{ "
            "else }}unknown{{ end }} of queried tokens. Prefix caching off, a per-request cache salt "
            "or LoRA id, or an engine bug: every repeated prefix is recomputed."
        ),
        page_on='cause="not_hit"',
    ),
)
GPU = "GPU"  # the engine's own pool: the medium its prefix-cache counters describe


@dataclass(slots=True)
class _State:
    hysteresis: Hysteresis
    hit: Baseline  # the engine's hit ratio, learnt while nothing fires
    cause: str = ""


class PrefixCacheIneffective(ProcessDetector[PrefixCacheIneffectiveConfig, _State]):
    name = ALERT

    def applies(self, p: ProcessWindow) -> bool:
        return GPU in p.kv and exports(p.engine_state, lambda x: x.prefix_queries)

    def new_state(self) -> _State:
        c = self.config
        return _State(Hysteresis(c.confirm_windows, c.clear_windows), Baseline(c.baseline_half_life_seconds))

    def judge(self, key: str, st: _State, p: ProcessWindow, now: float) -> Finding:
        c, w = self.config, self.config.window_seconds
        engine, _ = p.engine.delta(ENGINE, w)
        kv, _ = p.kv.delta(GPU, w)
        queried, hits, stored = engine.prefix_queries, engine.prefix_hits, kv.stored
        restored, regretted = kv.restored, kv.regretted
        # held blocks stored again from a request's first block are hit announcements only as far
        # as the engine's hits cover them; the rest were computed again: stored while held
        ann, ann_tokens = kv.announced, kv.announced_tokens
        again = ann * max(0.0, 1.0 - hits / ann_tokens) if ann_tokens > 0 else 0.0
        stored, restored = stored + again, restored + again
        window_lost = min(restored, kv.window_regretted)  # a hybrid model's window group: 0 without one
        restored, regretted = restored - window_lost, regretted + window_lost
        ratio = hits / queried if queried > 0 else 0.0
        share = restored / stored if stored > 0 else 0.0
        evicted_first = share < c.recur_fraction and regretted >= c.recur_fraction * stored > 0
        intentional = cleared_on_purpose(p, w)
        judged = p.age >= c.warmup_seconds and not intentional and not evicted_first
        # "shares nothing" describes the workload: only where missing is the engine's normal, not a
        # drop from what it hit before (a flood of unique prompts, a workload that changed)
        normal = st.hit.weight == 0 or st.hit.value <= 2 * c.max_hit_ratio
        hot = judged and queried >= c.min_queried_tokens and ratio <= c.max_hit_ratio and stored >= c.min_stored_blocks
        hot = hot and (share >= c.recur_fraction or normal)
        cool = not judged or queried < c.min_queried_tokens or ratio > 2 * c.max_hit_ratio
        firing, changed = st.hysteresis.step(hot, cool, now)
        if firing:
            st.hit.hold(now)
        elif queried >= c.min_queried_tokens:
            st.hit.update(ratio, now)
        if firing and changed:
            st.cause = "not_hit" if share >= c.recur_fraction else "not_shared"
        elif not firing:
            st.cause = ""
        values = {
            "queried_tokens": queried,
            "hit_tokens": hits,
            "hit_ratio": round(ratio, 6),
            "stored_blocks": stored,
            "stored_while_held": restored,
            "stored_after_eviction": regretted,
            "window_group_lost": window_lost,
            "baseline_hit_ratio": round(st.hit.value, 6),
            "recurring_fraction": round(share, 6),
            "window_seconds": w,
        }
        what = "the blocks it holds are not hit" if st.cause == "not_hit" else "no block recurs"
        return Finding(
            alert=ALERT,
            subject=Subject(key, p.subject.labels),
            firing=firing,
            cause=st.cause,
            values=values,
            summary=(
                f"pid {p.subject.labels.get('pid', '?')}: {ratio:.1%} of {queried:.0f} queried prefix tokens hit "
                f"in {w:.0f} s while {stored:.0f} blocks were stored, {share:.0%} of them again: {what}"
            ),
            severity="warning" if st.cause != "not_shared" else "info",
        )
