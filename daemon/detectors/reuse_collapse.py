"""KVCacheReuseCollapse: the CUDA caching allocator stopped reusing its blocks.

Per process, over a trailing window: successful segment allocations per second
(cudaMalloc, cudaMallocAsync, cuMemAlloc, cuMemAllocAsync, cuMemCreate) at least
max(factor x baseline, floor), while memory churns instead of growing (bytes
freed ≈ bytes allocated, or as many frees as allocations). Cause:
``uncached`` (PYTORCH_NO_CUDA_MEMORY_CACHING in the environment), ``oom_retry``
(a failed allocation followed by a burst of frees), ``empty_cache`` (frees in
bursts, no failures), ``fragmentation`` (the rest, with 2/20 MiB segments).

A second finding, CUDAMemoryGrowth, is the leak: the same call rate with net
bytes rising.

Intentional: while the engine the process belongs to reports sleep mode (vLLM's
``engine_sleep_state``, from its API server's /metrics) and ``quiet_after_sleep_seconds``
after, nothing is judged or learnt — wake-up maps the pool and weights back in a burst —
then the process warms up anew.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from kvwatch.daemon.config import ReuseCollapseConfig
from kvwatch.daemon.detectors.base import Baseline, Hysteresis, threshold
from kvwatch.daemon.detectors.per_process import ProcessDetector
from kvwatch.daemon.model.alerts import AlertSpec
from kvwatch.daemon.model.cuda import CUDA
from kvwatch.daemon.model.findings import Finding
from kvwatch.daemon.model.windows import ProcessWindow

ALERT = "KVCacheReuseCollapse"
GROWTH = "CUDAMemoryGrowth"
SPEC = AlertSpec(
    name=ALERT,
    fires_when="CUDA segment allocations ≥ 10 × baseline while memory churns",
    severities=("warning",),
    causes=("oom_retry", "empty_cache", "uncached", "fragmentation", "unknown"),
    labels=(),
    summary=(
        "CUDA caching allocator stopped reusing blocks ({{ $labels.cause }}): {{ $labels.engine "
        "}} pid {{ $labels.pid }} on {{ $labels.instance }}"
    ),
    description=(
        "{{ $labels.engine }} {{ $labels.role }} pid {{ $labels.pid }} (pod {{ $labels.pod }}) "
        "is calling the CUDA allocator far more than its baseline; cause {{ $labels.cause }}. "
        'Segment allocations now: {{ with printf "sum(rate(kvwatch_cuda_alloc_calls_total{instanc'
        "e='%s',pid='%s',result='ok'}[2m]))\" $labels.instance $labels.pid | query }}{{ . | first "
        "| value | humanize }}/s{{ else }}unknown{{ end }}. GPU memory can look flat while "
        "latency climbs."
    ),
)
GROWTH_SPEC = AlertSpec(
    name=GROWTH,
    fires_when="CUDA allocations ≥ 10 × baseline while held memory grows",
    severities=("warning",),
    causes=("leak",),
    labels=(),
    summary=(
        "CUDA memory of {{ $labels.engine }} pid {{ $labels.pid }} grows without being freed on {{ $labels.instance }}"
    ),
    description=(
        "Outstanding device memory of pid {{ $labels.pid }}: {{ with printf "
        "\"sum(kvwatch_cuda_outstanding_bytes{instance='%s',pid='%s'})\" $labels.instance "
        "$labels.pid | query }}{{ . | first | value | humanize1024 }}B{{ else }}unknown{{ end "
        "}}, allocations outpacing frees (a leak, not cache churn)."
    ),
)
SPECS = (SPEC, GROWTH_SPEC)
MIB = 1024 * 1024


def allocator_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF as a dict (``backend:cudaMallocAsync,...``)."""
    raw = environ.get("PYTORCH_CUDA_ALLOC_CONF") or environ.get("PYTORCH_ALLOC_CONF") or ""
    out: dict[str, str] = {}
    for item in raw.split(","):
        key, sep, value = item.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def caching_disabled(environ: Mapping[str, str]) -> bool:
    return environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "").strip() not in ("", "0")


@dataclass(slots=True)
class _State:
    baseline: Baseline
    hysteresis: Hysteresis
    growth: Hysteresis
    warm_since: float | None = None
    quiet_until: float = 0.0
    cause: str = ""


