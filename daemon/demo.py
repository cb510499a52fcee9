"""``kvwatch demo``: the daemon plus built-in workloads that reproduce each failure for real.

* host-tier: a pretend engine with a disk KV tier (files read into the page
  cache) is squeezed by its own memory cgroup: the kernel evicts the tier while
  the engine keeps reading it back → KVHostTierEvictionUnderPressure.
* reuse-collapse: a pretend engine allocates GPU memory through a stand-in CUDA
  runtime (built here; no GPU needed) first from its cache, then as if
  ``torch.cuda.empty_cache()`` ran every step → KVCacheReuseCollapse.
* oom: a pretend engine in a small cgroup allocates until the OOM killer takes
  it → InferenceProcessOOMKilled.

Needs root (BPF, cgroups). Everything it creates is removed at the end.
"""

from __future__ import annotations

import argparse
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvwatch.daemon.config import Config
from kvwatch.daemon.memcg import CgroupUnavailable, MemoryCgroup
from kvwatch.daemon.snapshot import Snapshot
from kvwatch.daemon.stublib import StubBuildError, build
from kvwatch.daemon.workloads import MIB, Workload, drop_file_cache, make_files

DEMO_RULE = {
    "engine": "demo",
    "cmdline": r"^\S*python\S*\s+-m\s+kvwatch\.daemon\.workloads\s+(engine|oom|cuda)\b",
}
KV_FILES, KV_FILE_MB = 32, 16
CGROUP_MB, SQUEEZE_MB = 768, 640


def demo_config(base: Config, kv_dir: Path, listen: str) -> Config:
    data = base.model_dump()
    data["daemon"]["listen"] = listen
    data["discovery"]["rules"] = [*data["discovery"]["rules"], DEMO_RULE]
    data["discovery"]["interval_seconds"] = 1.0
    data["kv_tiers"]["dirs"] = [{"path": kv_dir, "name": "demo-disk-tier"}]
    data["kv_tiers"]["rescan_seconds"] = 2.0
    ht = data["detectors"]["host_tier_eviction"]
    ht.update(warmup_seconds=0.0, window_seconds=2.0, floor_bytes_per_second=32 * MIB)
    data["detectors"]["reuse_collapse"].update(warmup_seconds=1.0, baseline_min_seconds=2.0)
    data["probes"]["cuda_rescan_seconds"] = 1.0
    return Config.model_validate(data)


def _say(msg: str) -> None:
    print(f"demo: {msg}", flush=True)


