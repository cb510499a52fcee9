"""KVPreemptionLivelock: an engine keeps preempting requests while the tokens it generates per
second fall toward zero. Preempted requests lose their KV blocks, are recomputed, take the
pool again and push others out: the engine is busy and nothing finishes.

From the engine's own counters (its /metrics): requests preempted (vLLM ``num_preemptions``,
SGLang retractions) and tokens generated (``generation_tokens``). Per engine process, over
``window_seconds``: hot when preemptions run at ``min_preemptions_per_second`` or more and
generated tokens per second are at most ``collapse_fraction`` of the engine's learnt rate;
cool when tokens are back above ``recover_fraction`` of it or preemptions stopped. The rate
is learnt from calm windows only (no preemption storm, something generated: an idle engine
teaches nothing), once ``warmup_seconds`` have passed, for at least ``baseline_min_seconds``,
and a rate below ``floor_tokens_per_second`` is not judged. Ordinary preemption at a healthy
throughput is never hot: the throughput has to collapse too. The finding carries the requests
preempted and the tokens lost (what the learnt rate would have generated, less what was) over
the window.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwatch.daemon.config import PreemptionLivelockConfig
from kvwatch.daemon.detectors.base import Baseline, Hysteresis
from kvwatch.daemon.detectors.per_process import ProcessDetector
from kvwatch.daemon.model.alerts import AlertSpec
from kvwatch.daemon.model.engine_scrape import ENGINE, exports
from kvwatch.daemon.model.findings import Finding, Subject
from kvwatch.daemon.model.windows import ProcessWindow

ALERT = "KVPreemptionLivelock"
SPECS = (
    AlertSpec(
        name=ALERT,
        fires_when="≥ 0.5 preemptions/s while tokens/s fall to ≤ 0.2 × the healthy rate",
        severities=("warning",),
        causes=("livelock",),
        labels=(),
        summary=(
            "Preemption livelock: {{ $labels.engine }} pid {{ $labels.pid }} keeps preempting "
            "requests while generating almost nothing on {{ $labels.instance }}"
        ),
        description=(
            "{{ $labels.engine }} {{ $labels.role }} pid {{ $labels.pid }} (pod {{ $labels.pod }}) "
            "keeps preempting requests while the tokens it generates per second collapsed. Requests "
            "preempted now: {{ with printf \"sum(rate(kvwatch_engine_preemptions_total{instance='%s',p"
            "id='%s'}[2m]))\" $labels.instance $labels.pid | query }}{{ . | first | value | humanize "
            "}}/s{{ else }}unknown{{ end }}; tokens generated: {{ with printf "
            "\"sum(rate(kvwatch_engine_generation_tokens_total{instance='%s',pid='%s'}[2m]))\" "
            "$labels.instance $labels.pid | query }}{{ . | first | value | humanize }}/s{{ else "
            "}}unknown{{ end }}. Preempted requests are recomputed and preempted again: throughput "
            "heads for 0 tokens/s."
        ),
    ),
)


@dataclass(slots=True)
class _State:
    hysteresis: Hysteresis
    tokens: Baseline
    learning_since: float | None = None


class PreemptionLivelock(ProcessDetector[PreemptionLivelockConfig, _State]):
    name = ALERT

    def applies(self, p: ProcessWindow) -> bool:
        return exports(p.engine_state, lambda x: x.preemptions, lambda x: x.generation_tokens)

    def new_state(self) -> _State:
        c = self.config
        return _State(Hysteresis(c.confirm_windows, c.clear_windows), Baseline(c.baseline_half_life_seconds))

    def judge(self, key: str, st: _State, p: ProcessWindow, now: float) -> Finding:
        c = self.config
        w = c.window_seconds
        d, seconds = p.engine.delta(ENGINE, w)
        preempted, tokens = d.preemptions, d.generation_tokens
        preempt_rate, token_rate = (preempted / seconds, tokens / seconds) if seconds > 0 else (0.0, 0.0)
        if st.learning_since is None and p.age >= c.warmup_seconds:
            st.learning_since = now
        learnt = st.tokens.value
        warm = (
            st.learning_since is not None
            and now - st.learning_since >= c.baseline_min_seconds
            and learnt >= c.floor_tokens_per_second
        )
        storm = preempt_rate >= c.min_preemptions_per_second
        hot = warm and storm and token_rate <= c.collapse_fraction * learnt
        cool = not storm or token_rate >= c.recover_fraction * learnt
        firing, _changed = st.hysteresis.step(hot, cool, now)
        if st.learning_since is not None and not firing and not storm and token_rate > 0:
            st.tokens.update(token_rate, now)
        else:
            st.tokens.hold(now)
        values = {
            "preemptions_per_second": round(preempt_rate, 6),
            "preempted_in_window": preempted,
            "tokens_per_second": round(token_rate, 6),
            "tokens_in_window": tokens,
            "baseline_tokens_per_second": round(learnt, 6),
            "tokens_lost_in_window": round(max(learnt * w - tokens, 0.0), 3) if warm else 0.0,
            "window_seconds": w,
        }
        return Finding(
            alert=ALERT,
            subject=Subject(key, p.subject.labels),
            firing=firing,
            cause="livelock" if firing else "",
            values=values,
            summary=(
                f"pid {p.subject.labels.get('pid', '?')} preempted {preempted:.0f} requests in {w:.0f} s "
                f"({preempt_rate:.1f}/s) while generating {token_rate:.0f} tokens/s (learnt {learnt:.0f}/s)"
            ),
            severity="warning",
        )
