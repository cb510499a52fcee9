"""`kvwatch run` with CUDA probes: metrics and KVCacheReuseCollapse with each cause, from the stub runtime."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwatch.daemon.lab.workloads import workload_rule
from tests.support.daemon import DaemonProcess, daemon, wait_attached, wait_until
from tests.support.kernel import Child

RULE = workload_rule("stubengine", "cuda")
CONFIG = rf"""
[daemon]
tick_seconds = 0.5
[discovery]
interval_seconds = 0.5
rules = [{RULE}]
[probes]
cuda_rescan_seconds = 1
[detectors.eviction_burst]
warmup_seconds = 0.5
baseline_min_seconds = 2
window_seconds = 2
confirm_windows = 2
clear_windows = 2
[detectors.reuse_collapse]
warmup_seconds = 0.5
baseline_min_seconds = 2
window_seconds = 2
confirm_windows = 2
clear_windows = 2
"""


@pytest.fixture(scope="module")
def kvw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with daemon(tmp_path_factory.mktemp("kvw"), CONFIG) as d:
        yield d


def alert(d: DaemonProcess, pid: int, name: str = "KVCacheReuseCollapse") -> dict[str, str] | None:
    for lab, v in d.metrics().get("kvwatch_alert_active", []):
        if lab["alert"] == name and lab["pid"] == str(pid) and v == 1:
            return lab
    return None


def fired(d: DaemonProcess, pid: int, name: str) -> list[str]:
    """The causes ``name`` fired with for ``pid``, from the daemon's log."""
    return [
        str(e["cause"])
        for e in d.log_events()
        if e.get("event") == "alert firing" and e.get("alert") == name and e.get("label_pid") == str(pid)
    ]


def scenario(
    d: DaemonProcess,
    stub: Path,
    pattern: str,
    rate: int,
    expect: str | None,
    name: str = "KVCacheReuseCollapse",
) -> None:
    with Child("cuda", "--lib-dir", str(stub)) as w:
        w.expect("ready")
        wait_attached(d, w.pid)
        w.step("cached 1 3.5", "done", timeout=30)  # warm-up and a quiet baseline: every tensor from the cache
        assert alert(d, w.pid, name) is None
        w.send(f"{pattern} {rate} 6")
        if expect is None:
            w.expect("done", timeout=30)
            d.wait_ticks(2)  # the daemon has judged every window of the pattern
            assert fired(d, w.pid, name) == [], f"{pattern} alerted"
        else:
            wait_until(lambda: alert(d, w.pid, name) is not None, 30, f"{name} for {pattern}")
            lab = alert(d, w.pid, name)
            assert lab is not None and lab["cause"] == expect and lab["engine"] == "stubengine"
            w.expect("done", timeout=30)


def test_metrics_from_the_stub(kvw: DaemonProcess, stub: Path) -> None:
    with Child("cuda", "--lib-dir", str(stub), "--prealloc", "0") as w:
        w.expect("ready")
        wait_attached(kvw, w.pid)
        w.step("emptycache 100 1", "done", timeout=30)
        w.step("expandable 100 0.5", "done", timeout=30)
        pid = str(w.pid)

        def counts() -> tuple[float, ...]:
            """Every number asserted below, from one scrape (two scrapes can straddle a tick)."""
            m = DaemonProcess.value_in(kvw.metrics())
            return (
                m("kvwatch_cuda_alloc_calls_total", pid=pid, api="cudaMalloc", result="ok"),
                m("kvwatch_cuda_free_calls_total", pid=pid, api="cudaFree", result="ok"),
                m("kvwatch_cuda_alloc_calls_total", pid=pid, api="cuMemAlloc", result="ok"),
                m("kvwatch_cuda_alloc_bytes_total", pid=pid, api="cudaMalloc"),
                m("kvwatch_cuda_outstanding_bytes", pid=pid, kind="device"),
                m("kvwatch_cuda_alloc_calls_total", pid=pid, api="cuMemCreate", result="ok"),
                m("kvwatch_cuda_vmm_map_calls_total", pid=pid, api="cuMemMap"),
                m("kvwatch_probe_hits_total", family="cuda", probe="cudaMalloc"),
            )

        # the workload is done: once the published numbers stop moving (3 ticks) they are final
        mallocs, frees, mem_alloc, alloc_bytes, outstanding, creates, maps, hits = kvw.settled(counts)
        assert mallocs > 0 and mallocs % 6 == 0
        assert frees == mallocs and mem_alloc == 0
        assert alloc_bytes == mallocs / 2 * 22 * 2**20
        assert outstanding == 0
        assert creates > 0 and maps > 0
        assert hits >= mallocs
    wait_until(lambda: kvw.value("kvwatch_cuda_probes_attached", pid=pid) == 0, 10, "detached after exit")


def test_empty_cache_collapse(kvw: DaemonProcess, stub: Path) -> None:
    scenario(kvw, stub, "emptycache", 40, "empty_cache")


def test_uncached_collapse(kvw: DaemonProcess, stub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    scenario(kvw, stub, "uncached", 200, "uncached")


def test_oom_retry_collapse(kvw: DaemonProcess, stub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVWSTUB_CAPACITY", str(200 * 2**20))
    scenario(kvw, stub, "oomretry", 200, "oom_retry")


def test_fragmentation_collapse(kvw: DaemonProcess, stub: Path) -> None:
    scenario(kvw, stub, "fragmentation", 200, "fragmentation")


def test_cached_stays_silent(kvw: DaemonProcess, stub: Path) -> None:
    scenario(kvw, stub, "cached", 200, None)


def test_growth_is_reported_as_growth(kvw: DaemonProcess, stub: Path) -> None:
    scenario(kvw, stub, "growth", 100, "leak", name="CUDAMemoryGrowth")


def test_offload_reload_churn_without_engine_data(kvw: DaemonProcess, stub: Path) -> None:
    """No KV event stream, no engine metrics: 2 MiB stored to host and 2 MiB loaded back 100
    times a second (cudaMemcpyAsync both ways) is the OS-side sign of an eviction burst."""
    scenario(kvw, stub, "offload", 100, "thrash", name="KVEvictionBurst")
    pid = [lab["pid"] for lab, _ in kvw.metrics()["kvwatch_cuda_copy_bytes_total"] if lab["direction"] == "d2h"]
    assert pid
    d2h = kvw.value("kvwatch_cuda_copy_bytes_total", direction="d2h", pid=pid[-1])
    h2d = kvw.value("kvwatch_cuda_copy_bytes_total", direction="h2d", pid=pid[-1])
    assert d2h == h2d > 0 and d2h % (2 << 20) == 0  # whole 2 MiB copies, as many each way