def _wait_for(get: Callable[[], Snapshot], pred: Callable[[Snapshot], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred(get()):
            return True
        time.sleep(0.1)
    return False


def _firing(name: str) -> Callable[[Snapshot], bool]:
    return lambda s: any(a.alert == name for a in s.alerts)


def _watching(pid: int) -> Callable[[Snapshot], bool]:
    return lambda s: any(p.pid == pid and p.alive for p in s.processes)


def _engine(args: list[str], cg: MemoryCgroup) -> Workload:
    child = Workload(*args)
    cg.add(child.pid)
    return child


def scenario_host_tier(get: Callable[[], Snapshot], work: Path) -> bool:
    kv = work / "kv"
    _say(f"writing a {KV_FILES * KV_FILE_MB} MiB disk KV tier in {kv}")
    files = make_files(kv, KV_FILES, KV_FILE_MB * MIB)
    drop_file_cache(files)
    with MemoryCgroup("kvwatch-demo-engine", CGROUP_MB * MIB) as cg:
        child = _engine(
            [
                "engine",
                "--kv-dir",
                str(kv),
                "--squeeze-mb",
                str(SQUEEZE_MB),
                "--rate-mb",
                "200",
                "--seconds",
                "15",
            ],
            cg,
        )
        try:
            if not _wait_for(get, _watching(child.pid), 10):
                _say("the engine was not discovered")
                return False
            _say(f"engine pid {child.pid} discovered; warming its tier (reads every file)")
            child.step("warm", "warm")
            time.sleep(3)
            _say(
                f"squeezing: the engine allocates {SQUEEZE_MB} MiB in its {CGROUP_MB} MiB cgroup"
                " while it keeps serving from the tier"
            )
            t0 = time.monotonic()
            child.send("squeeze")
            ok = _wait_for(get, _firing("KVHostTierEvictionUnderPressure"), 30)
            if ok:
                a = next(a for a in get().alerts if a.alert == "KVHostTierEvictionUnderPressure")
                _say(
                    f"ALERT KVHostTierEvictionUnderPressure cause={a.cause} "
                    f"after {time.monotonic() - t0:.1f} s: {a.summary}"
                )
            else:
                _say("no host-tier alert within 30 s")
            child.send("exit")
            return ok
        finally:
            child.close()


def scenario_reuse_collapse(get: Callable[[], Snapshot], work: Path) -> bool | None:
    try:
        lib_dir = build(work / "stubcuda").parent
    except StubBuildError as err:
        _say(f"reuse-collapse skipped: {err}")
        return None
    with Workload("cuda", "--lib-dir", str(lib_dir)) as child:
        child.expect("ready")

        def attached(s: Snapshot) -> bool:
            return any(p.pid == child.pid and p.cuda and p.cuda.symbols_attached for p in s.processes)

        if not _wait_for(get, attached, 10):
            _say("the CUDA engine was not attached")
            return False
        _say(f"engine pid {child.pid}: CUDA probes attached; 4 s of a warm allocator cache (no cudaMalloc)")
        child.step("cached 1 4", "done")
        _say("now every step frees its segments and allocates them again, like empty_cache() in the loop")
        t0 = time.monotonic()
        child.send("emptycache 40 8")
        ok = _wait_for(get, _firing("KVCacheReuseCollapse"), 8)
        if ok:
            a = next(a for a in get().alerts if a.alert == "KVCacheReuseCollapse")
            _say(f"ALERT KVCacheReuseCollapse cause={a.cause} after {time.monotonic() - t0:.1f} s: {a.summary}")
        else:
            _say("no reuse-collapse alert within 8 s")
        child.expect("done")
        return ok


def scenario_oom(get: Callable[[], Snapshot]) -> bool:
    with MemoryCgroup("kvwatch-demo-oom", 64 * MIB) as cg:
        child = _engine(["oom"], cg)
        try:
            if not _wait_for(get, _watching(child.pid), 10):
                _say("the OOM engine was not discovered")
                return False
            _say(f"engine pid {child.pid} discovered; allocating until its 64 MiB cgroup runs out")
            t0 = time.monotonic()
            child.send("go")
            ok = _wait_for(get, _firing("InferenceProcessOOMKilled"), 20)
            if ok:
                a = next(a for a in get().alerts if a.alert == "InferenceProcessOOMKilled")
                _say(f"ALERT InferenceProcessOOMKilled after {time.monotonic() - t0:.1f} s: {a.summary}")
            else:
                _say("no OOM alert within 20 s")
            return ok
        finally:
            child.close()


def run_demo(base: Config, args: argparse.Namespace) -> int:
    from kvwatch.daemon.cli import Daemon  # noqa: PLC0415 - avoid an import cycle

    work: Path = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    config = demo_config(base, work / "kv", args.listen)
    daemon = Daemon(config)
    daemon.install_signal_handlers()
    runner = threading.Thread(target=daemon.serve, name="kvwatch-demo-daemon", daemon=True)
    runner.start()

    def get() -> Snapshot:
        return daemon.agent.snapshot

    results: dict[str, bool] = {}
    try:
        if not _wait_for(get, lambda s: s.tick > 0, 30):
            _say("daemon did not start")
            return 1
        host, port = daemon.server.address
        _say(f"daemon up: http://{host}:{port}/metrics (ready={get().ready})")
        scenarios = args.scenario or ["host-tier", "reuse-collapse", "oom"]
        try:
            if "host-tier" in scenarios:
                results["host-tier"] = scenario_host_tier(get, work)
            if "reuse-collapse" in scenarios:
                collapse = scenario_reuse_collapse(get, work)
                if collapse is not None:
                    results["reuse-collapse"] = collapse
            if "oom" in scenarios:
                results["oom"] = scenario_oom(get)
        except CgroupUnavailable as err:
            _say(f"cannot run: {err}")
            return 1
    finally:
        daemon.stop.set()
        runner.join(15)
        shutil.rmtree(work, ignore_errors=True)
    for name, ok in results.items():
        _say(f"{name}: {'alert fired' if ok else 'NO ALERT'}")
    return 0 if results and all(results.values()) else 1