class ReuseCollapse(ProcessDetector[ReuseCollapseConfig, _State]):
    name = ALERT
    alerts: ClassVar[tuple[str, ...]] = (ALERT, GROWTH)

    def applies(self, p: ProcessWindow) -> bool:
        return CUDA in p.allocator  # a CUDA process, attached

    def new_state(self) -> _State:
        c = self.config
        return _State(
            Baseline(c.baseline_half_life_seconds),
            Hysteresis(c.confirm_windows, c.clear_windows),
            Hysteresis(c.confirm_windows, c.clear_windows),
        )

    def measure(self, p: ProcessWindow) -> dict[str, float]:
        d, dt = p.allocator.delta(CUDA, self.config.window_seconds)

        def per_second(x: float) -> float:
            return x / dt if dt > 0 else 0.0

        return {
            "alloc_calls_per_second": per_second(d.alloc_calls),
            "free_calls_per_second": per_second(d.free_calls),
            "alloc_calls": d.alloc_calls,
            "free_calls": d.free_calls,
            "alloc_bytes": d.alloc_bytes,
            "freed_bytes": d.freed_bytes,
            "net_bytes_per_second": per_second(d.alloc_bytes) - per_second(d.freed_bytes),
            "failures": d.alloc_failures,
            "frees_after_failure": d.frees_after_failure,
            "clustered_frees": d.clustered_frees,
            "segment_allocs": d.seg_2m + d.seg_20m,
        }

    def churn(self, m: Mapping[str, float]) -> bool:
        """Memory turns over instead of growing: freed ≈ allocated, by bytes or by calls
        (frees of blocks allocated before kvwatch attached have no known size)."""
        tol = self.config.churn_tolerance
        a, f = m["alloc_bytes"], m["freed_bytes"]
        by_bytes = a > 0 and abs(a - f) <= tol * a
        ac, fc = m["alloc_calls"], m["free_calls"]
        by_calls = ac > 0 and abs(ac - fc) <= tol * ac + 1
        return by_bytes or by_calls

    def cause(self, m: Mapping[str, float], environ: Mapping[str, str]) -> str:
        if caching_disabled(environ):
            return "uncached"
        if m["failures"] > 0 and m["frees_after_failure"] > 0:
            return "oom_retry"
        if m["free_calls"] > 0 and m["clustered_frees"] >= 0.5 * m["free_calls"]:
            return "empty_cache"
        if m["alloc_calls"] > 0 and m["segment_allocs"] >= 0.5 * m["alloc_calls"]:
            return "fragmentation"
        return "unknown"

    def warm(self, p: ProcessWindow, st: _State, now: float) -> bool:
        """Past start-up: old enough, KV pool allocated when we can tell, and a baseline learnt
        for a while (CUDA graph capture and torch.compile allocate a lot at first)."""
        c = self.config
        if p.engine_state.sleeping:
            # sleep mode releases the KV pool (and weights) and wake-up maps them again: an
            # intentional turnover, neither judged nor learnt; the process warms up anew after
            st.warm_since = None
            st.quiet_until = now + c.quiet_after_sleep_seconds
            return False
        if now < st.quiet_until or p.age < c.warmup_seconds:
            return False
        # the KV pool: one allocation we saw, or (allocated before we attached) NVML's view
        pool = max(p.allocator.last(CUDA).max_alloc, p.gpu.used_bytes)
        total = p.gpu.device_total_bytes
        if c.require_kv_pool and total > 0 and pool < c.kv_pool_fraction * total:
            return False
        if st.warm_since is None:
            st.warm_since = now
        return now - st.warm_since >= c.baseline_min_seconds

    def judge_all(self, key: str, st: _State, p: ProcessWindow, now: float) -> list[Finding]:
        c = self.config
        m = self.measure(p)
        rate = m["alloc_calls_per_second"]
        limit = threshold(st.baseline.value, c.factor, c.floor_calls_per_second)
        ready = self.warm(p, st, now)
        churning = self.churn(m)
        hot = ready and rate >= limit and churning
        cool = rate < limit / 2
        firing, changed = st.hysteresis.step(hot, cool, now)
        growing = ready and rate >= limit and not churning and m["net_bytes_per_second"] > 0
        grow_firing, _ = st.growth.step(growing, not growing, now)
        if firing or grow_firing or hot or growing:
            st.baseline.hold(now)  # the baseline learns only what is normal
        elif st.warm_since is not None:
            st.baseline.update(rate, now)
        if firing and changed:
            st.cause = self.cause(m, p.environ)
        conf = allocator_settings(p.environ)
        values = {
            **m,
            "baseline_calls_per_second": st.baseline.value,
            "threshold_calls_per_second": limit,
            "ratio_to_baseline": rate / st.baseline.value if st.baseline.value > 0 else 0.0,
        }
        backend = conf.get("backend", "native")
        return [
            Finding(
                alert=ALERT,
                subject=p.subject,
                firing=firing,
                cause=st.cause if firing else "",
                values=values,
                summary=(
                    f"CUDA allocator of pid {p.subject.labels.get('pid', '?')} making {rate:.0f} "
                    f"segment allocations/s (baseline {st.baseline.value:.1f}/s, "
                    f"threshold {limit:.0f}/s) "
                    f"while memory churns; frees {m['free_calls_per_second']:.0f}/s, "
                    f"{m['failures']:.0f} failed, allocator backend {backend}"
                ),
                severity="warning",
            ),
            Finding(
                alert=GROWTH,
                subject=p.subject,
                firing=grow_firing,
                cause="leak" if grow_firing else "",
                values=values,
                summary=(
                    f"GPU memory of pid {p.subject.labels.get('pid', '?')} growing "
                    f"{m['net_bytes_per_second'] / MIB:.0f} MiB/s at {rate:.0f} allocations/s"
                ),
                severity="warning",
            ),
        ]
