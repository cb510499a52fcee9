"""KVCacheReuseCollapse and CUDAMemoryGrowth on synthetic allocator counts."""

from __future__ import annotations

from kvwatch.daemon.config import ReuseCollapseConfig
from kvwatch.daemon.config.base import parse
from kvwatch.daemon.detectors.reuse_collapse import ALERT, GROWTH, ReuseCollapse, allocator_settings
from kvwatch.daemon.model.cuda import CUDA, AllocatorCounts, GpuUse
from kvwatch.daemon.model.engine_scrape import NO_ENGINE, EngineState
from kvwatch.daemon.model.findings import Subject
from kvwatch.daemon.model.history import History
from kvwatch.daemon.model.windows import NodeWindow, ProcessWindow

MIB = 1024 * 1024


class Proc:
    def __init__(self, config: ReuseCollapseConfig, environ: dict[str, str] | None = None, age: float = 1000.0) -> None:
        self.det = ReuseCollapse(config)
        self.allocator: History[AllocatorCounts] = History(AllocatorCounts)
        self.tot = AllocatorCounts()
        self.t = 0.0
        self.age = age
        self.environ = environ or {}
        self.engine = NO_ENGINE  # what the engine's server says of it (its sleep)

    def step(
        self,
        allocs: float = 0,
        frees: float | None = None,
        size: int = 20 * MIB,
        failures: float = 0,
        after_fail: float = 0,
        clustered: float = 0,
        freed_size: int | None = None,
        pool: float = 60e9,
    ) -> dict[str, object]:
        frees = allocs if frees is None else frees
        self.t += 1
        t = self.tot
        seg = allocs if size in (2 * MIB, 20 * MIB) else 0
        self.tot = AllocatorCounts(
            alloc_calls=t.alloc_calls + allocs,
            free_calls=t.free_calls + frees,
            alloc_bytes=t.alloc_bytes + allocs * size,
            freed_bytes=t.freed_bytes + frees * (size if freed_size is None else freed_size),
            alloc_failures=t.alloc_failures + failures,
            frees_after_failure=t.frees_after_failure + after_fail,
            clustered_frees=t.clustered_frees + clustered,
            seg_2m=t.seg_2m + (seg if size == 2 * MIB else 0),
            seg_20m=t.seg_20m + (seg if size == 20 * MIB else 0),
            max_alloc=max(t.max_alloc, pool),
        )
        self.allocator.add(self.t, {CUDA: self.tot})
        pw = ProcessWindow(
            Subject("p", {"pid": "1"}),
            self.age + self.t,
            environ=self.environ,
            allocator=self.allocator,
            engine_state=self.engine,
            gpu=GpuUse(device_total_bytes=140e9),
        )
        out = {f.alert: f for f in self.det.evaluate(NodeWindow(now=self.t, processes={"p": pw}, tiers={}))}
        return out


def cfg(**kw: object) -> ReuseCollapseConfig:
    return parse(
        ReuseCollapseConfig,
        {
            "warmup_seconds": 0,
            "baseline_min_seconds": 5,
            "window_seconds": 2,
            "confirm_windows": 2,
            "clear_windows": 3,
            **kw,
        },
    )


def run(p: Proc, n: int, **kw: object) -> list[bool]:
    return [p.step(**kw)[ALERT].firing for _ in range(n)]  # type: ignore[attr-defined]


def test_empty_cache_collapse_fires_with_cause() -> None:
    p = Proc(cfg())
    assert not any(run(p, 20, allocs=0.5))  # a cache that mostly hits: baseline ~0.5/s
    fired = run(p, 6, allocs=300, clustered=280)
    assert fired.index(True) == 1
    assert p.step(allocs=300, clustered=280)[ALERT].cause == "empty_cache"  # type: ignore[attr-defined]


def test_causes() -> None:
    p = Proc(cfg(), environ={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
    run(p, 10, allocs=0.2)
    assert any(run(p, 4, allocs=200)) and p.step(allocs=200)[ALERT].cause == "uncached"  # type: ignore[attr-defined]
    p = Proc(cfg())
    run(p, 10, allocs=0.2)
    run(p, 4, allocs=100, failures=3, after_fail=90)
    assert p.step(allocs=100, failures=3, after_fail=90)[ALERT].cause == "oom_retry"  # type: ignore[attr-defined]
    p = Proc(cfg())
    run(p, 10, allocs=0.2)
    run(p, 4, allocs=100, size=2 * MIB)
    assert p.step(allocs=100, size=2 * MIB)[ALERT].cause == "fragmentation"  # type: ignore[attr-defined]


def test_growth_is_a_leak_not_a_collapse() -> None:
    p = Proc(cfg())
    run(p, 10, allocs=0.2)
    out = [p.step(allocs=100, frees=0) for _ in range(5)]
    assert not any(o[ALERT].firing for o in out)  # type: ignore[attr-defined]
    assert any(o[GROWTH].firing for o in out)  # type: ignore[attr-defined]


def test_floor_and_warmup_and_kv_pool() -> None:
    p = Proc(cfg())
    assert not any(run(p, 30, allocs=15))  # churn, but under the 20/s floor
    p = Proc(cfg(warmup_seconds=120), age=0)
    assert not any(run(p, 60, allocs=500))  # start-up: graph capture, torch.compile
    p = Proc(cfg())
    assert not any(run(p, 30, allocs=500, pool=1e9))  # no KV pool yet (1 GB of a 140 GB device)


def test_baseline_of_async_backend() -> None:
    env = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync,expandable_segments:False"}
    assert allocator_settings(env) == {"backend": "cudaMallocAsync", "expandable_segments": "False"}
    p = Proc(cfg(baseline_half_life_seconds=20), environ=env)
    assert not any(run(p, 120, allocs=400))  # a call per tensor is its normal
    assert not any(run(p, 5, allocs=1200))  # 3x its own baseline is not a collapse
    assert any(run(p, 5, allocs=8000))


def test_clears_after_recovery() -> None:
    p = Proc(cfg())
    run(p, 10, allocs=0.2)
    assert any(run(p, 5, allocs=300, clustered=250))
    states = run(p, 8, allocs=0.2)
    assert states[-1] is False


def test_sleep_mode_release_and_remap_are_intentional() -> None:
    """vLLM sleep mode: its engine's server reports sleep (mirrored onto this process); the KV
    pool and weights are released, then mapped again at wake-up in a burst. Neither is churn nor
    growth: the process warms up anew after waking."""
    p = Proc(cfg(quiet_after_sleep_seconds=6))
    run(p, 10)
    p.engine = EngineState(tapped=True, sleeping=True)
    for _ in range(3):
        f = p.step(allocs=0, frees=80, size=2 * MIB)
        assert not f[ALERT].firing and not f[GROWTH].firing  # type: ignore[attr-defined]
    p.engine = EngineState(tapped=True, sleeping=False)
    for _ in range(4):  # wake-up: 80 mappings a second, nothing freed
        f = p.step(allocs=80, frees=0, size=2 * MIB)
        assert not f[ALERT].firing and not f[GROWTH].firing  # type: ignore[attr-defined]
    run(p, 10)  # quiet, then the baseline learnt anew (what the wake-up did is not in it)
    assert any(run(p, 4, allocs=80, size=2 * MIB))  # warm again: churn is an alert
